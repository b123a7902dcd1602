"""A fake kubelet for the device plugin tests: the Registration service on
<dir>/kubelet.sock (the same proto as the plugin), which, like the kubelet,
dials each registered plugin's socket and keeps its ListAndWatch stream."""

from __future__ import annotations

import os
import threading
import time
from concurrent import futures
from typing import Any

import grpc

from nvctk.k8s import gen

gen.ensure()  # the build's generator step, for a checkout that has not run it

from nvctk.k8s import proto  # noqa: E402
from support import wait  # noqa: E402

pb, pb_grpc = proto.load()


class Registered:
    """One plugin as the kubelet sees it: its last device list, its stub."""

    def __init__(self, kubelet_dir: str, req: Any) -> None:
        self.request = req
        self.channel = grpc.insecure_channel("unix://" + os.path.join(kubelet_dir, req.endpoint))
        self.stub = pb_grpc.DevicePluginStub(self.channel)
        self.lists: list[dict[str, str]] = []
        self.updated = threading.Condition()
        self.stream = self.stub.ListAndWatch(pb.Empty())
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        try:
            for resp in self.stream:
                with self.updated:
                    self.lists.append({d.ID: d.health for d in resp.devices})
                    self.updated.notify_all()
        except grpc.RpcError:
            pass

    def wait_list(self, pred: Any = lambda devs: True, timeout: float = 5.0) -> dict[str, str]:
        return wait.newest(self.updated, self.lists, pred, timeout, "device list")

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()


class FakeKubelet(pb_grpc.RegistrationServicer):  # type: ignore[misc,name-defined]
    def __init__(self, kubelet_dir: str) -> None:
        self.dir = kubelet_dir
        self.plugins: dict[str, Registered] = {}
        self.registrations: list[Any] = []
        self.changed = threading.Condition()
        self.server: Any = None

    def Register(self, request: Any, context: Any) -> Any:
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"version {request.version}")
        with self.changed:
            old = self.plugins.get(request.resource_name)
            if old:
                old.close()
            self.plugins[request.resource_name] = Registered(self.dir, request)
            self.registrations.append(request)
            self.changed.notify_all()
        return pb.Empty()

    def start(self) -> FakeKubelet:
        path = os.path.join(self.dir, "kubelet.sock")
        if os.path.exists(path):
            os.unlink(path)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port("unix://" + path)
        self.server.start()
        return self

    def restart(self) -> None:
        """As a kubelet restart: plugin sockets deleted, kubelet.sock re-created."""
        self.stop()
        for name in os.listdir(self.dir):
            if name.endswith(".sock"):
                os.unlink(os.path.join(self.dir, name))
        self.start()

    def stop(self) -> None:
        with self.changed:
            for p in self.plugins.values():
                p.close()
            self.plugins.clear()
        if self.server is not None:
            self.server.stop(0).wait()
            self.server = None

    def wait_for(self, names: list[str], count: int = 0, timeout: float = 10.0) -> None:
        """Until every name is registered (and at least count registrations were seen)."""
        end = time.monotonic() + timeout
        with self.changed:
            while not (all(n in self.plugins for n in names) and len(self.registrations) >= count):
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"registered: {sorted(self.plugins)}, wanted {names}")
                self.changed.wait(left)
