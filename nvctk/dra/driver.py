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
from dataclasses import dataclass, field
from typing import Any

from nvctk.base.errors import NvctkError, shown
from nvctk.cdi import generate as cdi_generate
from nvctk.cdi import transforms
from nvctk.dra import claims as dra_claims
from nvctk.dra.claims import ClaimError, ClaimSource, Result, UnknownDevice
from nvctk.dra.devices import MEMORY, SM_FULL, SM_SHARE, DraDevice, node_devices
from nvctk.dra.record import Prepared, PreparedDevice, RecordError, Records, boot_id, check_uid
from nvctk.edits import Edits, Mount
from nvctk.host.discover import DEFAULT_MPS_PIPE_DIR
from nvctk.host.inventory import HostInfo
from nvctk.k8s.allocate import MPS_PIPE_IN_CONTAINER, mps_pipe

log = logging.getLogger("nvctk.dra")

CDI_CLASS = "claim"


@dataclass(frozen=True)
class Shares:
    """Where a share's cap is kept: nvctk's state dir (the claims' ledgers, below
    dra/), and the host path of libvgpu.so (nvctk.host.paths.vgpu_library; "": none,
    a share claim is refused), from nvctk's config; the driver root, under which an MPS
    claim's pipe directory is (the device plugin's default, /tmp/nvidia-mps), and where
    the host has that root (a plugin in a container sees the host's driver elsewhere:
    what a spec names is the host's path)."""

    state_dir: str
    library: str
    driver_root: str = "/"
    host_driver_root: str | None = None


@dataclass(frozen=True)
class CdiForms:
    """nvctk's CDI forms of this host (nvctk.cdi.generate.host_edits): what every
    container gets, and each device's own, by uuid."""

    common: Edits
    by_uuid: dict[str, Edits]
    hook_path: str
    hook_env: tuple[str, ...] = ()


@dataclass
class Inventory:
    """Where the driver's devices and CDI forms come from: the host as NVML says now
    (query), nvctk's CDI forms of a host (forms), and the host they were last made from."""

    query: Callable[[], HostInfo]
    forms: Callable[[HostInfo], CdiForms]
    host: HostInfo


# how long one claim may wait for the API server (nvctk.dra.kube retries within it):
# well inside the kubelet's deadline for NodePrepareResources (45 s)
API_TIMEOUT = 20.0


def cdi_vendor(driver: str) -> str:
    return f"k8s.{driver}"


@dataclass(eq=False)
class Driver:
    """One node's DRA driver: its devices and CDI forms, where claims come from and
    where what it prepared is recorded."""

    name: str
    pool: str  # the node's name: the pool of its ResourceSlices
    devices: dict[str, DraDevice]
    forms: CdiForms
    source: ClaimSource
    records: Records
    cdi_dir: str
    shares: Shares
    unhealthy: Callable[[], set[str]] = set
    api_timeout: float = API_TIMEOUT
    inventory: Inventory | None = None
    boot_id: str = field(init=False, default_factory=boot_id)
    # one claim's files at a time
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def rediscover(self) -> HostInfo:
        """The host as NVML says now; the driver's devices and CDI forms made again
        from it when it changed (a GPU gone, a new MIG layout). The publisher queries
        the GPUs through this, so what is published is what prepare prepares, with no
        restart."""
        inv = self.inventory
        if inv is None:
            raise NvctkError("this driver has no inventory to query")
        host = inv.query()
        if host != inv.host:
            devices, forms = node_devices(host), inv.forms(host)
            with self._lock:  # not while a claim's spec is written from the old forms
                self.devices, self.forms, inv.host = devices, forms, host
            log.info("the GPUs changed: %d devices now (%s)", len(devices), ", ".join(devices))
        return host

    # --- names ------------------------------------------------------------------------
    def cdi_kind(self) -> str:
        return f"{cdi_vendor(self.name)}/{CDI_CLASS}"

    def spec_path(self, uid: str) -> str:
        check_uid(uid)  # it names the file: checked where the name is made
        return os.path.join(self.cdi_dir, f"{cdi_vendor(self.name)}-{CDI_CLASS}_{uid}.json")

    # --- prepare ----------------------------------------------------------------------
    def prepare(self, namespace: str, name: str, uid: str) -> list[PreparedDevice]:
        """The claim's devices with their CDI ids; NvctkError saying why not."""
        check_uid(uid)
        try:
            done = self._prepared(uid)
        except RecordError as e:
            # the spec and ledger are named by the uid: made anew, the record rewritten
            log.warning("claim %s/%s: %s; preparing it anew", namespace, name, e)
            done = None
        if done is not None:
            return list(done.devices)
        results = self._results(namespace, name, uid)
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
        mps = bool(results) and all(r.strategy == "MPS" for r in results)
        mps_edits = self._mps_edits(results) if mps else ({}, ())
        # an MPS claim's share is MPS's to limit; any other share is capped by libvgpu
        ledger = self.ledger_path(uid) if not mps and any(r.partial for r in results) else None
        rec = Prepared(namespace, name, uid, self.spec_path(uid), tuple(devs.values()),
                       self.boot_id, ledger)
        with self._lock:
            try:
                if not results:
                    pass  # no device of this driver: no spec, nothing for a container
                elif ledger is not None:
                    self._write_share_spec(uid, results, ledger)
                else:
                    self._write_spec(uid, [r.device for r in results], None, *mps_edits)
                self.records.save(rec)
            except BaseException as e:
                self._undo(uid, ledger)
                if isinstance(e, OSError):
                    raise NvctkError(f"cannot record the claim in {self.records.dir}: "
                                     f"{e.strerror or e}") from None
                raise
        log.info("prepared claim %s/%s (%s): %s", namespace, name, uid,
                 ", ".join(devs) or "no device of this driver")
        return list(devs.values())

    def _results(self, namespace: str, name: str, uid: str) -> list[Result]:
        """The claim's allocation results on this driver's devices (ClaimError naming the
        claim); the inventory asked again, once, for a device it does not know."""
        claim = self.source.get_claim(namespace, name, self.api_timeout)
        dra_claims.check_uid(claim, namespace, name, uid)
        try:
            try:
                return dra_claims.results(claim, self.name, self.pool, self.devices)
            except UnknownDevice:
                if self.inventory is None:
                    raise
                # a MIG device made since the inventory was read (published by a sync that
                # ran before this driver heard of it, or not yet): asked again, once
                self.rediscover()
                return dra_claims.results(claim, self.name, self.pool, self.devices)
        except ClaimError as e:  # the field is named; the claim too, for the node's log
            raise type(e)(f"claim {namespace}/{name}: {e}") from None

    def _prepared(self, uid: str) -> Prepared | None:
        """This boot's record of the claim, when its spec is still there."""
        rec = self.records.load(uid)
        if rec is None or rec.boot_id != self.boot_id:
            return None
        if rec.devices and not os.path.isfile(rec.cdi_spec):
            return None  # removed by hand: made again
        if rec.ledger is not None and not os.path.isdir(os.path.join(rec.ledger, "ro")):
            return None  # a ledger of an nvctk before plain-CDI shares: made anew
        return rec

    def _write_spec(self, uid: str, devices: list[DraDevice], common: Edits | None = None,
                    env: dict[str, str] | None = None, mounts: tuple[Mount, ...] = ()) -> None:
        """common: the form every container of the claim gets (default: the host's common
        form; a share's adds its vGPU mounts and pins); env, mounts: what they get besides
        (an MPS claim's env and pipe mount)."""
        f = self.forms
        gone = [d.name for d in devices if d.uuid not in f.by_uuid]
        if gone:  # the inventory changed between reading the claim and now
            raise ClaimError(f"device {gone[0]} changed while the claim was prepared "
                             "(a new MIG layout): not prepared")
        names = list(dict.fromkeys(d.name for d in devices))
        by_name = {d.name: d for d in devices}
        spec = cdi_generate.make_spec(
            transforms.claim_part(common or f.common, env or {}, mounts),
            [([f"{uid}-{n}"], f.by_uuid[by_name[n].uuid]) for n in names],
            f.hook_path, vendor=cdi_vendor(self.name), cls=CDI_CLASS,
            hook_env=list(f.hook_env), all_device=False)
        self._save_spec(uid, spec)

    def _mps_edits(self, results: list[Result]) -> tuple[dict[str, str], tuple[Mount, ...]]:
        """An MPS claim's container edits, as the device plugin's MPS shares get them
        (nvctk.k8s.allocate): the host's MPS pipe directory (a clear error when the MPS
        control daemon's is missing, never a silent non-MPS run) at the same place in
        the container, CUDA_MPS_PIPE_DIRECTORY naming it, and the consumed capacity as
        MPS's limits: smShare as CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (one value for the
        container's every GPU), memory as CUDA_MPS_PINNED_DEVICE_MEM_LIMIT per GPU UUID."""
        by_dev: dict[str, list[Result]] = {}
        for r in results:
            by_dev.setdefault(r.device.name, []).append(r)
        threads: dict[str, int] = {}
        pinned = []
        for name, rs in by_dev.items():
            d = rs[0].device
            threads[name] = min(SM_FULL, sum(r.consumed.get(SM_SHARE, 0) for r in rs)) % SM_FULL
            mem = min(d.memory, sum(r.consumed.get(MEMORY, d.memory) for r in rs))
            if mem < d.memory:
                pinned.append(f"{d.uuid}={mem >> 20}M")  # whole MiB: the request policy's step
        if len(set(threads.values())) > 1:
            split = ", ".join(f"{n}: {t or SM_FULL}%" for n, t in threads.items())
            raise ClaimError(f"sharing strategy MPS with uneven smShare across devices "
                             f"({split}): CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is one value for "
                             "every GPU of a container")
        try:
            pipe = mps_pipe(DEFAULT_MPS_PIPE_DIR, self.shares.driver_root,
                            self.shares.host_driver_root)
        except NvctkError as e:
            raise ClaimError(f"sharing strategy MPS: {e}") from None
        env = {"CUDA_MPS_PIPE_DIRECTORY": MPS_PIPE_IN_CONTAINER}
        percent = next(iter(threads.values()))
        if percent:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percent)
        if pinned:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(pinned)
        return env, (Mount(pipe, MPS_PIPE_IN_CONTAINER, "dir", read_only=False),)

    def _save_spec(self, uid: str, spec: dict[str, Any]) -> None:
        try:
            cdi_generate.write_spec(self.spec_path(uid), cdi_generate.dump(spec, "json"))
        except cdi_generate.CdiError as e:
            raise NvctkError(f"CDI spec for the claim: {e}") from None

    # --- shares -----------------------------------------------------------------------
    def ledger_path(self, uid: str) -> str:
        from nvctk.vgpu.state import ledger_dir

        check_uid(uid)
        return ledger_dir(self.shares.state_dir, uid)

    def _write_share_spec(self, uid: str, results: list[Result], ledger: str) -> None:
        """A claim with a share: its caps (the consumed capacity of each device, summed
        over the claim's results on it, at most the device's) in the claim's ledger, and
        a spec that gives everything a container needs under any CDI runtime: the
        devices' own spec (nodes, driver files, the cdi-edits hook) plus libvgpu, the
        ledger's read-only limits and its cache, and an /etc/ld.so.preload bound
        read-only, all mounted as a vGPU container's are, and the hook pinning /etc and
        /run first (so no rename carries the mounts away). Nothing of it is env: no Pod
        can copy it into its own, and no env or file in the container loosens the cap
        (libvgpu takes the stricter of the limits file and the env)."""
        from nvctk.plan.vgpu import claim_vgpu, vgpu_env, vgpu_pins
        from nvctk.vgpu import limits as vgpu
        from nvctk.vgpu import state as vgpu_state

        if not self.shares.library:
            raise ClaimError("a share claim needs libvgpu.so, which this node's nvctk lacks "
                             "(set vgpu-library in the nvctk config, or install nvctk's package)")
        by_dev: dict[str, list[Result]] = {}
        for r in results:
            by_dev.setdefault(r.device.name, []).append(r)
        # the container's GPU order is the host's (CDI engines add device nodes in the
        # spec's order; CUDA and NVML enumerate by PCI bus, the host's NVML order)
        devs = sorted((rs[0].device for rs in by_dev.values()),
                      key=lambda d: (d.gpu.index, d.mig.index if d.mig else -1))
        memory: list[int] = []
        sm: list[int] = []
        for d in devs:
            rs = by_dev[d.name]
            if not any(r.partial for r in rs):
                memory.append(0)  # a whole device of the claim: no cap
                sm.append(0)
                continue
            mem = min(d.memory, sum(r.consumed.get(MEMORY, d.memory) for r in rs))
            pct = min(SM_FULL, sum(r.consumed.get(SM_SHARE, SM_FULL) for r in rs))
            memory.append(mem if mem < d.memory else 0)
            sm.append(pct if pct < SM_FULL else 0)
        limits = vgpu.VgpuLimits(memory=tuple(memory), sm=tuple(sm))
        values = {**limits.values(), **{f"{vgpu.UUID_VAR}_{i}": d.uuid
                                        for i, d in enumerate(devs) if d.mig is None}}
        plan = claim_vgpu(self.shares.library, ledger, values)
        try:
            vgpu_state.install_ledger(plan)
        except OSError as e:
            raise NvctkError(f"the claim's vGPU ledger {ledger}: {e.strerror or e}") from None
        self._write_spec(uid, devs, common=transforms.with_vgpu_share(
            self.forms.common, plan, vgpu_env(plan), vgpu_pins(plan)))

    def _undo(self, uid: str, ledger: str | None) -> None:
        """A failed prepare leaves nothing of the claim (best effort: the failure itself
        is what is reported)."""
        from nvctk.vgpu import state as vgpu_state

        try:
            self._remove_spec(uid)
            if ledger is not None:
                vgpu_state.remove_ledger(ledger)
        except (OSError, NvctkError) as e:
            log.warning("claim %s: clean-up after a failed prepare: %s", uid, e)

    # --- unprepare --------------------------------------------------------------------
    def unprepare(self, namespace: str, name: str, uid: str) -> None:
        """The claim's spec and record go; a claim never prepared (or already
        unprepared) is done."""
        check_uid(uid)
        with self._lock:
            try:
                rec = self.records.load(uid)
            except RecordError as e:
                self._unprepare_unrecorded(uid, e)
            if rec is None:
                return
            self._remove_spec(uid, rec.cdi_spec)
            if rec.ledger is not None:
                self._remove_ledger(uid, rec.ledger)
            try:
                self.records.remove(uid)
            except OSError as e:
                raise NvctkError(f"cannot remove the claim's record in {self.records.dir}: "
                                 f"{e.strerror or e}") from None
        log.info("unprepared claim %s/%s (%s)", namespace, name, uid)

    def _unprepare_unrecorded(self, uid: str, e: RecordError) -> None:
        """A record that cannot be read: what the claim can have (its spec and ledger,
        named by its uid alone) goes, the record is kept aside for the operator, and the
        answer says so (the kubelet's retry then finds the claim done)."""
        from nvctk.vgpu import state as vgpu_state

        self._remove_spec(uid)
        try:
            vgpu_state.remove_ledger(self.ledger_path(uid))
        except (OSError, NvctkError) as err:
            raise NvctkError(f"{e}; and the claim's vGPU ledger cannot be removed: {err}")
        kept = self.records.path(uid) + ".corrupt"
        try:
            os.replace(self.records.path(uid), kept)
        except OSError as err:
            raise NvctkError(f"{e}; and it cannot be moved aside: {err.strerror}") from None
        raise NvctkError(f"{e}: the claim's CDI spec and vGPU ledger (named by its uid) are "
                         f"removed; the record is kept as {kept}")

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

    def _remove_ledger(self, uid: str, recorded: str) -> None:
        from nvctk.vgpu import state as vgpu_state

        path = self.ledger_path(uid)
        if recorded != path:
            raise RecordError(f"the claim's record names vGPU ledger {shown(recorded)}, not "
                              f"{path}: left as it is")
        try:
            vgpu_state.remove_ledger(path)
        except (OSError, NvctkError) as e:
            raise NvctkError(f"cannot remove the claim's vGPU ledger {path}: {e}") from None

    def prepared_uids(self) -> list[str]:
        return self.records.uids()
