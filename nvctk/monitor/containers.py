"""nvctk's GPU containers on this node, from host-side sources only.

A container is found in its runtime's state (runc: <root>/<id>/state.json; crun:
<root>/<id>/status), which names its bundle; it is one of nvctk's when the bundle
holds nvctk-runtime's record of what it decided at create (nvctk-edits.json,
read by the one reader, nvctk.edits_file.load_edits).
What it got comes from that record: the devices in the order libvgpu indexes them and
the validated vGPU limits, never re-derived from the request. A container without
that record holds a GPU when its OCI spec's device list (linux.devices, which the
engine writes, e.g. from a DRA claim's CDI spec) has a GPU's node (/dev/nvidia<minor>)
or a MIG device's compute-instance capability node (/dev/nvidia-caps/nvidia-cap<N>),
matched by device number against the host's nodes (GpuNodes); it has no cap. One
whose device cgroup allows every device (privileged) is not listed: it was given no GPU
in particular. Its Kubernetes identity from the OCI annotations the CRI that made it puts
there: containerd's io.kubernetes.cri.* for a container under a containerd runtime
root, CRI-O's io.kubernetes.pod.*/container.name for one under CRI-O's (/run/runc,
/run/crun), none under Docker's. Only that engine's own keys: the others pass from a
Pod's annotations into its spec (CRI-O copies every Pod annotation; containerd those
its pod_annotations lists), so a Pod could name itself anything through them. All of
these are written by the runtime, the engine or nvctk on the host: nothing a
container can write is read here. A container whose init process is gone has ended
(runc keeps a stopped container's state until delete) and is left out.

A bundle the monitor cannot see (its state dir not mounted, not readable) is an error,
never "not one of nvctk's": a container is only "not nvctk's" when its bundle's
config.json is there and nvctk's record is not.

Parsing is cached per state file (inode, size, mtime): a scrape of a node with
many containers stats their state files and reads nothing else.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import stat
from dataclasses import dataclass

from nvctk.base.errors import DriverError, MountError
from nvctk.edits import Edits
from nvctk.edits_file import load_edits
from nvctk.host import driver as nvdriver
from nvctk.host.discover import cap_access_rels, device_facts
from nvctk.host.inventory import HostInfo
from nvctk.monitor.dra_share import share_limits
from nvctk.plan.devices import cap_node, node
from nvctk.request.parse import MPS_MEMORY, MPS_THREADS, mps_memory_limits
from nvctk.vgpu.limits import limits_from_env

log = logging.getLogger("nvctk.monitor")

# runc (plain and CRI-O's, containerd's per namespace — k3s's too —, Docker's), crun
DEFAULT_RUNTIME_ROOTS = ("/run/runc", "/run/crun", "/run/containerd/runc/*",
                         "/run/docker/runtime-runc/*")
MAX_JSON = 8 << 20  # a state.json or config.json larger than this is not one we read

# the engine whose containers a runtime root holds: which identity keys it sets itself
ENGINES = ("containerd", "crio", "docker", "none")
# engine -> the OCI annotations it sets: (namespace, pod, container, pod uid)
IDENTITY_KEYS: dict[str, tuple[str, str, str, str] | None] = {
    "containerd": ("io.kubernetes.cri.sandbox-namespace", "io.kubernetes.cri.sandbox-name",
                   "io.kubernetes.cri.container-name", "io.kubernetes.cri.sandbox-uid"),
    "crio": ("io.kubernetes.pod.namespace", "io.kubernetes.pod.name",
             "io.kubernetes.container.name", "io.kubernetes.pod.uid"),
    "docker": None,  # no CRI: no Kubernetes identity (a user's --annotation is not one)
    "none": None,
}


@dataclass(frozen=True)
class RuntimeRoot:
    pattern: str  # a directory or a glob of them
    engine: str  # one of ENGINES


def parse_root(text: str) -> RuntimeRoot:
    """`[ENGINE=]DIR`: the runtime root and the engine that makes its containers. Without
    ENGINE, by where the engines keep it: a path through a `containerd` directory is
    containerd's (its shim's /run/containerd/runc/<namespace>, k3s's alike), through a
    `docker` one Docker's, any other CRI-O's (/run/runc, /run/crun; plain runc and
    Podman containers there carry no CRI-O keys unless their user wrote them)."""
    engine, sep, path = text.partition("=")
    if sep and engine in ENGINES:
        if not path:
            raise ValueError(f"{text}: no directory after {engine}=")
        return RuntimeRoot(path, engine)
    parts = text.split("/")
    if "containerd" in parts:
        return RuntimeRoot(text, "containerd")
    if "docker" in parts:
        return RuntimeRoot(text, "docker")
    return RuntimeRoot(text, "crio")


@dataclass(frozen=True)
class Device:
    gpu_index: int
    gpu_uuid: str
    device_uuid: str
    memory_total: int  # bytes
    mig: bool


@dataclass(frozen=True)
class Container:
    id: str
    runtime_root: str
    bundle: str
    init_pid: int
    init_start: int | None  # clock ticks since boot; None: not recorded
    devices: tuple[Device, ...]  # container order (libvgpu's: NVML order inside it)
    memory_limits: tuple[int, ...]  # per device, bytes, 0 = none
    sm_limits: tuple[int, ...]  # per device, percent, 0 = none
    mps_percent: int | None
    mps_memory: tuple[int, ...]  # per device, bytes, 0 = none (MPS's pinned-memory limit)
    namespace: str
    pod: str
    k8s_container: str
    pod_uid: str
    vgpu_state_dir: str | None  # host path of its vGPU state dir (libvgpu's accounting)

    @property
    def name(self) -> str:
        return self.k8s_container or self.id[:24]

    @property
    def base_kind(self) -> str:
        if any(self.memory_limits) or any(self.sm_limits):
            return "vgpu"
        if self.mps_percent is not None or any(self.mps_memory):
            return "mps"
        if any(d.mig for d in self.devices):
            return "mig"
        return "gpu"


def expand_roots(roots: tuple[RuntimeRoot, ...] | list[RuntimeRoot]) -> list[tuple[str, str]]:
    """(directory, engine) for each existing directory the roots name, each once."""
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for r in roots:
        found = sorted(glob.glob(r.pattern)) if glob.has_magic(r.pattern) else [r.pattern]
        for d in found:
            if d not in seen and os.path.isdir(d):
                seen.add(d)
                out.append((d, r.engine))
    return out


def _read_regular(path: str, limit: int = MAX_JSON) -> bytes:
    """The file's bytes, only if it is a regular file: a FIFO or device in its place
    must not block the collection (O_NONBLOCK, then checked)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise ValueError(f"{path}: larger than {limit} bytes")
    return data


def _read_json(path: str) -> object:
    data = _read_regular(path)
    return json.loads(data)


def proc_start(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _identity(ann: dict[str, object], engine: str) -> tuple[str, str, str, str]:
    """(namespace, pod, container, pod uid) from the keys the container's engine sets."""
    keys = IDENTITY_KEYS.get(engine)
    if keys is None:
        return "", "", "", ""
    vals = [ann.get(k) for k in keys]
    ns, pod, ctr, uid = (v if isinstance(v, str) else "" for v in vals)
    return ns, pod, ctr, uid


def _alive(pid: int, start: int | None) -> bool:
    return (os.path.exists(f"/proc/{pid}") if start is None else proc_start(pid) == start)


def _runtime_state(path: str) -> tuple[str, int, int | None]:
    """(bundle, init pid, init start) from runc's state.json or crun's status."""
    d = _read_json(path)
    if not isinstance(d, dict):
        raise ValueError(f"{path}: not a JSON object")
    if os.path.basename(path) == "status":  # crun
        bundle, pid = d.get("bundle"), d.get("pid")
        start = d.get("process-start-time")
    else:
        labels = (d.get("config") or {}).get("labels") or []
        bundle = next((lb[7:] for lb in labels if isinstance(lb, str) and lb.startswith("bundle=")),
                      None)
        pid, start = d.get("init_process_pid"), d.get("init_process_start")
    if not isinstance(bundle, str) or not bundle or type(pid) is not int or pid <= 0:
        raise ValueError(f"{path}: no bundle or init pid")
    if isinstance(start, str) and start.isdigit():
        start = int(start)
    # crun writes 0 where it could not read the start time
    return bundle, pid, start if type(start) is int and start > 0 else None


def _devices(names: tuple[str, ...] | list[str], host: HostInfo) -> list[Device]:
    """The devices of these UUIDs, in that order (a MIG device by its own UUID; a GPU
    whose MIG devices the container got is not counted whole). For nvctk's containers
    the UUIDs nvctk-runtime recorded (Edits.selected: libvgpu's order; a record from
    before that field: its GPUs, whole), never re-derived from the request, which a
    later config could resolve otherwise."""
    whole = {g.uuid: g for g in host.gpus}
    mig = {m.uuid: (g, m) for g in host.gpus for m in g.mig_devices}
    parents = {mig[u][0].uuid for u in names if u in mig}
    out = []
    for u in names:
        if u in mig:
            g, m = mig[u]
            out.append(Device(g.index, g.uuid, m.uuid, m.memory_mib << 20, True))
        elif u in whole and u not in parents:
            out.append(Device(whole[u].index, u, u, whole[u].memory_mib << 20, False))
    return out


# a host device node's (major, minor) -> the UUID of the GPU or MIG device it opens
GpuNodes = dict[tuple[int, int], str]


def gpu_nodes(driver_root: str, host: HostInfo) -> GpuNodes:
    """Each GPU's node (/dev/nvidia<minor>) and each MIG device's compute-instance
    capability node (nvidia-caps/nvidia-cap<N>, N from the driver's access file) by
    device number: the host facts a plan's nodes come from (nvctk.host.discover,
    nvctk.plan.devices). A node the host lacks is left out (no container can have it)."""
    proc_dir, dev_dir = nvdriver.driver_dirs(driver_root)
    files = nvdriver.DriverFiles(driver_root, host.driver_version, proc_dir=proc_dir,
                                 dev_dir=dev_dir)
    pairs = [(g, m) for g in host.gpus for m in (None, *g.mig_devices)]
    facts = device_facts(files, pairs, ())
    out: GpuNodes = {}
    for g, m in pairs:
        try:
            if m is None:
                n = node(facts, f"nvidia{g.minor}")
            else:  # the gi capability is shared by its compute instances: the ci's is its own
                n = cap_node(facts, cap_access_rels([(g, m)], False, False)[1])
        except DriverError as e:
            log.debug("%s: %s", m.uuid if m else g.uuid, e)
            continue
        out[(n.major, n.minor)] = m.uuid if m else g.uuid
    return out


def _allows_every_device(linux: dict[str, object]) -> bool:
    """Whether the spec's device cgroup ends up allowing every device (a privileged
    container's): the last rule for all devices decides, as the kernel's list does."""
    res = linux.get("resources")
    rules = res.get("devices") if isinstance(res, dict) else None
    every = False
    for r in rules if isinstance(rules, list) else ():
        if isinstance(r, dict) and r.get("type", "a") == "a" and r.get("major") is None \
                and r.get("minor") is None:
            every = r.get("allow") is True
    return every


def held_gpus(spec: dict[str, object], nodes: GpuNodes, host: HostInfo) -> list[str]:
    """The UUIDs of the GPUs and MIG devices whose nodes the spec gives the container
    (linux.devices, by device number), in NVML order; none for a container allowed
    every device (it was given no GPU in particular)."""
    linux = spec.get("linux")
    if not isinstance(linux, dict) or _allows_every_device(linux):
        return []
    devs = linux.get("devices")
    held = set()
    for d in devs if isinstance(devs, list) else ():
        if isinstance(d, dict) and d.get("type") == "c":
            u = nodes.get((d.get("major"), d.get("minor")))  # type: ignore[arg-type]
            if u is not None:
                held.add(u)
    return [u for g in host.gpus for u in (g.uuid, *(m.uuid for m in g.mig_devices))
            if u in held]


def _limits(edits: Edits, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if edits.vgpu is None or not edits.vgpu.limits or n == 0:
        return (0,) * n, (0,) * n
    env = {k: v for k, v in edits.vgpu.limits.items()
           if k.startswith(("CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT"))}
    lim = limits_from_env(env, n)
    return lim.memory, lim.sm


class BundleUnreadable(Exception):
    """The bundle a runtime's state names cannot be seen: whether it is nvctk's is unknown."""


def load_container(runtime_root: str, cid: str, state_file: str, host: HostInfo,
                   engine: str = "none", nodes: GpuNodes | None = None) -> Container | None:
    """The container if it holds a GPU (nvctk's record, or a GPU node in its spec, by
    `nodes`), else None. Raises OSError/ValueError for state nvctk cannot read
    (BundleUnreadable: its bundle)."""
    bundle, pid, start = _runtime_state(state_file)
    try:
        edits = load_edits(bundle)  # the one reader: the runtime's record
        # not a GPU container only if the bundle is there to say so (an engine's
        # config.json always is); a bundle out of sight hides what it holds
        spec = _read_json(os.path.join(bundle, "config.json"))
    except MountError as e:
        raise ValueError(str(e)) from None  # there, but not a record nvctk-runtime wrote
    except OSError as e:
        if not _alive(pid, start):
            return None  # ended: its bundle may be gone already
        raise BundleUnreadable(f"bundle {bundle} of container {cid} not readable: "
                               f"{e.strerror} (is its state dir mounted?)") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{bundle}/config.json: not a JSON object")
    if edits is None:
        # a GPU given by its nodes (a DRA claim's or another CDI spec's): no record, no cap
        names = held_gpus(spec, nodes or {}, host)
        if not names:
            return None  # not a GPU container
        devices = _devices(names, host)
        mem, sm = share_limits(spec, len(devices)) or ((0,) * len(devices),) * 2
    else:
        devices = _devices(edits.selected or edits.gpu_uuids, host)
        mem, sm = _limits(edits, len(devices))
    ann = spec.get("annotations") or {}
    if not isinstance(ann, dict):
        ann = {}
    env = {}
    proc = spec.get("process")
    for item in (proc.get("env") or []) if isinstance(proc, dict) else []:
        if isinstance(item, str) and "=" in item:
            k, _, v = item.partition("=")
            env[k] = v
    mps = env.get(MPS_THREADS)
    ns, pod, ctr, uid = _identity(ann, engine)
    return Container(
        id=cid, runtime_root=runtime_root, bundle=bundle, init_pid=pid, init_start=start,
        devices=tuple(devices), memory_limits=mem, sm_limits=sm,
        mps_percent=int(mps) if mps is not None and mps.isdigit() else None,
        mps_memory=_mps_memory(env, devices),
        namespace=ns, pod=pod, k8s_container=ctr, pod_uid=uid,
        vgpu_state_dir=edits.vgpu.state_dir if edits is not None and edits.vgpu is not None
        else None,
    )


def _mps_memory(env: dict[str, str], devices: list[Device]) -> tuple[int, ...]:
    """Per device, MPS's pinned-memory cap (bytes, 0 = none): CUDA_MPS_PINNED_DEVICE_MEM_LIMIT
    names devices by their index in the container or their UUID. create checked it; an
    item that does not parse now caps nothing."""
    out = [0] * len(devices)
    if MPS_MEMORY not in env:
        return tuple(out)
    try:
        items = mps_memory_limits(env[MPS_MEMORY])
    except ValueError:
        return tuple(out)
    for i, d in enumerate(devices):
        cap = items.get(str(i)) or items.get(d.device_uuid) or items.get(d.gpu_uuid) or 0
        out[i] = cap
    return tuple(out)


class Discovery:
    """Lists the live GPU containers of nvctk's under the runtime roots, caching each
    container's parse by its state file's identity."""

    def __init__(self, roots: tuple[str, ...] | list[str] = DEFAULT_RUNTIME_ROOTS,
                 nodes: GpuNodes | None = None) -> None:
        self.roots = tuple(parse_root(r) for r in roots)
        self.nodes = nodes or {}  # the host's GPU nodes: containers given a GPU by them
        self._cache: dict[str, tuple[tuple[int, int, int], Container | None]] = {}

    def scan(self, host: HostInfo, problem: object) -> list[Container]:
        """problem(cause, message) is told what could not be read (the rest goes on)."""
        out: list[Container] = []
        seen: set[str] = set()
        for root, engine in expand_roots(self.roots):
            try:
                names = os.listdir(root)
            except OSError as e:
                problem(f"runtime-root:{root}", f"cannot list {root}: {e}")  # type: ignore[operator]
                continue
            for cid in names:
                for fname in ("state.json", "status"):
                    path = os.path.join(root, cid, fname)
                    try:
                        st = os.stat(path)
                    except OSError:
                        continue
                    seen.add(path)
                    key = (st.st_ino, st.st_size, st.st_mtime_ns)
                    hit = self._cache.get(path)
                    if hit is not None and hit[0] == key:
                        c = hit[1]
                    else:
                        try:
                            c = load_container(root, cid, path, host, engine, self.nodes)
                        except BundleUnreadable as e:  # not cached: retried every scan
                            problem(f"bundle:{path}", str(e))  # type: ignore[operator]
                            break
                        except Exception as e:  # any unreadable state: skip that container
                            problem(f"container-state:{path}", f"{path}: {e}")  # type: ignore[operator]
                            continue
                        self._cache[path] = (key, c)
                    if c is not None and _alive(c.init_pid, c.init_start):
                        out.append(c)
                    break
        for path in set(self._cache) - seen:
            del self._cache[path]
        return out
