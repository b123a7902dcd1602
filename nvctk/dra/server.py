"""The DRA kubelet plugin's gRPC side: the registration socket the kubelet's plugin
watcher finds (`<registry-dir>/<driver>-reg.sock`: pluginregistration.Registration), and
the service socket `<plugins-dir>/<driver>/dra.sock` with DRAPlugin v1 and v1beta1 and
the DRAResourceHealth (v1alpha1) stream.

One plugin per driver and node: `<plugins-dir>/<driver>/plugin.lock` is held (flock) for
the plugin's life, and a second one fails at its start naming the first.

Errors are per claim, in the answer (the kubelet shows them on the Pod); a gRPC error
only for a request that is not one (no claims).
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

from nvctk.base.errors import NvctkError
from nvctk.dra import health as health_record
from nvctk.dra import proto
from nvctk.dra.driver import Driver
from nvctk.k8s.health import Health, XidWatcher
from nvctk.k8s.server import serve

log = logging.getLogger("nvctk.dra")
pb = proto.load()

PLUGIN_TYPE = "DRAPlugin"
# the services the kubelet may use (it opens the health stream only when it is named)
VERSIONS = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1alpha1.DRAResourceHealth")
SERVICE_SOCKET = "dra.sock"
LOCK_NAME = "plugin.lock"
# the kubelet's calls the service runs at once: a call waits on the API server for up to
# the driver's api_timeout per claim, so a few slow answers must not take every worker
# (threads are made only as calls come)
SERVICE_WORKERS = 128
SOCKET_CHECK_S = 1.0  # how often the sockets are checked (made again when removed)
MAX_PARALLEL_CLAIMS = 32  # one request's claims prepared at once


def _answer_error(e: BaseException) -> str:
    if isinstance(e, NvctkError):
        return str(e)
    log.exception("internal error")
    return f"internal error: {type(e).__name__}: {e} (a bug in nvctk: the traceback is in the plugin's log)"


class DraService:
    """NodePrepareResources / NodeUnprepareResources for one API version (its module)."""

    def __init__(self, driver: Driver, mod: Any, share_ids: bool) -> None:
        self.driver = driver
        self.pb = mod
        self.share_ids = share_ids

    def NodePrepareResources(self, request: Any, context: Any) -> Any:
        # each claim on its own thread: one claim's slow API-server answer (bounded by
        # the driver's api_timeout) never holds up the request's other claims
        claims = list(request.claims)
        if len(claims) == 1:
            answers = [self._prepare(claims[0])]
        else:
            with futures.ThreadPoolExecutor(min(len(claims), MAX_PARALLEL_CLAIMS)) as pool:
                answers = list(pool.map(self._prepare, claims))
        return self.pb.NodePrepareResourcesResponse(
            claims={c.uid: a for c, a in zip(claims, answers, strict=True)})

    def _prepare(self, c: Any) -> Any:
        try:
            devs = self.driver.prepare(c.namespace, c.name, c.uid)
            return self.pb.NodePrepareResourceResponse(devices=[
                self.pb.Device(request_names=list(d.requests), pool_name=d.pool,
                               device_name=d.device, cdi_device_ids=list(d.cdi_ids),
                               **({"share_id": d.share_id}
                                  if self.share_ids and d.share_id is not None else {}))
                for d in devs])
        except Exception as e:
            msg = _answer_error(e)
            log.error("NodePrepareResources %s/%s (%s): %s", c.namespace, c.name, c.uid, msg)
            return self.pb.NodePrepareResourceResponse(error=msg)

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:
        out = {}
        for c in request.claims:
            try:
                self.driver.unprepare(c.namespace, c.name, c.uid)
                answer = self.pb.NodeUnprepareResourceResponse()
            except Exception as e:
                msg = _answer_error(e)
                log.error("NodeUnprepareResources %s/%s (%s): %s", c.namespace, c.name, c.uid,
                          msg)
                answer = self.pb.NodeUnprepareResourceResponse(error=msg)
            out[c.uid] = answer
        return self.pb.NodeUnprepareResourcesResponse(claims=out)


class V1(DraService, pb.v1_grpc.DRAPluginServicer):  # type: ignore[misc,name-defined]
    def __init__(self, driver: Driver) -> None:
        super().__init__(driver, pb.v1, True)


class V1beta1(DraService, pb.v1beta1_grpc.DRAPluginServicer):  # type: ignore[misc,name-defined]
    def __init__(self, driver: Driver) -> None:
        super().__init__(driver, pb.v1beta1, False)


class HealthService(pb.health_grpc.DRAResourceHealthServicer):  # type: ignore[misc,name-defined]
    """Every device's health, sent whole at the start and on each change."""

    def __init__(self, driver: Driver, health: Health, stopping: threading.Event) -> None:
        self.driver = driver
        self.health = health
        self.stopping = stopping

    def snapshot(self) -> Any:
        h = pb.health
        # what the driver refuses (a non-fatal XID is no fault of the device's service)
        bad, reasons = self.driver.unhealthy(), dict(self.health.reasons)
        now = int(time.time())
        out = []
        for d in self.driver.devices.values():
            hit = d.uuid if d.uuid in bad else d.gpu.uuid if d.gpu.uuid in bad else None
            out.append(h.DeviceHealth(
                device=h.DeviceIdentifier(pool_name=self.driver.pool, device_name=d.name),
                health=h.UNHEALTHY if hit else h.HEALTHY, last_updated_time=now,
                message=f"{reasons.get(hit, 'unhealthy')} on {hit}" if hit else ""))
        return h.NodeWatchResourcesResponse(devices=out)

    def NodeWatchResources(self, request: Any, context: Any) -> Iterator[Any]:
        for _ in self.health.watch(context, self.stopping):
            yield self.snapshot()


class Registration(pb.reg_grpc.RegistrationServicer):  # type: ignore[misc,name-defined]
    def __init__(self, driver_name: str, endpoint: str) -> None:
        self.driver_name = driver_name
        self.endpoint = endpoint
        self.status: Any = None
        self.notified = threading.Event()

    def GetInfo(self, request: Any, context: Any) -> Any:
        return pb.reg.PluginInfo(type=PLUGIN_TYPE, name=self.driver_name,
                                 endpoint=self.endpoint, supported_versions=list(VERSIONS))

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:
        self.status = request
        if request.plugin_registered:
            log.info("registered with the kubelet as %s", self.driver_name)
        else:
            log.error("the kubelet refused the registration: %s", request.error)
        self.notified.set()
        return pb.reg.RegistrationStatusResponse()


class Plugin:
    """The plugin's two servers, its lock, and the XID watcher (when given) that marks
    health."""

    def __init__(self, driver: Driver, health: Health, plugins_dir: str,
                 registry_dir: str, watcher: XidWatcher | None = None) -> None:
        self.driver = driver
        self.health = health
        self.watcher = watcher
        self.dir = os.path.join(plugins_dir, driver.name)
        self.endpoint = os.path.join(self.dir, SERVICE_SOCKET)
        self.reg_path = os.path.join(registry_dir, f"{driver.name}-reg.sock")
        self.stopping = threading.Event()
        self.registration = Registration(driver.name, self.endpoint)
        self.servers: list[Any] = []
        self._servers_lock = threading.Lock()  # start/stop against the socket keeper
        self._lock_fd = -1

    def _take_lock(self) -> None:
        os.makedirs(self.dir, 0o750, exist_ok=True)
        path = os.path.join(self.dir, LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                pid = os.read(fd, 32).decode(errors="replace").strip() or "?"
            finally:
                os.close(fd)
            raise NvctkError(f"another DRA plugin for {self.driver.name} runs on this node "
                             f"(pid {pid} holds {path}); one per driver and node") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _serve_service(self) -> None:
        d = self.driver
        server = serve(self.endpoint, [
            (pb.v1_grpc.add_DRAPluginServicer_to_server, V1(d)),
            (pb.v1beta1_grpc.add_DRAPluginServicer_to_server, V1beta1(d)),
            (pb.health_grpc.add_DRAResourceHealthServicer_to_server,
             HealthService(d, self.health, self.stopping))],
            "the DRA plugin listens there", SERVICE_WORKERS)
        self.servers.append((server, self.endpoint))

    def _serve_registration(self) -> None:
        os.makedirs(os.path.dirname(self.reg_path), 0o750, exist_ok=True)
        server = serve(self.reg_path, [
            (pb.reg_grpc.add_RegistrationServicer_to_server, self.registration)],
            "the DRA plugin listens there")
        self.servers.append((server, self.reg_path))

    def start(self) -> None:
        self._take_lock()
        try:
            self._serve_service()
            # the registration socket last: the kubelet dials the service once it sees it
            self._serve_registration()
        except BaseException:
            self.stop()
            raise
        self.stopping.clear()
        restored = health_record.keep(os.path.join(self.dir, health_record.FILE), self.health,
                                      {d.uuid for d in self.driver.devices.values()})
        if restored:
            self.health.wake()
        if self.watcher is not None:
            self.watcher.start()
        threading.Thread(target=self._keep_sockets, name="nvctk-dra-sockets",
                         daemon=True).start()
        log.info("serving %s at %s (registration %s)", self.driver.name, self.endpoint,
                 self.reg_path)

    def _keep_sockets(self) -> None:
        """A socket removed from under the plugin (a kubelet that cleans its dirs, an
        operator) is made again: the kubelet's watcher then registers the plugin anew."""
        while not self.stopping.wait(SOCKET_CHECK_S):
            for path, again in ((self.endpoint, self._serve_service),
                                (self.reg_path, self._serve_registration)):
                with self._servers_lock:
                    if os.path.exists(path) or self.stopping.is_set():
                        continue
                    for server, p in [sp for sp in self.servers if sp[1] == path]:
                        server.stop(grace=0.5).wait()
                        self.servers.remove((server, p))
                    try:
                        again()
                        log.warning("%s was removed: made again", path)
                    except NvctkError as e:
                        log.error("%s was removed and cannot be made again: %s", path, e)

    def stop(self) -> None:
        self.stopping.set()
        self.health.wake()
        if self.watcher is not None and self.watcher.is_alive():
            self.watcher.stop()
            self.watcher.join(2)
        with self._servers_lock:
            for server, path in reversed(self.servers):
                server.stop(grace=0.5).wait()
                try:
                    if stat.S_ISSOCK(os.lstat(path).st_mode):
                        os.unlink(path)
                except FileNotFoundError:
                    pass
            self.servers = []
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
