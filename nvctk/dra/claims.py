"""What NodePrepareResources needs from a ResourceClaim, read and checked (no I/O).

The claim comes from a ClaimSource (the API server through nvctk.dra.kube, which retries
a down or slow server within the caller's timeout; tests give a plain in-memory one) in
its API JSON form (`resource.k8s.io/v1`, camelCase, as the
server sends it and as the `kubernetes` client's sanitize_for_serialization gives it).
From it: the uid (checked against the kubelet's), this driver's allocation results
(other drivers' are ignored), each result's device on this node, its consumed capacity
(a Kubernetes quantity, at most the device's) and the opaque parameters of this driver
that apply to its request.

Opaque parameters (`config[].opaque.parameters` with `driver` = this driver):

    {"apiVersion": "gpu.nvctk.io/v1", "kind": "GpuConfig",
     "sharing": {"strategy": "Exclusive" | "TimeSlicing" | "VGpu" | "MPS"}}

TimeSlicing (the default) is what several claims on one GPU get without caps (the
driver's time slices, as the device plugin's time-slicing); Exclusive refuses a result
that shares the device (a shareID with less than all of its memory consumed: 1.36 gives
every allocation of a shareable device a shareID, and one that consumes all of the
memory leaves room for no other); VGpu asks that the result be a share whose
consumedCapacity (memory bytes, smShare percent) the node caps (nvctk.dra.driver: a
share is capped whatever the strategy); MPS runs the claim's containers as clients of
the node's MPS control daemon, as the device plugin's MPS shares: its consumedCapacity
becomes MPS's limits (smShare the active thread percentage, memory the pinned device
memory limit) instead of libvgpu's. MPS splits whole GPUs only (not MIG devices), and
a claim is MPS for all of its devices or for none.

A result with `adminAccess` (a claim of a namespace labelled
`resource.kubernetes.io/admin-access`, for monitoring and debugging tools) is access
to a device other claims hold: it is prepared as the whole device, without a share,
cap, ledger or MPS of its own and whatever its strategy (it consumes nothing, so it
takes nothing from the claims it watches; nvctk's monitor shows its processes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import (
    Context,
    Decimal,
    DivisionByZero,
    InvalidOperation,
    Overflow,
    Subnormal,
    Underflow,
)
from typing import Any, Protocol

from nvctk.base.errors import NvctkError, shown
from nvctk.dra.devices import MEMORY, SM_FULL, SM_SHARE, DraDevice
from nvctk.dra.kube import NotFound

PARAMS_API_VERSION = "gpu.nvctk.io/v1"
PARAMS_KIND = "GpuConfig"
STRATEGIES = ("Exclusive", "TimeSlicing", "VGpu", "MPS")


class ClaimError(NvctkError):
    """What is wrong with one claim: its answer's error, no other claim touched."""


class UnknownDevice(ClaimError):
    """A result names a device this node's inventory does not have (yet: a MIG device
    made since the inventory was read)."""


class ClaimSource(Protocol):
    def get_claim(self, namespace: str, name: str, timeout: float | None = None
                  ) -> dict[str, Any]:
        """The claim's API JSON; nvctk.dra.kube.NotFound when there is none,
        nvctk.dra.kube.ApiUnavailable when the server cannot say within `timeout` s."""
        ...


class MemoryClaims:
    """A ClaimSource over a dict (namespace, name) -> claim, for tests and tools."""

    def __init__(self, claims: dict[tuple[str, str], dict[str, Any]] | None = None) -> None:
        self.claims = dict(claims or {})

    def get_claim(self, namespace: str, name: str, timeout: float | None = None
                  ) -> dict[str, Any]:
        try:
            return self.claims[(namespace, name)]
        except KeyError:
            raise NotFound(f"reading ResourceClaim {namespace}/{name}: not found", 404) from None


@dataclass(frozen=True)
class Result:
    """One allocated device of this driver, checked."""

    request: str
    pool: str
    device: DraDevice
    share_id: str | None = None
    consumed: dict[str, int] = field(default_factory=dict)  # capacity name -> amount
    strategy: str = "TimeSlicing"
    admin: bool = False  # adminAccess: monitoring access beside the device's claims

    @property
    def partial(self) -> bool:
        """A share: less than the device's memory or SMs (the node caps it)."""
        d = self.device
        # smShare 0: no SM-share cap (what a claim asking for memory only consumes)
        return bool(self.consumed) and (self.consumed.get(MEMORY, d.memory) < d.memory
                                        or 0 < self.consumed.get(SM_SHARE, 0) < SM_FULL)


# --- quantities (k8s.io/apimachinery resource.Quantity) -----------------------------------

_QUANTITY = re.compile(r"([+-]?[0-9.]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][+-]?[0-9]+)?")
_SUFFIX: dict[str, int | Decimal] = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": 10**3,
           "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
# a quantity's text and magnitude: far past any capacity (bytes of a GPU, percent), far
# inside what Decimal and int() take in no time (an exponent of 1e9 would not be)
MAX_QUANTITY_CHARS = 64
# every step of the arithmetic in this context: a result past 1e±40 traps (Overflow,
# Underflow, InvalidOperation: all ArithmeticError) instead of growing or rounding to 0
_CONTEXT = Context(prec=60, Emin=-40, Emax=40,
                   traps=[InvalidOperation, Overflow, Underflow, Subnormal, DivisionByZero])


def parse_quantity(value: object) -> Decimal:
    """A Kubernetes quantity ("2Gi", "2147483648", "500m", "1e3") as a number; ValueError
    when it is not one, or not one within 1e±40 (the one checked parse of every quantity
    a claim or the API server hands the plugin)."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{shown(value)} is not a quantity")
    # an int's length from its size: str() of one past 4300 digits raises on its own
    if (isinstance(value, int) and abs(value) >= 10 ** MAX_QUANTITY_CHARS) or \
            (isinstance(value, str) and len(value.strip()) > MAX_QUANTITY_CHARS):
        raise ValueError(f"{shown(value)} is not a quantity (longer than "
                         f"{MAX_QUANTITY_CHARS} characters)")
    m = _QUANTITY.fullmatch(str(value).strip())
    if m is None or m.group(1) in (".", "+", "-"):
        raise ValueError(f"{shown(value)} is not a quantity")
    suffix = m.group(2) or ""
    try:
        number = _CONTEXT.create_decimal(m.group(1))
    except ArithmeticError:  # "1.2.3"
        raise ValueError(f"{shown(value)} is not a quantity") from None
    try:
        if suffix[:1] in ("e", "E") and len(suffix) > 1:
            return _CONTEXT.scaleb(number, int(suffix[1:]))
        return _CONTEXT.multiply(number, _SUFFIX[suffix]) if suffix else _CONTEXT.plus(number)
    except ArithmeticError:  # the context's traps
        raise ValueError(f"{shown(value)} is not a quantity within 1e-40..1e40") from None


def _whole(q: Decimal) -> int:
    """Capacities are whole units (bytes, percent): rounded up, as the API server does."""
    return int(q.to_integral_value(rounding="ROUND_CEILING"))


# --- the claim ----------------------------------------------------------------------------


def _get(obj: object, *path: str) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def check_uid(claim: dict[str, Any], namespace: str, name: str, uid: str) -> None:
    have = _get(claim, "metadata", "uid")
    if have != uid:
        raise ClaimError(f"claim {namespace}/{name} has uid {shown(have)}, not {uid} (deleted "
                         "and made again): not prepared")


def _params(cfg: dict[str, Any], where: str) -> str:
    """The sharing strategy in one opaque config of this driver; ClaimError naming what
    is wrong."""
    p = _get(cfg, "opaque", "parameters")
    if not isinstance(p, dict):
        raise ClaimError(f"{where}: parameters must be an object, not {shown(p)}")
    if p.get("apiVersion") != PARAMS_API_VERSION or p.get("kind") != PARAMS_KIND:
        raise ClaimError(f"{where}: want apiVersion {PARAMS_API_VERSION} and kind "
                         f"{PARAMS_KIND}, not {shown(p.get('apiVersion'))} and "
                         f"{shown(p.get('kind'))}")
    extra = sorted(set(p) - {"apiVersion", "kind", "sharing"})
    if extra:
        raise ClaimError(f"{where}: unknown field {shown(extra[0])} (known: apiVersion, kind, "
                         "sharing)")
    sharing = p.get("sharing", {})
    if not isinstance(sharing, dict) or set(sharing) - {"strategy"}:
        raise ClaimError(f"{where}: sharing must be {{\"strategy\": ...}}, not {shown(sharing)}")
    strategy = sharing.get("strategy", "TimeSlicing")
    if strategy not in STRATEGIES:
        raise ClaimError(f"{where}: unknown sharing strategy {shown(strategy)} (one of "
                         f"{', '.join(STRATEGIES)})")
    return str(strategy)


def strategies(claim: dict[str, Any], driver: str) -> dict[str | None, str]:
    """request name (None: every request) -> sharing strategy, from the allocation's
    opaque configs of this driver (later entries win, as the API orders them: class
    configs first, then the claim's)."""
    out: dict[str | None, str] = {}
    configs = _get(claim, "status", "allocation", "devices", "config") or []
    if not isinstance(configs, list):
        raise ClaimError(f"status.allocation.devices.config is not a list: {shown(configs)}")
    for i, cfg in enumerate(configs):
        if _get(cfg, "opaque", "driver") != driver:
            continue  # another driver's parameters
        strategy = _params(cfg, f"status.allocation.devices.config[{i}].opaque")
        requests = cfg.get("requests") or [None]
        for r in requests:
            out[r] = strategy
    return out


def _consumed(raw: object, dev: DraDevice, where: str) -> dict[str, int]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ClaimError(f"{where}: consumedCapacity must be an object, not {shown(raw)}")
    out: dict[str, int] = {}
    for name, value in raw.items():
        if name not in dev.capacity:
            raise ClaimError(f"{where}: consumedCapacity {shown(name)}: device {dev.name} has "
                             f"no such capacity (it has {', '.join(dev.capacity)})")
        try:
            q = parse_quantity(value)
        except ValueError as e:
            raise ClaimError(f"{where}: consumedCapacity {name}: {e}") from None
        amount = _whole(q)
        if amount < (0 if name == SM_SHARE else 1) or amount > dev.capacity[name]:
            raise ClaimError(f"{where}: consumedCapacity {name} {value} is outside "
                             f"{0 if name == SM_SHARE else 1}..{dev.capacity[name]} (device {dev.name}'s {name})")
        out[name] = amount
    return out


def _result(r: dict[str, Any], where: str, pool: str, devices: dict[str, DraDevice],
            by_request: dict[str | None, str]) -> Result:
    """One allocation result of this driver's, checked; ClaimError saying where not."""
    name, pool_name, req = r.get("device"), r.get("pool"), r.get("request")
    if pool_name != pool:
        raise ClaimError(f"{where}: pool {shown(pool_name)} is not this node's ({pool})")
    dev = devices.get(name) if isinstance(name, str) else None
    if dev is None:
        raise UnknownDevice(f"{where}: unknown device {shown(name)} (this node has "
                            f"{', '.join(devices) or 'none'})")
    if not isinstance(req, str) or not req:
        raise ClaimError(f"{where}: no request name")
    share = r.get("shareID")
    if share is not None and (not isinstance(share, str) or not share):
        raise ClaimError(f"{where}: shareID must be a string, not {shown(share)}")
    admin = r.get("adminAccess")
    if admin is not None and not isinstance(admin, bool):
        raise ClaimError(f"{where}: adminAccess must be true or false, not {shown(admin)}")
    if admin:
        # an admin's view of a device others hold (the namespace is labelled for it):
        # the whole device, no share, cap or MPS of its own; it consumes nothing
        return Result(req, pool_name, dev, share, {}, "TimeSlicing", True)
    consumed = _consumed(r.get("consumedCapacity"), dev, where)
    # a subrequest's results name "<request>/<subrequest>": configs name either
    strategy = by_request.get(req, by_request.get(req.split("/", 1)[0],
                                                  by_request.get(None, "TimeSlicing")))
    # 1.36 gives every allocation of a shareable device a shareID: a result is
    # exclusive when it consumes all of the device's memory (no other fits beside it)
    if strategy == "Exclusive" and share is not None and \
            consumed.get(MEMORY, 0) < dev.memory:
        raise ClaimError(f"{where}: sharing strategy Exclusive, but device {dev.name} is "
                         f"allocated as share {share} of it consuming "
                         f"{consumed.get(MEMORY, 0)} of its {dev.memory} bytes of memory "
                         "(an exclusive claim consumes all of it: ask for no capacity)")
    res = Result(req, pool_name, dev, share, consumed, strategy)
    if strategy == "MPS" and dev.mig is not None:
        raise ClaimError(f"{where}: sharing strategy MPS on MIG device {dev.name}: MPS "
                         "shares split whole GPUs only, as the device plugin's")
    if res.partial and dev.mig is not None:
        raise ClaimError(f"{where}: a share of MIG device {dev.name}: nvctk caps shares of "
                         "whole GPUs only (a MIG device is already a partition)")
    if strategy == "VGpu" and not res.partial:
        raise ClaimError(f"{where}: sharing strategy VGpu, but the result consumes no part "
                         f"of device {dev.name}: a vGPU share's caps are its "
                         "consumedCapacity (request memory or smShare capacity)")
    return res


def results(claim: dict[str, Any], driver: str, pool: str,
            devices: dict[str, DraDevice]) -> list[Result]:
    """This driver's allocation results, checked; ClaimError naming the first bad one."""
    alloc = _get(claim, "status", "allocation")
    if not isinstance(alloc, dict):
        raise ClaimError("the claim is not allocated (no status.allocation)")
    raw = _get(alloc, "devices", "results") or []
    if not isinstance(raw, list):
        raise ClaimError(f"status.allocation.devices.results is not a list: {shown(raw)}")
    by_request = strategies(claim, driver)
    out: list[Result] = []
    for i, r in enumerate(raw):
        if not isinstance(r, dict) or r.get("driver") != driver:
            continue  # another driver's device: its own plugin prepares it
        out.append(_result(r, f"status.allocation.devices.results[{i}]", pool, devices,
                           by_request))
    mps = sorted({r.device.name for r in out if r.strategy == "MPS"})
    if mps and len(mps) != len({r.device.name for r in out}):
        raise ClaimError(f"sharing strategy MPS for device(s) {', '.join(mps)} only: a "
                         "container of the claim is an MPS client for all of its devices "
                         "or for none")
    return out
