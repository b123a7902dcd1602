"""The edits form: every edit a GPU container gets, in one record (Edits).

nvctk's one intermediate form, as NVIDIA's toolkit turns discovery into CDI
container edits: device nodes (with their cgroup rules), mounts (each saying
whether the container may start without it), symlinks, env, the ldconfig step,
the /proc mask, the vGPU mounts, hooks, and the decisions the writers only
execute (NVIDIA hooks to remove, the user-namespace seccomp rule, the rootfs dirs
the hook pins, where the hook logs) and where it came from (origin). One planner
makes it for all three paths (nvctk.plan.make.plan_container): legacy mode (from the
request and host), CDI mode (nvctk.plan.cdi decides from the CDI devices' edits) and
`nvctk cdi generate` (nvctk.cdi.generate writes it out as a CDI spec). nvctk.spec.apply is the one module that applies it to
config.json; the runtime saves it beside the spec and the prestart hook reads it
back (nvctk.edits_file: its name, writer and reader), deciding nothing the form does
not say.

One vocabulary: the form is the edits (Edits, Vgpu, EDITS_FILE, load_edits,
apply_edits); nvctk.plan is the step that makes it (plan_container).
"""

from __future__ import annotations

import posixpath

from nvctk.base import jsonio
from nvctk.base.record import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Literal

# the host side of a vGPU container's state (nvctk.vgpu.state), below its own tmpfs:
# ro/ is mounted read-only at /run/nvctk, rw/ (the accounting dir) read-write over its
# placeholder ro/vgpu; the other names are files, or placeholders (mount points) for
# the files bound over them. Nothing the container can write backs a read-only bind.
VGPU_DIRS = ("ro", "rw")
VGPU_FILES = ("ro/limits", "ro/ld.so.preload", "rw/cache", "rw/limits")
PRELOAD = "/etc/ld.so.preload"
# the most of an image's ld.so.preload nvctk reads (and the vGPU state's copy holds)
MAX_PRELOAD_BYTES = 64 * 1024

SERVED_FLAG = "--served"  # nvctk-hook prestart's: the token of nvctk-runtime's server
HOOK_NAME = "nvctk-hook"  # args[0] of nvctk's hooks (how a later create finds them)
# the hooks' PATH: built from scratch, never the container's (CVE-2025-23266: a
# container's LD_PRELOAD reaching a host-side hook)
HOOK_PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Hooks that Docker's --gpus (and NVIDIA's own runtime) put into specs: we replace them.
NVIDIA_HOOK_NAMES = ("nvidia-container-runtime-hook", "nvidia-container-toolkit")
# rootfs dirs the prestart hook pins (binds onto themselves) before a vGPU's mounts,
# so no link the image planted on the way can redirect them
VGPU_PINS = ("etc", "run")

def bind_options(read_only: bool, noexec: bool) -> tuple[str, ...]:
    """The options of a bind mount nvctk's form makes, as a CDI spec says them
    (nvctk.cdi.generate writes them; CDI mode reads them back): a read-only file is
    bind_options(True, False), a writable IPC path bind_options(False, True)."""
    base = ("nosuid", "nodev", "rbind", "rprivate")
    return (*(("ro",) if read_only else ()), *base, *(("noexec",) if noexec else ()))


# the other way: (read_only, noexec) of the options `nvctk cdi generate` writes
BIND_FLAGS = {bind_options(r, x): (r, x) for r in (True, False) for x in (True, False)}



class DeviceNode(Record):
    __slots__ = ("path", "host_path", "major", "minor", "type", "file_mode",  # noqa: RUF023
                 "uid", "gid", "permissions")

    def __init__(self, path: str, host_path: str, major: int, minor: int,
                 type: Literal["c", "b", "u", "p"] = "c", file_mode: int | None = 0o666,
                 uid: int | None = 0, gid: int | None = 0,
                 permissions: str = "rwm") -> None:
        self.path = path  # path inside the container, e.g. /dev/nvidia0
        self.host_path = host_path  # node on the host (under the driver root's dev dir)
        self.major = major
        self.minor = minor
        self.type = type
        self.file_mode = file_mode  # None: not set in the spec (a CDI spec's own choice)
        self.uid = uid
        self.gid = gid
        self.permissions = permissions  # the cgroup rule's access


class Mount(Record):
    __slots__ = ("host_path", "container_path", "kind", "read_only", "noexec",  # noqa: RUF023
                 "required", "options", "fs_type")

    def __init__(self, host_path: str, container_path: str,
                 kind: Literal["file", "dir", "socket"] = "file", read_only: bool = True,
                 noexec: bool = False, required: bool = False,
                 options: tuple[str, ...] | None = None, fs_type: str | None = None) -> None:
        self.host_path = host_path
        self.container_path = container_path
        self.kind = kind
        self.read_only = read_only  # IPC mounts are writable but noexec
        self.noexec = noexec
        # the container does not start without it (a missing source, or a destination
        # off the rootfs's own mounts); else the hook skips it, saying so in the log
        self.required = required
        # a foreign CDI spec's mount, verbatim: its options and type go into the spec as
        # they are (None: nvctk's own, bind options from kind/read_only/noexec)
        self.options = options
        self.fs_type = fs_type


class Hook(Record):
    """An OCI hook nvctk puts into the spec (hooks.<stage>)."""

    __slots__ = ("stage", "path", "args", "env", "timeout")  # noqa: RUF023

    def __init__(self, stage: str, path: str, args: tuple[str, ...],
                 env: tuple[str, ...] = (), timeout: int = 0) -> None:
        self.stage = stage  # prestart, poststop, createRuntime, ...
        self.path = path
        self.args = args
        self.env = env  # built from scratch: never the container's
        self.timeout = timeout  # seconds, 0: none

    def entry(self) -> dict[str, Any]:
        """The spec's hook object."""
        out: dict[str, Any] = {"path": self.path, "args": list(self.args)}
        if self.env:
            out["env"] = list(self.env)
        if self.timeout:
            out["timeout"] = self.timeout
        return out


class Symlink(Record):
    __slots__ = ("container_path", "target")

    def __init__(self, container_path: str, target: str) -> None:
        self.container_path = container_path
        self.target = target  # relative or absolute as it should read inside the container


class ProcMask(Record):
    """Mask /proc/driver/nvidia with a tmpfs holding only these host files."""

    __slots__ = ("host_dir", "gpu_bus_ids")  # noqa: RUF023

    def __init__(self, host_dir: str, gpu_bus_ids: tuple[str, ...]) -> None:
        self.host_dir = host_dir  # the driver's /proc/driver/nvidia on the host
        # gpus/<busid> dirs to copy (lower-case, as procfs names them)
        self.gpu_bus_ids = gpu_bus_ids


class LogSettings(Record):
    """Where and how the hook logs: the runtime puts its config's values here, so the
    hook loads no config."""

    __slots__ = ("file", "level", "format")  # noqa: RUF023

    def __init__(self, file: str, level: str = "info", format: str = "text") -> None:
        self.file = file
        self.level = level
        self.format = format


class Vgpu(Record):
    __slots__ = ("library", "container_library", "state_dir",  # noqa: RUF023
                 "container_state_dir", "limits", "root_readonly", "mounts",
                 "preload_entries")

    def __init__(self, library: str, container_library: str, state_dir: str,
                 container_state_dir: str, limits: dict[str, str] | None = None,
                 root_readonly: bool = False, mounts: tuple[Mount, ...] = (),
                 preload_entries: tuple[str, ...] = ()) -> None:
        self.library = library  # host path of libvgpu.so
        self.container_library = container_library  # where it is mounted
        # per-container state on the host: its own tmpfs holding ro/ and rw/
        self.state_dir = state_dir
        self.container_state_dir = container_state_dir  # where rw/ is mounted in the container
        # validated CUDA_DEVICE_* values
        self.limits: dict[str, str] = {} if limits is None else limits
        # the spec's root.readonly: the hook's pins of /etc and /run are then read-only
        # too (runc remounts only / read-only)
        self.root_readonly = root_readonly
        # the state's mounts, in their order, after the hook pins /etc and /run; each
        # lands at exactly its path (no link on the way) and all are required
        self.mounts = mounts
        # the image's own /etc/ld.so.preload lines to keep after libvgpu's (read by
        # discovery, decided by the planner; the state's ld.so.preload is built from them)
        self.preload_entries = preload_entries


class Edits(Record):
    __slots__ = ("driver_version", "capabilities", "gpu_uuids", "devices",  # noqa: RUF023
                 "mounts", "symlinks", "proc_mask", "lib_dir", "ldconfig", "env", "vgpu",
                 "hooks", "remove_hooks", "seccomp_block_userns", "pins", "log", "selected",
                 "origin")

    def __init__(
        self,
        driver_version: str,
        capabilities: tuple[str, ...],
        gpu_uuids: tuple[str, ...],
        devices: tuple[DeviceNode, ...] = (),
        mounts: tuple[Mount, ...] = (),
        symlinks: tuple[Symlink, ...] = (),
        proc_mask: ProcMask | None = None,
        lib_dir: str = "/usr/lib/x86_64-linux-gnu",
        ldconfig: str = "/sbin/ldconfig",
        env: dict[str, str] | None = None,
        vgpu: Vgpu | None = None,
        hooks: tuple[Hook, ...] = (),
        remove_hooks: tuple[str, ...] = NVIDIA_HOOK_NAMES,
        seccomp_block_userns: bool | None = None,
        pins: tuple[str, ...] | None = None,
        log: LogSettings | None = None,
        selected: tuple[str, ...] = (),
        origin: Literal["legacy", "cdi"] = "legacy",
    ) -> None:
        # provenance (what was asked and found; the writers apply none of it)
        self.driver_version = driver_version
        self.capabilities = capabilities
        # selected GPUs (parents included for MIG), container order
        self.gpu_uuids = gpu_uuids
        # what goes into config.json (nvctk.spec.apply)
        self.devices = devices
        self.env: dict[str, str] = {} if env is None else env  # added to process.env
        # OCI hooks: ours (prestart/poststop; each replaces ours at its stage) and a
        # CDI spec's foreign ones, verbatim
        self.hooks = hooks
        self.remove_hooks = remove_hooks  # hooks (by path basename / args[0]) dropped first
        # block new user namespaces by seccomp (a vGPU container: in one it could mount
        # over the cap's files); None: the default decision, vgpu is not None
        self.seccomp_block_userns = vgpu is not None if seccomp_block_userns is None \
            else seccomp_block_userns
        # what the prestart hook does in the container (nvctk.hook.worker)
        self.mounts = mounts
        self.symlinks = symlinks
        self.proc_mask = proc_mask
        # the ldconfig step: the host's ldconfig (run chrooted in the rootfs) over lib_dir;
        # ldconfig "" is no step
        self.lib_dir = lib_dir  # container lib dir the libraries land in
        self.ldconfig = ldconfig
        self.vgpu = vgpu
        # rootfs dirs the hook pins before its mounts (None: the default decision,
        # VGPU_PINS for a vGPU container, else none)
        self.pins = (VGPU_PINS if vgpu is not None else ()) if pins is None else pins
        self.log = log  # the hook's log settings (None: the hook reads nvctk's config)
        # the selected devices' UUIDs (a MIG device's own) in the order libvgpu indexes
        # them: what the runtime decided, for readers of the saved form (the monitor)
        self.selected = selected
        # where it came from: the host (legacy mode) or CDI devices (CDI mode), whose
        # entries may be any device, variable or mount (the spec's record says so)
        self.origin = origin

    def has_hook_work(self) -> bool:
        """Whether the prestart hook has anything to do in the container."""
        # a mount with options is a CDI spec's own, made by runc: not the hook's
        return bool(any(m.options is None for m in self.mounts) or self.symlinks
                    or self.proc_mask is not None or self.ldconfig or self.vgpu is not None)

    def to_json(self) -> str:
        return jsonio.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Edits:
        return cls.from_dict(jsonio.loads(text))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Edits:
        d = dict(d)
        d["capabilities"] = tuple(d["capabilities"])
        d["gpu_uuids"] = tuple(d["gpu_uuids"])
        d["devices"] = tuple(DeviceNode(**x) for x in d["devices"])
        d["mounts"] = tuple(_mount(x) for x in d["mounts"])
        d["symlinks"] = tuple(Symlink(**x) for x in d["symlinks"])
        if d["proc_mask"] is not None:
            pm = d["proc_mask"]
            d["proc_mask"] = ProcMask(pm["host_dir"], tuple(pm["gpu_bus_ids"]))
        if d["vgpu"] is not None:
            v = dict(d["vgpu"])
            v["mounts"] = tuple(_mount(x) for x in v["mounts"])
            v["preload_entries"] = tuple(v.get("preload_entries", ()))
            d["vgpu"] = Vgpu(**v)
        d["hooks"] = tuple(Hook(h["stage"], h["path"], tuple(h["args"]), tuple(h["env"]),
                                h["timeout"]) for h in d["hooks"])
        if "remove_hooks" in d:
            d["remove_hooks"] = tuple(d["remove_hooks"])
        if d.get("pins") is not None:
            d["pins"] = tuple(d["pins"])
        if d.get("log") is not None:
            d["log"] = LogSettings(**d["log"])
        d["selected"] = tuple(d.get("selected", ()))  # () in a form saved before it
        return cls(**d)


def _mount(x: dict[str, Any]) -> Mount:
    if x.get("options") is not None:
        x = dict(x, options=tuple(x["options"]))
    return Mount(**x)


def hook_env(nvctk_config: str | None) -> tuple[str, ...]:
    """The env nvctk's hooks run with: built from scratch, never the container's;
    NVCTK_CONFIG passed on when the runtime was given one."""
    return (HOOK_PATH_ENV, f"NVCTK_CONFIG={nvctk_config}") if nvctk_config else (HOOK_PATH_ENV,)


def prestart_hook(hook_path: str, nvctk_config: str | None, timeout: int = 0) -> Hook:
    """`nvctk-hook prestart`: the one builder of nvctk's prestart hook."""
    return Hook("prestart", hook_path, (HOOK_NAME, "prestart"), hook_env(nvctk_config), timeout)


def is_prestart_hook(hook: Hook) -> bool:
    """nvctk's own prestart hook (served or not)."""
    return hook.stage == "prestart" and hook.args[:2] == (HOOK_NAME, "prestart")


def with_server(edits: Edits, token: str) -> Edits:
    """The form with its prestart hook handing its state to nvctk-runtime's server named
    `token` (`--served TOKEN`, nvctk.hook.served); the form unchanged when it has none."""
    return edits.replace(hooks=tuple(
        Hook(h.stage, h.path, (*h.args[:2], SERVED_FLAG, token), h.env, h.timeout)
        if is_prestart_hook(h) else h for h in edits.hooks))


def saved_part(edits: Edits) -> Edits:
    """What the prestart hook reads of the form (saved beside the spec): nvctk's own mounts
    and hooks only; a foreign CDI spec's are runc's to make, verbatim."""
    return edits.replace(mounts=tuple(m for m in edits.mounts if m.options is None),
                         hooks=tuple(h for h in edits.hooks if h.args[:1] == (HOOK_NAME,)))

# nvctk-hook's CDI hook commands (`nvctk cdi generate` writes cdi-edits; specs written
# before it have create-symlinks and update-ldcache) and the flags each takes. --pin NAME:
# the rootfs's top dir NAME pinned (a DRA share's spec: /etc and /run, which hold its
# preload and limits, as the prestart hook pins them for a vGPU container)
CDI_HOOK_FLAGS = {"create-symlinks": ("--link",), "update-ldcache": ("--folder",),
                  "cdi-edits": ("--link", "--folder", "--pin")}


class CdiHookArgs(Record):
    """What an nvctk-hook CDI hook's arguments add to the form."""

    __slots__ = ("links", "folder", "pins")  # noqa: RUF023

    def __init__(self, links: tuple[Symlink, ...], folder: str | None,
                 pins: tuple[str, ...] = ()) -> None:
        self.links = links
        self.folder = folder  # the ldconfig step's folder (None: no step)
        self.pins = pins  # rootfs top dirs the hook pins first (VGPU_PINS at most)


def cdi_hook_args(cmd: str, args: list[str] | tuple[str, ...]) -> CdiHookArgs:
    """What an nvctk-hook CDI hook's arguments after the command add to the form.
    ValueError says what is wrong with them."""
    flags = CDI_HOOK_FLAGS[cmd]
    links: list[Symlink] = []
    pins: list[str] = []
    folder: str | None = None
    it = iter(args)
    for a in it:
        if a not in flags:
            raise ValueError(f"unexpected argument {a!r} (want {' or '.join(flags)})")
        value = next(it, None)
        if not value or "\0" in value:
            raise ValueError(f"{a} needs a value")
        if a == "--link":
            target, sep, path = value.partition("::")
            if not sep or not target or not path.startswith("/"):
                raise ValueError(f"--link {value!r}: want TARGET::/ABSOLUTE/PATH")
            links.append(Symlink(path, target))
        elif a == "--pin":
            # only the dirs a vGPU's files live in: a pin is a mount the container keeps
            if value not in VGPU_PINS:
                raise ValueError(f"--pin {value!r}: want one of {', '.join(VGPU_PINS)}")
            if value not in pins:
                pins.append(value)
        else:
            if folder is not None or not value.startswith("/"):
                raise ValueError(f"--folder {value!r}: want one absolute container path")
            folder = value
    if not links and folder is None and not pins:
        raise ValueError(f"{' or '.join(flags)} is required")
    return CdiHookArgs(tuple(links), folder, tuple(pins))


def container_path_of_host(driver_root: str, host: str) -> str:
    """A host path under the driver root as the same path inside the container
    (<root>/var/run/x is /run/x: /var/run is a link to /run)."""
    rel = posixpath.relpath(host, driver_root)
    if rel.startswith(".."):
        return host
    if rel.startswith("var/run/"):
        rel = rel[len("var/") :]
    return "/" + rel


def host_path_of(seen_root: str, host_root: str, path: str) -> str:
    """A path under the driver root as this process sees it (seen_root) as the host
    sees it (under host_root): what a CDI spec written from a container must name.
    A path outside seen_root is the host's already (the config's extra mounts)."""
    if seen_root == host_root:
        return path
    rel = posixpath.relpath(path, seen_root)
    if rel.startswith(".."):
        return path
    return host_root if rel == "." else posixpath.join(host_root, rel)


def on_host(edits: Edits, seen_root: str, host_root: str) -> Edits:
    """The form with its device nodes' and mounts' sources as the host sees them."""
    if seen_root == host_root:
        return edits
    return edits.replace(
        devices=tuple(d.replace(host_path=host_path_of(seen_root, host_root, d.host_path))
                      for d in edits.devices),
        mounts=tuple(m.replace(host_path=host_path_of(seen_root, host_root, m.host_path))
                     for m in edits.mounts))
