"""The plugin's gRPC servers: one DevicePlugin server per advertised resource on
its own socket in the kubelet's device-plugins directory, each registered with
the kubelet; all re-created and re-registered when kubelet.sock is re-created
(a kubelet restart deletes the plugins' sockets), and stopped on SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from nvctk.base import fileio
from nvctk.base.errors import NvctkError
from nvctk.host.inventory import HostInfo
from nvctk.k8s import allocate as alloc
from nvctk.k8s import proto
from nvctk.k8s.config import PluginConfig
from nvctk.k8s.health import Health, XidWatcher
from nvctk.k8s.kubelet import DEFAULT_KUBELET_DIR
from nvctk.k8s.resources import Resource

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
WATCH_INTERVAL = 0.1  # seconds between looks at kubelet.sock
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"

log = logging.getLogger("nvctk.k8s")
pb, pb_grpc = proto.load()


def socket_name(resource: str) -> str:
    return "nvctk-" + resource.replace("/", "_") + ".sock"


def to_pb(a: alloc.Allocation) -> Any:
    return pb.ContainerAllocateResponse(
        envs=a.envs,
        mounts=[pb.Mount(container_path=c, host_path=h, read_only=ro) for c, h, ro in a.mounts],
        annotations=a.annotations,
        cdi_devices=[pb.CDIDevice(name=n) for n in a.cdi_devices],
    )


class Servicer(pb_grpc.DevicePluginServicer):  # type: ignore[misc,name-defined]
    def __init__(self, res: Resource, cfg: PluginConfig, driver_root: str, health: Health,
                 stopping: threading.Event) -> None:
        self.res = res
        self.cfg = cfg
        self.driver_root = driver_root
        self.health = health
        self.stopping = stopping

    def device_list(self) -> Any:
        bad = self.health.unhealthy
        return pb.ListAndWatchResponse(devices=[
            pb.Device(ID=d.id, health=UNHEALTHY if d.unit.uuid in bad or d.unit.gpu_uuid in bad
                      else HEALTHY)
            for d in self.res.devices.values()
        ])

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
        return pb.DevicePluginOptions(pre_start_required=False,
                                      get_preferred_allocation_available=True)

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:
        for _ in self.health.watch(context, self.stopping):
            yield self.device_list()

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
        out = []
        for r in request.container_requests:
            ids = alloc.preferred(self.res, list(r.available_deviceIDs),
                                  list(r.must_include_deviceIDs), r.allocation_size)
            out.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return pb.PreferredAllocationResponse(container_responses=out)

    def Allocate(self, request: Any, context: Any) -> Any:
        out = []
        for r in request.container_requests:
            try:
                a = alloc.allocate(self.res, self.cfg, list(r.devices_ids), self.driver_root,
                                   frozenset(self.health.unhealthy))
            except alloc.AllocateError as e:
                log.error("Allocate %s: %s", self.res.name, e)
                context.abort(getattr(grpc.StatusCode, e.code), str(e))
            out.append(to_pb(a))
        return pb.AllocateResponse(container_responses=out)

    def PreStartContainer(self, request: Any, context: Any) -> Any:
        return pb.PreStartContainerResponse()


class Plugin:
    """One resource's server and registration."""

    def __init__(self, res: Resource, cfg: PluginConfig, driver_root: str, health: Health,
                 kubelet_dir: str) -> None:
        self.res = res
        self.path = os.path.join(kubelet_dir, socket_name(res.name))
        self.kubelet_dir = kubelet_dir
        self.stopping = threading.Event()
        self.servicer = Servicer(res, cfg, driver_root, health, self.stopping)
        self.server: Any = None

    def start(self) -> None:
        self.stopping.clear()
        self.server = serve(self.path, [(pb_grpc.add_DevicePluginServicer_to_server,
                                         self.servicer)],
                            f"the device plugin listens there for {self.res.name}")

    def register(self) -> None:
        sock = os.path.join(self.kubelet_dir, KUBELET_SOCKET)
        with grpc.insecure_channel("unix://" + sock) as ch:
            pb_grpc.RegistrationStub(ch).Register(pb.RegisterRequest(
                version=API_VERSION, endpoint=os.path.basename(self.path),
                resource_name=self.res.name,
                options=pb.DevicePluginOptions(get_preferred_allocation_available=True)),
                timeout=5)
        log.info("registered %s at %s", self.res.name, self.path)

    def stop(self) -> None:
        self.stopping.set()
        self.servicer.health.wake()
        if self.server is not None:
            self.server.stop(grace=0.5).wait()
            self.server = None
            try:
                st = os.lstat(self.path)
                if stat.S_ISSOCK(st.st_mode):  # ours; a directory put there since is not
                    os.unlink(self.path)
            except FileNotFoundError:
                pass


def remove_socket(path: str, who: str) -> None:
    """A socket at path goes (an earlier run's, or one the kubelet left); anything else
    there is not the plugin's to remove: a clear error naming `who` listens there, left
    as it is."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise NvctkError(f"{path}: {e.strerror}")
    if not stat.S_ISSOCK(st.st_mode):
        raise NvctkError(f"{path}: it is {fileio.kind_of(st.st_mode)}, not a socket; {who} "
                         "and removes only a socket (move it away)")
    os.unlink(path)


def serve(path: str, servicers: list[tuple[Any, Any]], who: str, workers: int = 8) -> Any:
    """A started gRPC server on the unix socket path with servicers ((add_*_to_server,
    servicer) pairs); `who`: what listens there, for the errors. workers: the calls it
    runs at once (threads, made as calls come); the default: one per concurrent stream
    plus a few for unary calls."""
    remove_socket(path, who)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    for add, servicer in servicers:
        add(servicer, server)
    try:
        port = server.add_insecure_port("unix://" + path)
    except RuntimeError:  # grpc raises this where it cannot bind the path
        port = 0
    if not port:
        raise NvctkError(f"{path}: cannot listen there (is {os.path.dirname(path)} a "
                         "writable directory?)")
    server.start()
    return server


def _sock_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_ctime_ns


class Manager:
    """All plugins of a node, the XID watcher, and the kubelet.sock watch."""

    def __init__(self, resources: list[Resource], cfg: PluginConfig, driver_root: str,
                 host: HostInfo, kubelet_dir: str = DEFAULT_KUBELET_DIR,
                 health_events: bool = True) -> None:
        self.kubelet_dir = kubelet_dir
        self.health = Health()
        self.plugins = [Plugin(r, cfg, driver_root, self.health, kubelet_dir) for r in resources]
        self.watcher = XidWatcher(driver_root, host, self.health) if health_events else None
        self.stop_event = threading.Event()
        self.registrations = 0  # completed rounds (tests wait on it)

    def _start_all(self) -> None:
        for p in self.plugins:
            p.stop()
            p.start()
        for p in self.plugins:
            p.register()
        self.registrations += 1

    def run(self) -> None:
        """Serve until stop(); re-register after each kubelet restart."""
        if self.watcher:
            self.watcher.start()
        kubelet = os.path.join(self.kubelet_dir, KUBELET_SOCKET)
        registered: tuple[int, int] | None = None
        try:
            while not self.stop_event.is_set():
                now = _sock_id(kubelet)
                gone = any(not os.path.exists(p.path) for p in self.plugins)
                if now is not None and (now != registered or gone):
                    try:
                        self._start_all()
                        registered = now
                    except grpc.RpcError as e:
                        # kubelet not answering yet (it creates the socket first): retry
                        log.warning("registration failed: %s; retrying", e.details())
                        time.sleep(0.5)
                self.stop_event.wait(WATCH_INTERVAL)
        finally:
            for p in self.plugins:
                p.stop()
            if self.watcher:
                self.watcher.stop()
                self.watcher.join(2)

    def stop(self, *_: Any) -> None:
        self.stop_event.set()
        self.health.wake()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
