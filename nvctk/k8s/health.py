"""Device health from NVML XID critical-error events (pynvml on the driver root's
own libnvidia-ml, as nvctk.host.nvml loads it).

XIDs that report an application's fault, not the GPU's (13 graphics engine
exception, 31 MMU fault, 43 channel stopped, 45 preemptive cleanup, 68 video
processor exception, 109 context switch timeout) are ignored, as in NVIDIA's
plugin. Any other XID marks the device Unhealthy: the MIG device named by the
event's GPU/compute instance ids, else the GPU and all its MIG devices.
Listeners (the ListAndWatch streams) are woken at once, and the wait is at most
WAIT_MS, so an update reaches the kubelet well within a second.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from nvctk.host import nvml
from nvctk.host.inventory import HostInfo

IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
XID_EVENT = 0x8  # nvmlEventTypeXidCriticalError
NO_INSTANCE = 0xFFFFFFFF
WAIT_MS = 200  # how long a wait blocks; bounds only how fast stop() takes effect

log = logging.getLogger("nvctk.k8s")


class Health:
    """The set of unhealthy device uuids, shared by every resource of the plugin."""

    def __init__(self) -> None:
        self.unhealthy: set[str] = set()
        self.reasons: dict[str, str] = {}  # uuid -> why it is unhealthy (the first reason)
        self.changed = threading.Condition()
        self.generation = 0  # bumped on each change; streams resend when it moves
        self.last_change: float = 0.0  # time.monotonic() of the last change (bench)
        # called after each change, outside the lock (the DRA plugin's record of it)
        self.on_change: Callable[[], None] | None = None

    def mark(self, uuids: set[str], reason: str) -> None:
        with self.changed:
            new = uuids - self.unhealthy
            if not new:
                return
            self.unhealthy |= new
            self.reasons.update(dict.fromkeys(new, reason))
            self.generation += 1
            self.last_change = time.monotonic()
            self.changed.notify_all()
        log.warning("marking %s Unhealthy: %s", ", ".join(sorted(new)), reason)
        if self.on_change is not None:
            self.on_change()

    def snapshot(self) -> dict[str, str]:
        """The unhealthy devices and why, as they are now (`changed` is re-entrant: a caller
        may hold it, to read the generation with them)."""
        with self.changed:
            return {u: self.reasons.get(u, "unhealthy") for u in self.unhealthy}

    def wake(self) -> None:
        """Wake waiting streams without a change (shutdown)."""
        with self.changed:
            self.generation += 1
            self.changed.notify_all()

    def watch(self, context: Any, stopping: threading.Event) -> Iterator[None]:
        """A stream's turns (the device plugin's ListAndWatch, the DRA plugin's
        NodeWatchResources): one at once and one after each change, until stopping is
        set or the peer (a gRPC context) hangs up."""
        seen = -1
        # a kubelet that hangs up frees the stream's worker at once, not at a wait's end
        context.add_callback(self.wake)
        while not stopping.is_set() and context.is_active():
            with self.changed:
                gen = self.generation
                if gen == seen:
                    self.changed.wait(0.5)
                    continue
            seen = gen
            yield


def affected(host: HostInfo, gpu_uuid: str, gi: int, ci: int) -> set[str]:
    """Which uuids an XID on gpu_uuid (instance gi/ci, NO_INSTANCE: none) takes down."""
    for g in host.gpus:
        if g.uuid != gpu_uuid:
            continue
        if gi != NO_INSTANCE:
            hit = {m.uuid for m in g.mig_devices if m.gpu_instance == gi
                   and (ci == NO_INSTANCE or m.compute_instance == ci)}
            if hit:
                return hit
        return {g.uuid, *(m.uuid for m in g.mig_devices)}
    return set()


class XidWatcher(threading.Thread):
    """Waits for XID events on every GPU of the host and marks Health."""

    def __init__(self, driver_root: str, host: HostInfo | Callable[[], HostInfo], health: Health,
                 on_error: Callable[[str], None] | None = None) -> None:
        super().__init__(name="nvctk-xid-watch", daemon=True)
        self.driver_root = driver_root
        # the host as it is now: an XID after a MIG layout change names the new devices
        self._host = host if callable(host) else (lambda: host)
        self.health = health
        self.stopping = threading.Event()
        self.ready = threading.Event()
        self.on_error = on_error

    def stop(self) -> None:
        self.stopping.set()

    def _init(self) -> Any:
        return nvml.held(self.driver_root)

    def run(self) -> None:
        try:
            mod = self._init()
        except Exception as e:  # health is best effort: the devices stay advertised
            self._fail(f"cannot watch XID events: {e}")
            return
        evset = None
        try:
            evset = mod.nvmlEventSetCreate()
            host = self._host()
            for g in host.gpus:
                h = mod.nvmlDeviceGetHandleByUUID(g.uuid)
                try:
                    mod.nvmlDeviceRegisterEvents(h, XID_EVENT, evset)
                except mod.NVMLError as e:
                    # NVIDIA's plugin marks a GPU it cannot watch Unhealthy: a fault there
                    # would go unseen
                    self.health.mark(affected(host, g.uuid, NO_INSTANCE, NO_INSTANCE),
                                     f"cannot register XID events: {e}")
            self.ready.set()
            while not self.stopping.is_set():
                try:
                    data = mod.nvmlEventSetWait_v2(evset, WAIT_MS)
                except mod.NVMLError as e:
                    if e.value == mod.NVML_ERROR_TIMEOUT:
                        continue
                    raise
                if data.eventType != XID_EVENT:
                    continue
                xid = int(data.eventData)
                if xid in IGNORED_XIDS:
                    log.info("ignoring XID %d (an application error, not the GPU's)", xid)
                    continue
                uuid = mod.nvmlDeviceGetUUID(data.device)
                uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
                self.health.mark(affected(self._host(), uuid, data.gpuInstanceId,
                                          data.computeInstanceId), f"XID {xid}")
        except Exception as e:
            self._fail(f"XID watch failed: {e}")
        finally:
            self.ready.set()
            try:
                if evset is not None:
                    mod.nvmlEventSetFree(evset)
                mod.nvmlShutdown()
            except Exception:
                pass

    def _fail(self, msg: str) -> None:
        log.error("%s", msg)
        self.ready.set()
        if self.on_error:
            self.on_error(msg)
