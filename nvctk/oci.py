"""OCI runtime-spec pieces: load a bundle's config.json, edit it, save it atomically;
parse the state a hook gets on stdin.

Edits work on the parsed JSON as plain dicts, so every field nvctk does not know
(annotations, seccomp, future spec fields, vendor extensions) is written back
untouched and in its original order. Every edit is idempotent: running the shim
twice on one bundle yields the same file as running it once.
"""

from __future__ import annotations

import os

from nvctk import jsonio
from nvctk.errors import SpecError
from nvctk.record import Record

# typing is for the type checker only: importing it costs every container start
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from nvctk.plan import DeviceNode

SPEC_FILE = "config.json"
CAP_SYS_ADMIN = "CAP_SYS_ADMIN"

# Hooks that Docker's --gpus (and NVIDIA's own runtime) put into specs: we replace them.
NVIDIA_HOOK_NAMES = frozenset({"nvidia-container-runtime-hook", "nvidia-container-toolkit"})
OUR_HOOK_NAME = "nvctk-hook"
HOOK_PATH_ENV = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


# --- spec ----------------------------------------------------------------------------


def spec_path(bundle: str) -> str:
    return os.path.join(bundle, SPEC_FILE)


def load_spec(bundle: str) -> dict[str, Any]:
    """The bundle's config.json as a dict; SpecError naming the file when unusable."""
    path = spec_path(bundle)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file (is {bundle} an OCI bundle?)")
    except OSError as e:
        raise SpecError(f"{path}: cannot read: {e.strerror}")
    return parse_spec(data, path)


def parse_spec(data: bytes | str, where: str = SPEC_FILE) -> dict[str, Any]:
    try:
        spec = jsonio.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise SpecError(f"{where}: invalid JSON: {e}")
    if not isinstance(spec, dict):
        raise SpecError(f"{where}: the spec must be a JSON object, not {type(spec).__name__}")
    for key, kind in (("process", dict), ("linux", dict), ("root", dict), ("hooks", dict),
                      ("mounts", list), ("annotations", dict)):
        if key in spec and spec[key] is not None and not isinstance(spec[key], kind):
            raise SpecError(f"{where}: {key} must be a JSON {kind.__name__.replace('dict', 'object')}")
    process = spec.get("process") or {}
    env = process.get("env")
    if env is not None and (
        not isinstance(env, list) or not all(isinstance(e, str) for e in env)
    ):
        raise SpecError(f"{where}: process.env must be a list of strings")
    return spec


def atomic_write(path: str, data: bytes, mode: int | None = None, *,
                 sync_dir: bool = True) -> None:
    """Replace `path` with `data`: temp file in the same dir, fsync, rename, fsync dir.

    A reader (runc, a crashed shim's retry) sees the old file or the new one,
    never a torn one. Mode and owner follow the file being replaced.
    sync_dir=False leaves the directory's fsync (the rename's durability) to the
    caller's next atomic_write in the same directory, which then covers both renames.
    """
    directory = os.path.dirname(os.path.abspath(path))
    uid = gid = -1
    try:
        st = os.stat(path)
        mode = st.st_mode & 0o7777 if mode is None else mode
        uid, gid = st.st_uid, st.st_gid
    except FileNotFoundError:
        mode = 0o644 if mode is None else mode
    tmp = os.path.join(directory, f".{os.path.basename(path)}.nvctk-{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fchmod(fd, mode)
            if uid >= 0 and (uid, gid) != (os.geteuid(), os.getegid()):
                try:
                    os.fchown(fd, uid, gid)
                except OSError:
                    pass
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if not sync_dir:
        return
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    except OSError:
        pass  # some filesystems refuse fsync on directories; the rename itself is done
    finally:
        os.close(dfd)


def dump_spec(spec: dict[str, Any]) -> bytes:
    # runc and containerd write compact JSON; indenting would only cost bytes
    return jsonio.dumps(spec, ensure_ascii=False).encode("utf-8")


def save_spec(bundle: str, spec: dict[str, Any]) -> None:
    atomic_write(spec_path(bundle), dump_spec(spec))


# --- reading the spec -------------------------------------------------------------------


def spec_env(spec: dict[str, Any]) -> dict[str, str]:
    """process.env as a dict; a later duplicate wins (as NVIDIA's toolkit reads it)."""
    out: dict[str, str] = {}
    for item in (spec.get("process") or {}).get("env") or ():
        key, sep, value = item.partition("=")
        if sep:
            out[key] = value
    return out


def is_privileged(spec: dict[str, Any]) -> bool:
    """CAP_SYS_ADMIN in the process's bounding set: NVIDIA's definition of privileged."""
    caps = (spec.get("process") or {}).get("capabilities")
    if not isinstance(caps, dict):
        return False
    bounding = caps.get("bounding") or ()
    return CAP_SYS_ADMIN in bounding


def root_path(spec: dict[str, Any], bundle: str) -> str:
    """The rootfs as an absolute host path (root.path may be relative to the bundle)."""
    root = spec.get("root") or {}
    path = root.get("path")
    if not isinstance(path, str) or not path:
        raise SpecError(f"{spec_path(bundle)}: root.path is missing")
    return os.path.normpath(os.path.join(bundle, path))


def bundle_in_rootfs(bundle: str, rootfs: str) -> bool:
    """Whether the bundle dir lies inside the rootfs (root.path "." or ".." of it):
    the container could then rewrite config.json and nvctk's plan beside it."""
    b, r = os.path.realpath(bundle), os.path.realpath(rootfs)
    return b == r or b.startswith(r.rstrip("/") + "/")


def spec_mounts(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in spec.get("mounts") or () if isinstance(m, dict)]


# --- editing ------------------------------------------------------------------------------


def _linux(spec: dict[str, Any]) -> dict[str, Any]:
    linux = spec.get("linux")
    if not isinstance(linux, dict):
        linux = spec["linux"] = {}
    return linux


def device_entry(node: DeviceNode) -> dict[str, Any]:
    return {
        "path": node.path,
        "type": node.type,
        "major": node.major,
        "minor": node.minor,
        "fileMode": node.file_mode,
        "uid": 0,
        "gid": 0,
    }


def cgroup_rule(node: DeviceNode) -> dict[str, Any]:
    return {
        "allow": True,
        "type": node.type,
        "major": node.major,
        "minor": node.minor,
        "access": "rwm",
    }


def add_devices(spec: dict[str, Any], nodes: Iterable[DeviceNode]) -> None:
    """linux.devices (runc creates the nodes) + linux.resources.devices allow rules.

    An entry for the same container path is replaced, an identical rule is not
    added again, so repeated creates do not grow the spec.
    """
    linux = _linux(spec)
    devices = linux.get("devices")
    if not isinstance(devices, list):
        devices = linux["devices"] = []
    resources = linux.get("resources")
    if not isinstance(resources, dict):
        resources = linux["resources"] = {}
    rules = resources.get("devices")
    if not isinstance(rules, list):
        rules = resources["devices"] = []
    for node in nodes:
        entry = device_entry(node)
        for i, d in enumerate(devices):
            if isinstance(d, dict) and d.get("path") == node.path:
                devices[i] = entry
                break
        else:
            devices.append(entry)
        rule = cgroup_rule(node)
        if rule not in rules:
            rules.append(rule)


def hook_entry(hook_path: str, timeout: int, nvctk_config: str | None) -> dict[str, Any]:
    """Our prestart hook. Its env is built here from scratch: never the container's
    (a container's LD_PRELOAD reaching a host-side hook was CVE-2025-23266)."""
    env = [HOOK_PATH_ENV]
    if nvctk_config:
        env.append(f"NVCTK_CONFIG={nvctk_config}")
    return {
        "path": hook_path,
        "args": [OUR_HOOK_NAME, "prestart"],
        "env": env,
        "timeout": timeout,
    }


def is_nvidia_hook(hook: Any) -> bool:
    """Docker's --gpus hook or NVIDIA's runtime hook (by path or args[0] basename)."""
    if not isinstance(hook, dict):
        return False
    names = {os.path.basename(str(hook.get("path", "")))}
    args = hook.get("args")
    if isinstance(args, list) and args:
        names.add(os.path.basename(str(args[0])))
    return bool(names & NVIDIA_HOOK_NAMES)


def is_our_hook(hook: Any, kind: str = "prestart") -> bool:
    if not isinstance(hook, dict):
        return False
    args = hook.get("args")
    if not (isinstance(args, list) and len(args) >= 2 and args[1] == kind):
        return False
    # we always write args[0] = nvctk-hook; the path's name depends on hook-path
    return OUR_HOOK_NAME in (os.path.basename(str(hook.get("path", ""))), args[0])


def remove_nvidia_hooks(spec: dict[str, Any]) -> int:
    """Drop NVIDIA's/Docker's GPU hooks from every hook list; returns how many."""
    hooks = spec.get("hooks")
    if not isinstance(hooks, dict):
        return 0
    removed = 0
    for name, entries in list(hooks.items()):
        if isinstance(entries, list):
            kept = [h for h in entries if not is_nvidia_hook(h)]
            removed += len(entries) - len(kept)
            hooks[name] = kept
    return removed


def set_hook(spec: dict[str, Any], hook: dict[str, Any], stage: str = "prestart") -> None:
    """Put `hook` in hooks.<stage>, replacing an earlier nvctk hook of the same kind
    (so a second create does not run the hook twice) and keeping everyone else's."""
    hooks = spec.get("hooks")
    if not isinstance(hooks, dict):
        hooks = spec["hooks"] = {}
    entries = hooks.get(stage)
    if not isinstance(entries, list):
        entries = []
    kind = hook["args"][1]
    kept = [h for h in entries if not is_our_hook(h, kind)]
    kept.append(hook)
    hooks[stage] = kept


def set_env(spec: dict[str, Any], env: dict[str, str]) -> None:
    """Set process.env keys (replacing every earlier occurrence of each key)."""
    if not env:
        return
    process = spec.get("process")
    if not isinstance(process, dict):
        process = spec["process"] = {}
    current = [e for e in process.get("env") or () if e.partition("=")[0] not in env]
    process["env"] = current + [f"{k}={v}" for k, v in env.items()]


# --- state (what hooks read on stdin) --------------------------------------------------


class State(Record):
    __slots__ = ("id", "pid", "bundle", "status", "root", "annotations")  # noqa: RUF023

    def __init__(self, id: str, pid: int, bundle: str, status: str = "",
                 root: str | None = None, annotations: dict[str, str] | None = None) -> None:
        self.id = id
        self.pid = pid
        self.bundle = bundle
        self.status = status
        self.root = root  # crun passes the rootfs; runc does not
        self.annotations: dict[str, str] = {} if annotations is None else annotations


def load_state(text: str | bytes) -> State:
    """The OCI state JSON a hook gets on stdin; SpecError on anything unusable."""
    try:
        d = jsonio.loads(text)
    except (ValueError, UnicodeDecodeError) as e:
        raise SpecError(f"hook state on stdin: invalid JSON: {e}")
    if not isinstance(d, dict):
        raise SpecError("hook state on stdin: not a JSON object")
    cid, bundle, pid = d.get("id"), d.get("bundle"), d.get("pid", 0)
    if not isinstance(cid, str) or not cid:
        raise SpecError("hook state on stdin: id is missing")
    if not isinstance(bundle, str) or not bundle.startswith("/"):
        raise SpecError(f"hook state on stdin: bundle must be an absolute path, not {bundle!r}")
    if isinstance(pid, bool) or not isinstance(pid, int) or pid < 0:
        raise SpecError(f"hook state on stdin: bad pid {pid!r}")
    root = d.get("root")
    annotations = d.get("annotations") or {}
    if not isinstance(annotations, dict):
        raise SpecError("hook state on stdin: annotations must be an object")
    return State(
        id=cid,
        pid=pid,
        bundle=bundle,
        status=str(d.get("status", "")),
        root=root if isinstance(root, str) and root else None,
        annotations={str(k): str(v) for k, v in annotations.items()},
    )
