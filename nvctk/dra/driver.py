"""NodePrepareResources and NodeUnprepareResources, independent of gRPC (nvctk.dra.server
converts): per claim, its devices or the reason it cannot have them, never touching
another claim's files.

Prepare: the claim from the API server (a ClaimSource: nvctk.dra.kube retries a down or
slow server with back-off, within API_TIMEOUT), its uid checked, this driver's results checked
(nvctk.dra.claims), then one CDI spec for the claim, written atomically into the CDI
dir: nvctk's own CDI spec for those devices (nvctk.cdi.generate, the forms `nvctk cdi
generate` writes, made once at the plugin's start), under the kind
`k8s.<driver>/claim` with one device `<claim uid>-<device>` per allocated device (no
`all`: claims' specs share the kind, and a name two specs define is a conflict to a
CDI engine), and NVIDIA_VISIBLE_DEVICES=void (an image's `all` must not add GPUs the
claim does not hold where nvctk-runtime is the engine's runtime). Then the record (nvctk.dra.record): the spec first, so that a record
always names a spec that was written. A claim with a record from this boot is answered
from it (the kubelet retries; the API server need not be up).

Unprepare: from the record only (no API server): the spec, then the record, go.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from nvctk.base.errors import NvctkError, shown
from nvctk.cdi import generate as cdi_generate
from nvctk.dra import claims as dra_claims
from nvctk.dra.claims import ClaimError, ClaimSource
from nvctk.dra.devices import DraDevice
from nvctk.dra.record import Prepared, PreparedDevice, RecordError, Records, boot_id, check_uid
from nvctk.edits import Edits

log = logging.getLogger("nvctk.dra")

CDI_CLASS = "claim"
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"


@dataclass(frozen=True)
class CdiForms:
    """nvctk's CDI forms of this host (nvctk.cdi.generate.host_edits): what every
    container gets, and each device's own, by uuid."""

    common: Edits
    by_uuid: dict[str, Edits]
    hook_path: str
    hook_env: tuple[str, ...] = ()


# how long one claim may wait for the API server (nvctk.dra.kube retries within it):
# well inside the kubelet's deadline for NodePrepareResources (45 s)
API_TIMEOUT = 20.0


def cdi_vendor(driver: str) -> str:
    return f"k8s.{driver}"


class Driver:
    def __init__(self, name: str, pool: str, devices: dict[str, DraDevice], forms: CdiForms,
                 source: ClaimSource, records: Records, cdi_dir: str,
                 unhealthy: Callable[[], set[str]] = set, api_timeout: float = API_TIMEOUT
                 ) -> None:
        self.name = name
        self.pool = pool  # the node's name: the pool of its ResourceSlices
        self.devices = devices
        self.forms = forms
        self.source = source
        self.records = records
        self.cdi_dir = cdi_dir
        self.unhealthy = unhealthy
        self.api_timeout = api_timeout
        self.boot_id = boot_id()
        self._lock = threading.Lock()  # one claim's files at a time

    # --- names ------------------------------------------------------------------------
    def cdi_kind(self) -> str:
        return f"{cdi_vendor(self.name)}/{CDI_CLASS}"

    def spec_path(self, uid: str) -> str:
        return os.path.join(self.cdi_dir, f"{cdi_vendor(self.name)}-{CDI_CLASS}_{uid}.json")

    # --- prepare ----------------------------------------------------------------------
    def prepare(self, namespace: str, name: str, uid: str) -> list[PreparedDevice]:
        """The claim's devices with their CDI ids; NvctkError saying why not."""
        check_uid(uid)
        done = self._prepared(uid)
        if done is not None:
            return list(done.devices)
        claim = self.source.get_claim(namespace, name, self.api_timeout)
        dra_claims.check_uid(claim, namespace, name, uid)
        results = dra_claims.results(claim, self.name, self.pool, self.devices)
        sick = self.unhealthy()
        bad = [r.device.name for r in results if r.device.uuid in sick or r.device.gpu.uuid in sick]
        if bad:
            raise ClaimError(f"device {bad[0]} is unhealthy (an XID error): not prepared")
        # one entry per device: two requests may name one device (shares of it)
        devs: dict[str, PreparedDevice] = {}
        for r in results:
            cdi_id = f"{self.cdi_kind()}={uid}-{r.device.name}"
            old = devs.get(r.device.name)
            reqs = (*old.requests, r.request) if old else (r.request,)
            devs[r.device.name] = PreparedDevice(reqs, r.pool, r.device.name, (cdi_id,),
                                                 r.share_id if old is None else old.share_id)
        rec = Prepared(namespace, name, uid, self.spec_path(uid), tuple(devs.values()),
                       self.boot_id)
        with self._lock:
            self._write_spec(uid, [r.device for r in results])
            try:
                self.records.save(rec)
            except OSError as e:
                self._remove_spec(uid)
                raise NvctkError(f"cannot record the claim in {self.records.dir}: "
                                 f"{e.strerror or e}") from None
        log.info("prepared claim %s/%s (%s): %s", namespace, name, uid,
                 ", ".join(devs) or "no device of this driver")
        return list(devs.values())

    def _prepared(self, uid: str) -> Prepared | None:
        """This boot's record of the claim, when its spec is still there."""
        rec = self.records.load(uid)
        if rec is None or rec.boot_id != self.boot_id:
            return None
        if rec.devices and not os.path.isfile(rec.cdi_spec):
            return None  # removed by hand: made again
        return rec

    def _write_spec(self, uid: str, devices: list[DraDevice]) -> None:
        path = self.spec_path(uid)
        if not devices:
            return  # no device of this driver: no spec, nothing for a container
        f = self.forms
        names = list(dict.fromkeys(d.name for d in devices))
        by_name = {d.name: d for d in devices}
        spec = cdi_generate.make_spec(
            f.common, [([f"{uid}-{n}"], f.by_uuid[by_name[n].uuid]) for n in names],
            f.hook_path, vendor=cdi_vendor(self.name), cls=CDI_CLASS,
            hook_env=list(f.hook_env))
        # the per-claim spec has the claim's devices only: `all` would be defined by
        # every claim's spec of this kind, a conflict to CDI
        spec["devices"] = [d for d in spec["devices"] if d["name"] != "all"]
        # the claim's devices and no other: an image's NVIDIA_VISIBLE_DEVICES=all (CUDA
        # images have it) must not widen the claim under nvctk-runtime's legacy mode
        spec["containerEdits"].setdefault("env", []).append(f"{VISIBLE_DEVICES}=void")
        try:
            cdi_generate.write_spec(path, cdi_generate.dump(spec, "json"))
        except cdi_generate.CdiError as e:
            raise NvctkError(f"CDI spec for the claim: {e}") from None

    # --- unprepare --------------------------------------------------------------------
    def unprepare(self, namespace: str, name: str, uid: str) -> None:
        """The claim's spec and record go; a claim never prepared (or already
        unprepared) is done."""
        check_uid(uid)
        with self._lock:
            rec = self.records.load(uid)
            if rec is None:
                return
            self._remove_spec(uid, rec.cdi_spec)
            try:
                self.records.remove(uid)
            except OSError as e:
                raise NvctkError(f"cannot remove the claim's record in {self.records.dir}: "
                                 f"{e.strerror or e}") from None
        log.info("unprepared claim %s/%s (%s)", namespace, name, uid)

    def _remove_spec(self, uid: str, recorded: str | None = None) -> None:
        path = self.spec_path(uid)
        if recorded is not None and recorded != path:
            # a record never names another file: one that does is not acted on
            raise RecordError(f"the claim's record names CDI spec {shown(recorded)}, not "
                              f"{path}: left as it is")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise NvctkError(f"cannot remove the claim's CDI spec {path}: "
                             f"{e.strerror or e}") from None

    def prepared_uids(self) -> list[str]:
        return self.records.uids()
