"""A fake kubelet for the DRA plugin's tests, speaking the real protos (nvctk/dra/third_party)
as the kubelet does: its plugin watcher finds `<registry-dir>/<driver>-reg.sock`, calls
GetInfo and NotifyRegistrationStatus, then dials the endpoint GetInfo named for
NodePrepareResources / NodeUnprepareResources (v1 or v1beta1) and keeps a
NodeWatchResources stream."""

from __future__ import annotations

import os
import threading
from typing import Any

import grpc

from nvctk.k8s import gen

gen.ensure()  # the build's generator step, for a checkout that has not run it

from nvctk.dra import proto  # noqa: E402
from support import wait  # noqa: E402

pb = proto.load()


HEALTH_SERVICE = "v1alpha1.DRAResourceHealth"  # the kubelet's name of the health service


class FakeDraKubelet:
    def __init__(self, registry_dir: str, node_root: str = "") -> None:
        """node_root: where the node's / is (a plugin in a container names its endpoint
        as the node has it)."""
        self.registry_dir = registry_dir
        self.node_root = node_root
        self.info: Any = None
        self.channel: Any = None
        self.health_updates: list[dict[str, tuple[int, str]]] = []
        self.updated = threading.Condition()
        self._stream: Any = None

    def register(self, driver: str, timeout: float = 10.0, accept: bool = True) -> Any:
        """What the plugin watcher does with a new socket: GetInfo, check, notify."""
        reg = os.path.join(self.registry_dir, f"{driver}-reg.sock")
        wait.until(lambda: os.path.exists(reg), timeout, f"{reg} to appear")
        with grpc.insecure_channel("unix://" + reg) as ch:
            stub = pb.reg_grpc.RegistrationStub(ch)
            info = stub.GetInfo(pb.reg.InfoRequest(), timeout=5)
            ok = accept and info.type == "DRAPlugin" and "v1.DRAPlugin" in info.supported_versions
            stub.NotifyRegistrationStatus(pb.reg.RegistrationStatus(
                plugin_registered=ok, error="" if ok else "refused by the test"), timeout=5)
        self.info = info
        if ok:
            self.channel = grpc.insecure_channel("unix://" + self.node_root + info.endpoint)
        return info

    def stub(self, version: str = "v1") -> Any:
        mod = pb.v1_grpc if version == "v1" else pb.v1beta1_grpc
        return mod.DRAPluginStub(self.channel)

    def claims(self, version: str, refs: list[tuple[str, str, str]]) -> list[Any]:
        mod = pb.v1 if version == "v1" else pb.v1beta1
        return [mod.Claim(namespace=ns, name=n, uid=u) for ns, n, u in refs]

    def prepare(self, refs: list[tuple[str, str, str]], version: str = "v1",
                timeout: float = 60) -> dict[str, Any]:
        mod = pb.v1 if version == "v1" else pb.v1beta1
        resp = self.stub(version).NodePrepareResources(
            mod.NodePrepareResourcesRequest(claims=self.claims(version, refs)), timeout=timeout)
        return dict(resp.claims)

    def unprepare(self, refs: list[tuple[str, str, str]], version: str = "v1") -> dict[str, str]:
        mod = pb.v1 if version == "v1" else pb.v1beta1
        resp = self.stub(version).NodeUnprepareResources(
            mod.NodeUnprepareResourcesRequest(claims=self.claims(version, refs)), timeout=60)
        return {uid: r.error for uid, r in resp.claims.items()}

    def watch_health(self) -> None:
        """The kubelet opens the health stream only to a plugin that names the service
        in its registration's supported versions."""
        assert HEALTH_SERVICE in self.info.supported_versions, (
            f"the plugin does not advertise {HEALTH_SERVICE}: the kubelet never reads its health")
        stub = pb.health_grpc.DRAResourceHealthStub(self.channel)
        self._stream = stub.NodeWatchResources(pb.health.NodeWatchResourcesRequest())
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        try:
            for resp in self._stream:
                with self.updated:
                    self.health_updates.append({d.device.device_name: (d.health, d.message)
                                                for d in resp.devices})
                    self.updated.notify_all()
        except grpc.RpcError:
            pass

    def wait_health(self, pred: Any, timeout: float = 10.0) -> dict[str, tuple[int, str]]:
        return wait.newest(self.updated, self.health_updates, pred, timeout, "health")

    def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        if self.channel is not None:
            self.channel.close()
