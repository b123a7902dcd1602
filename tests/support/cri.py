"""A small CRI (runtime.v1) client for the tests: Pods run the way the kubelet runs them.

Speaks the real CRI API: tests/support/third_party/cri_api.proto, as released with
Kubernetes 1.36.3 (see the README there). Its Python code is generated at first use
with grpc_tools.protoc into a private temp dir (removed at exit), so nothing generated
is committed and the proto stays the one source. Needs grpcio and grpcio-tools.

    client = CriClient(socket)
    result = run_pod(client, "nvidia", Allocation(envs={"NVIDIA_VISIBLE_DEVICES": "0"}),
                     image="nvctk.test/gpu:1", command=["nvidia-smi", "-L"], log_root=dir)
    result.logs  # the container's stdout+stderr, from the CRI log file

A device plugin's Allocate answer goes in as `Allocation.from_response(resp)`
(a v1beta1 ContainerAllocateResponse): the kubelet passes its envs, mounts,
devices, annotations and CDI device names into CreateContainer the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import io
import itertools
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support import wait

# a file name of its own: protobuf's descriptor pool keys files by path, and the
# device plugin's nvctk/k8s/api.proto is loaded in the same processes as "api.proto"
PROTO = Path(__file__).parent / "third_party" / "cri_api.proto"
RPC_TIMEOUT = 60.0


@functools.cache
def protos() -> tuple[Any, Any]:
    """(cri_api_pb2, cri_api_pb2_grpc), generated from PROTO on first use."""
    from grpc_tools import protoc

    out = Path(tempfile.mkdtemp(prefix="nvctk-cri-pb-"))
    atexit.register(shutil.rmtree, out, True)
    rc = protoc.main(["grpc_tools.protoc", f"-I{PROTO.parent}", f"--python_out={out}",
                      f"--grpc_python_out={out}", str(PROTO)])
    if rc != 0:
        raise RuntimeError(f"protoc failed on {PROTO} (exit {rc})")
    # cri_api_pb2_grpc imports cri_api_pb2 by its bare name
    sys.path.insert(0, str(out))
    try:
        import cri_api_pb2  # type: ignore[import-not-found]
        import cri_api_pb2_grpc  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(out))
    return cri_api_pb2, cri_api_pb2_grpc


class CriError(RuntimeError):
    """A CRI call failed: which call, the gRPC status code and the runtime's message."""

    def __init__(self, call: str, code: str, details: str) -> None:
        super().__init__(f"{call}: {code}: {details}")
        self.call, self.code, self.details = call, code, details


class CriClient:
    """RuntimeService and ImageService stubs on a CRI socket; errors become CriError."""

    def __init__(self, socket: Path | str) -> None:
        import grpc

        self.pb, pb_grpc = protos()
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.runtime = pb_grpc.RuntimeServiceStub(self.channel)
        self.images = pb_grpc.ImageServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> CriClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def call(self, name: str, request: Any, timeout: float = RPC_TIMEOUT) -> Any:
        import grpc

        stub = self.images if name == "ImageStatus" else self.runtime
        try:
            return getattr(stub, name)(request, timeout=timeout)
        except grpc.RpcError as e:
            raise CriError(name, e.code().name, e.details() or "") from None

    def version(self) -> Any:
        return self.call("Version", self.pb.VersionRequest(version="v1"))

    def image_id(self, ref: str) -> str:
        """The image's id as CRI sees it; "" when CRI does not know it."""
        res = self.call("ImageStatus", self.pb.ImageStatusRequest(image=self.pb.ImageSpec(image=ref)))
        return str(res.image.id) if res.HasField("image") else ""

    def container_state(self, cid: str) -> Any:
        return self.call("ContainerStatus", self.pb.ContainerStatusRequest(container_id=cid)).status


# --- what a device plugin's Allocate returns ---------------------------------------------------


@dataclass
class Allocation:
    """The parts of a v1beta1 ContainerAllocateResponse the kubelet passes to the runtime."""

    envs: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    mounts: list[tuple[str, str, bool]] = field(default_factory=list)  # container, host, ro
    devices: list[tuple[str, str, str]] = field(default_factory=list)  # container, host, perms
    cdi_devices: list[str] = field(default_factory=list)

    @classmethod
    def from_response(cls, resp: Any) -> Allocation:
        """From a ContainerAllocateResponse message (any generated class with its fields)."""
        return cls(
            envs=dict(resp.envs), annotations=dict(resp.annotations),
            mounts=[(m.container_path, m.host_path, bool(m.read_only)) for m in resp.mounts],
            devices=[(d.container_path, d.host_path, d.permissions) for d in resp.devices],
            cdi_devices=[d.name for d in resp.cdi_devices],
        )

    @classmethod
    def merge(cls, parts: Sequence[Allocation]) -> Allocation:
        """Several resources' answers for one container, combined as the kubelet does."""
        out = cls()
        for p in parts:
            out.envs.update(p.envs)
            out.annotations.update(p.annotations)
            out.mounts += p.mounts
            out.devices += p.devices
            out.cdi_devices += p.cdi_devices
        return out


# --- Pods --------------------------------------------------------------------------------------


@dataclass
class PodResult:
    logs: str
    exit_code: int
    sandbox_id: str
    container_id: str


def parse_cri_log(text: str) -> str:
    """The payload of a CRI log file: lines `<time> <stream> <P|F> <text>`; P is a partial line."""
    out: list[str] = []
    for line in text.splitlines():
        parts = line.split(" ", 3)
        if len(parts) < 3:
            continue
        payload = parts[3] if len(parts) == 4 else ""
        out.append(payload if parts[2] == "P" else payload + "\n")
    return "".join(out)


def _sandbox_config(pb: Any, name: str, log_dir: Path,
                    annotations: Mapping[str, str] | None = None) -> Any:
    node = pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD)
    meta = pb.PodSandboxMetadata(name=name, uid=uuid.uuid4().hex, namespace="default")
    return pb.PodSandboxConfig(
        metadata=meta,
        log_directory=str(log_dir),
        labels=_kubelet_labels(meta),
        annotations=dict(annotations or {}),
        # host network, as hostNetwork: true: no CNI needed
        linux=pb.LinuxPodSandboxConfig(
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=node)),
    )


def _kubelet_labels(pod: Any, container: str = "") -> dict[str, str]:
    """The labels the kubelet sets on a sandbox (a Pod's own labels would join them) and,
    with `container`, on each container: the Pod's identity, which runtimes record."""
    labels = {"io.kubernetes.pod.name": pod.name, "io.kubernetes.pod.namespace": pod.namespace,
              "io.kubernetes.pod.uid": pod.uid}
    if container:
        labels["io.kubernetes.container.name"] = container
    return labels


def _container_config(pb: Any, pod: Any, name: str, image: str, command: Sequence[str],
                      alloc: Allocation, runtime_default_seccomp: bool = False) -> Any:
    """runtime_default_seccomp: securityContext.seccompProfile RuntimeDefault (the
    kubelet's seccompDefault); else none, which the engines read as Unconfined."""
    security = pb.LinuxContainerSecurityContext(
        namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER))
    if runtime_default_seccomp:
        security.seccomp.CopyFrom(pb.SecurityProfile(
            profile_type=pb.SecurityProfile.ProfileType.RuntimeDefault))
    return pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        labels=_kubelet_labels(pod, name),
        image=pb.ImageSpec(image=image, user_specified_image=image),
        command=list(command),
        # KeyValue.value is bytes in the released API
        envs=[pb.KeyValue(key=k, value=v.encode()) for k, v in alloc.envs.items()],
        mounts=[pb.Mount(container_path=c, host_path=h, readonly=ro) for c, h, ro in alloc.mounts],
        devices=[pb.Device(container_path=c, host_path=h, permissions=p)
                 for c, h, p in alloc.devices],
        annotations=alloc.annotations,
        CDI_devices=[pb.CDIDevice(name=n) for n in alloc.cdi_devices],
        log_path=f"{name}.log",
        linux=pb.LinuxContainerConfig(security_context=security),
    )


@dataclass
class Pod:
    client: CriClient
    sandbox_id: str
    config: Any
    log_dir: Path
    containers: list[str] = field(default_factory=list)  # ids, as created

    def container(self, name: str, image: str, command: Sequence[str],
                  alloc: Allocation, runtime_default_seccomp: bool = False) -> str:
        pb = self.client.pb
        req = pb.CreateContainerRequest(pod_sandbox_id=self.sandbox_id, sandbox_config=self.config,
                                        config=_container_config(pb, self.config.metadata, name, image,
                                                                command, alloc,
                                                                runtime_default_seccomp))
        cid = str(self.client.call("CreateContainer", req).container_id)
        self.containers.append(cid)
        return cid

    def start(self, cid: str) -> None:
        self.client.call("StartContainer", self.client.pb.StartContainerRequest(container_id=cid))

    def wait(self, cid: str, timeout: float = 60) -> int:
        """The container's exit code once it has exited."""
        exited = self.client.pb.CONTAINER_EXITED
        st = wait.until(lambda: (s := self.client.container_state(cid)).state == exited and s,
                        timeout, f"container {cid} to exit")
        return int(st.exit_code)

    def logs(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return parse_cri_log(path.read_text(errors="replace")) if path.exists() else ""


_pods = itertools.count()


@contextlib.contextmanager
def pod(client: CriClient, handler: str, log_root: Path, name: str = "",
        annotations: Mapping[str, str] | None = None) -> Iterator[Pod]:
    """A host-network sandbox on `handler`, stopped and removed when the block ends;
    `annotations`: the Pod's own (metadata.annotations, which its author writes)."""
    pb = client.pb
    pod_name = name or f"nvctk-pod-{os.getpid()}-{next(_pods)}"
    log_dir = log_root / pod_name
    # the kubelet makes the Pod's log dir; CRI only opens files in it
    log_dir.mkdir(parents=True, exist_ok=True)
    config = _sandbox_config(pb, pod_name, log_dir, annotations)
    res = client.call("RunPodSandbox", pb.RunPodSandboxRequest(config=config,
                                                               runtime_handler=handler))
    p = Pod(client, str(res.pod_sandbox_id), config, log_dir)
    try:
        yield p
    finally:
        # what the kubelet does when a Pod goes: stop its containers (a grace period of
        # 0: killed at once; left to StopPodSandbox, CRI-O gives a PID 1 that ignores
        # SIGTERM, as `sh -c` does, about a minute), stop the sandbox, remove it
        for cid in p.containers:
            with contextlib.suppress(CriError):  # never started, or gone already
                client.call("StopContainer", pb.StopContainerRequest(container_id=cid, timeout=0))
        client.call("StopPodSandbox", pb.StopPodSandboxRequest(pod_sandbox_id=p.sandbox_id))
        client.call("RemovePodSandbox", pb.RemovePodSandboxRequest(pod_sandbox_id=p.sandbox_id))


def run_pod(client: CriClient, handler: str, allocation: Allocation, *, image: str,
            command: Sequence[str], log_root: Path, timeout: float = 60,
            runtime_default_seccomp: bool = False) -> PodResult:
    """One Pod with one container, run to completion: its logs and exit code.
    A failing CRI call raises CriError (the runtime's message in .details); the Pod
    is stopped and removed either way."""
    with pod(client, handler, log_root) as p:
        cid = p.container("main", image, command, allocation, runtime_default_seccomp)
        try:
            p.start(cid)
            code = p.wait(cid, timeout)
            return PodResult(p.logs("main"), code, p.sandbox_id, cid)
        finally:
            client.call("RemoveContainer", client.pb.RemoveContainerRequest(container_id=cid))


# --- images ------------------------------------------------------------------------------------


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    tar.addfile(info, io.BytesIO(data))


def image_archive(rootfs: Path | str, ref: str, out: Path, *, entrypoint: Sequence[str] = (),
                  cmd: Sequence[str] = (), env: Mapping[str, str] | None = None) -> Path:
    """A docker-archive tar (what `docker save` writes, which `ctr images import` reads)
    of one layer holding the directory `rootfs`, tagged `ref`."""
    layer = subprocess.run(["tar", "--numeric-owner", "-C", str(rootfs), "-c", "."],
                           capture_output=True, check=True).stdout
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Env": [f"{k}={v}" for k, v in (env or {}).items()],
                   "Entrypoint": list(entrypoint) or None, "Cmd": list(cmd) or None,
                   "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [ref],
                            "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(out, "w") as tar:
        _add_bytes(tar, "layer.tar", layer)
        _add_bytes(tar, config_name, config)
        _add_bytes(tar, "manifest.json", manifest)
    return out


def pause_rootfs(path: Path, busybox: str = "/bin/busybox") -> Path:
    """The sandbox ("pause") image's tree: a static busybox that sleeps until killed."""
    (path / "bin").mkdir(parents=True)
    shutil.copyfile(busybox, path / "bin/busybox")
    (path / "bin/busybox").chmod(0o755)
    for d in ("dev", "proc", "sys", "etc", "tmp"):
        (path / d).mkdir()
    return path


PAUSE_CMD = ("/bin/busybox", "sleep", "2147483647")


# --- containerd with its CRI plugin --------------------------------------------------------------


def containerd_cri_config(work: Path, sandbox_image: str) -> str:
    """A containerd 1.x (version 2) config whose CRI plugin serves Pods with everything
    under `work`: root, state, sockets, runc's state, CNI dirs, the sandbox image given.
    `nvctk configure --runtime containerd` then adds the `nvidia` runtime to it.

    Facts of these machines it encodes: root lacks CAP_SYS_RESOURCE, so CRI must not
    lower oom_score_adj below its own (restrict_oom_score_adj), or runc fails with only
    "can't get final child's PID from pipe: EOF"; CRI's streaming server always listens
    on TCP, so it is bound to 127.0.0.1 on a free port."""
    from support.daemons import private_paths

    top = []
    tables = []
    for k, v in private_paths(work).items():
        if isinstance(v, dict):
            tables.append(f"[{k}]\n" + "".join(f"  {kk} = {json.dumps(vv)}\n" for kk, vv in v.items()))
        else:
            top.append(f"{k} = {json.dumps(v)}\n")
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    return (
        "version = 2\n" + "".join(top) + "".join(tables)
        + f'[plugins."io.containerd.internal.v1.opt"]\n  path = "{work}/opt"\n'
        + f"[{cri}]\n"
        f"  sandbox_image = {json.dumps(sandbox_image)}\n"
        "  restrict_oom_score_adj = true\n"
        '  stream_server_address = "127.0.0.1"\n  stream_server_port = "0"\n'
        "  disable_apparmor = true\n"
        f"[{cri}.containerd]\n"
        '  snapshotter = "overlayfs"\n  default_runtime_name = "runc"\n'
        f"[{cri}.containerd.runtimes.runc]\n"
        '  runtime_type = "io.containerd.runc.v2"\n'
        f"[{cri}.containerd.runtimes.runc.options]\n"
        # runc's state off /run/containerd/runc; `configure` copies it to nvidia's options
        f'  Root = "{work}/runc"\n'
        f"[{cri}.cni]\n"
        f'  bin_dir = "{work}/cni/bin"\n  conf_dir = "{work}/cni/net.d"\n'
    )


def pass_cdi_annotations(cfg: Path, runtime: str = "nvidia") -> bool:
    """Make containerd 1.6's CRI pass a container's `cdi.k8s.io/*` annotations into its
    OCI spec for `runtime` (its `container_annotations`): without it CRI drops them
    and the cdi-annotations device list strategy silently gives no device. True
    when it had to be added (the tests assert `nvctk configure` set it)."""
    import tomlkit

    doc = tomlkit.parse(cfg.read_text())
    plugins: Any = doc["plugins"]
    # version 3 and 4 configs (containerd 2.x) keep the runtimes in the runtime plugin
    plugin = plugins.get("io.containerd.cri.v1.runtime") or plugins["io.containerd.grpc.v1.cri"]
    rt = plugin["containerd"]["runtimes"][runtime]
    have = list(rt.get("container_annotations", []))  # type: ignore[union-attr]
    if "cdi.k8s.io/*" in have:
        return False
    rt["container_annotations"] = [*have, "cdi.k8s.io/*"]  # type: ignore[index]
    cfg.write_text(tomlkit.dumps(doc))
    return True


def private_v4_paths(doc: Any, work: Path) -> Any:
    """Put a containerd 2 (version 4) config's root, state and server sockets under
    work, no imports, NRI off; returns its plugins table."""
    sock = work / "containerd.sock"
    doc["root"], doc["state"], doc["imports"] = f"{work}/root", f"{work}/state", []
    p = doc["plugins"]
    p["io.containerd.server.v1.grpc"]["address"] = str(sock)
    p["io.containerd.server.v1.ttrpc"]["address"] = f"{sock}.ttrpc"
    p["io.containerd.server.v1.debug"]["address"] = ""
    p["io.containerd.server.v1.metrics"]["address"] = ""
    p["io.containerd.nri.v1.nri"]["disable"] = True
    p["io.containerd.internal.v1.opt"]["path"] = f"{work}/opt"
    return p


def containerd2_cri_config(work: Path, sandbox_image: str, default_text: str,
                           cdi_dirs: Sequence[Path] = ()) -> str:
    """containerd 2.3's own `config default` (version 4) turned into the private CRI
    node containerd_cri_config makes for 1.x: the same facts, at version 4's places
    (the server's addresses are plugins now), and CDI from `cdi_dirs`."""
    import tomlkit

    doc: Any = tomlkit.parse(default_text)
    p = private_v4_paths(doc, work)
    images = p["io.containerd.cri.v1.images"]
    images["snapshotter"] = "overlayfs"
    images["pinned_images"]["sandbox"] = sandbox_image
    rt = p["io.containerd.cri.v1.runtime"]
    rt["restrict_oom_score_adj"] = True
    rt["disable_apparmor"] = True
    rt["enable_cdi"] = True
    rt["cdi_spec_dirs"] = [str(d) for d in cdi_dirs]
    rt["containerd"]["runtimes"]["runc"]["options"]["Root"] = f"{work}/runc"
    rt["cni"]["bin_dirs"] = [f"{work}/cni/bin"]
    rt["cni"]["conf_dir"] = f"{work}/cni/net.d"
    p["io.containerd.grpc.v1.cri"]["stream_server_address"] = "127.0.0.1"
    p["io.containerd.grpc.v1.cri"]["stream_server_port"] = "0"
    return tomlkit.dumps(doc)


def pause_image(work: Path, tag: str) -> Path:
    """work/pause.tar: the Pods' sandbox image (pause_rootfs), tagged `tag`."""
    return image_archive(pause_rootfs(work / "pause"), tag, work / "pause.tar",
                         entrypoint=PAUSE_CMD)
