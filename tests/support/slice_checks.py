"""The checks a 1.36 API server makes of a ResourceSlice (422 Invalid, with the reasons
in the Status message, like the real one), for the API-server double (support.apiserver)
and the tests that check slices without a server:
- against the resource.k8s.io/v1 JSON schema of Kubernetes 1.36, strict (no unknown
  field), as the `kubernetes-validate` package ships it (v1.36.0-local-strict);
- against the rules the schema only states in prose (its field descriptions, quoted
  beside each check in `slice_problems` and its helpers): device limits, DNS labels,
  qualified names, exactly one node selection, devices xor sharedCounters, request policies,
  immutable fields on update; `pool_problems` across one pool's slices.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import jsonschema
import referencing
from kubernetes_validate import utils as kv

from nvctk.dra.claims import parse_quantity as quantity  # the driver's one parser

K8S_VERSION = "1.36.0"

MAX_DEVICES = 128
MAX_DEVICES_TAINTS_OR_COUNTERS = 64
MAX_COUNTER_SETS = 8
MAX_COUNTERS = 32
MAX_ATTRS_AND_CAPS = 32
MAX_CONSUMES = 2
MAX_TAINTS = 16
MAX_VALID_VALUES = 10

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
                    r"(-[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?(\+[0-9A-Za-z-]+(\.[0-9A-Za-z-]+)*)?$")


# --- the checks --------------------------------------------------------------------------


@functools.cache
def _validator(kind: str, api_version: str = "resource.k8s.io/v1") -> jsonschema.protocols.Validator:
    """The strict 1.36 schema of kind (one registry, built once); its file is named as
    kubernetes-validate names them (rbac.authorization.k8s.io/v1 -> rbac-v1)."""
    base = f"kubernetes-json-schema/v{K8S_VERSION}-local-strict"
    api = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    schema = kv.schema_contents(f"{base}/{kind.lower()}-{api}.json", K8S_VERSION)
    defs = kv.schema_contents(f"{base}/_definitions.json", K8S_VERSION)
    registry = referencing.Registry().with_resources([
        ("", referencing.Resource.from_contents(schema)),
        ("/api/_definitions.json", referencing.Resource.from_contents(defs))])
    return jsonschema.Draft202012Validator(schema, registry=registry)


def schema_problems(obj: dict[str, Any]) -> list[str]:
    """Where obj breaks the strict 1.36 schema of its kind and apiVersion."""
    v = _validator(obj.get("kind", ""), obj.get("apiVersion", ""))
    return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in sorted(v.iter_errors(obj), key=lambda e: list(map(str, e.absolute_path)))]


def qualified_name(name: str) -> bool:
    """A device attribute or capacity name: a C identifier, optionally prefixed by a
    DNS subdomain and a slash (resource/v1 QualifiedName; the identifier ≤ 32)."""
    domain, _, ident = name.rpartition("/")
    if domain and (len(domain) > 63 or not DNS_SUBDOMAIN.match(domain)):
        return False
    return bool(C_IDENTIFIER.match(ident)) and len(ident) <= 32


def _policy_problems(where: str, cap: dict[str, Any], multi: bool) -> list[str]:
    """capacity.requestPolicy, as CapacityRequestPolicy's descriptions state it."""
    out = []
    policy = cap.get("requestPolicy")
    if policy is None:
        return out
    if not multi:
        out.append(f"{where}.requestPolicy: the Device must have allowMultipleAllocations "
                   "set to true in order to set a requestPolicy")
    try:
        value = quantity(cap["value"])
        default = quantity(policy["default"]) if "default" in policy else None
        rng, values = policy.get("validRange"), policy.get("validValues")
        if rng is not None and values is not None:
            out.append(f"{where}.requestPolicy: validRange and validValues are exclusive")
        if (rng is not None or values is not None) and default is None:
            out.append(f"{where}.requestPolicy.default: required with validRange or validValues")
        if rng is not None:
            lo = quantity(rng["min"])
            hi = quantity(rng["max"]) if "max" in rng else None
            step = quantity(rng["step"]) if "step" in rng else None
            if lo < 0 or lo > value:
                out.append(f"{where}.requestPolicy.validRange.min: must be within 0..value")
            if hi is not None and (hi > value or hi < lo):
                out.append(f"{where}.requestPolicy.validRange.max: must be within min..value")
            if default is not None and (default < lo or (hi is not None and default > hi)):
                out.append(f"{where}.requestPolicy.default: must fall within validRange")
            if step is not None:
                if step <= 0 or lo + step > value:
                    out.append(f"{where}.requestPolicy.validRange.step: min + step must be "
                               "less than or equal to the capacity value")
                for name, q in (("default", default), ("max", hi)):
                    if step > 0 and q is not None and (q - lo) % step:
                        out.append(f"{where}.requestPolicy.{name}: must be a multiple of step")
        if values is not None:
            nums = [quantity(v) for v in values]
            if not nums or len(nums) > MAX_VALID_VALUES:
                out.append(f"{where}.requestPolicy.validValues: 1..{MAX_VALID_VALUES} entries")
            if nums != sorted(set(nums)):
                out.append(f"{where}.requestPolicy.validValues: must be sorted ascending, unique")
            if default is not None and default not in nums:
                out.append(f"{where}.requestPolicy.default: must be one of validValues")
            if nums and max(nums) > value:
                out.append(f"{where}.requestPolicy.validValues: above the capacity value")
        if default is not None and default > value:
            out.append(f"{where}.requestPolicy.default: above the capacity value")
    except (ValueError, KeyError, TypeError) as e:
        out.append(f"{where}: {e}")
    return out


def slice_problems(obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
    """Why a 1.36 API server would refuse this ResourceSlice (empty: it would take it).
    old: the stored object an update replaces (its immutable fields)."""
    out = schema_problems(obj)
    if out:
        return out  # the prose rules below read the fields the schema checked
    name = obj["metadata"].get("name") or ""
    if not DNS_SUBDOMAIN.match(name) or len(name) > 253:
        out.append(f"metadata.name: {name!r} is not a DNS subdomain")
    spec = obj["spec"]
    out.extend(_driver_node_pool_problems(spec))
    devices = spec.get("devices") or []
    counter_sets = spec.get("sharedCounters") or []
    # "Only one of Devices and SharedCounters can be set in a ResourceSlice."
    if devices and counter_sets:
        out.append("spec: only one of devices and sharedCounters can be set")
    out.extend(_counter_set_problems(counter_sets))
    # "Must not have more than 128 entries. If any device uses taints or consumes
    # counters the limit is 64."
    limit = MAX_DEVICES
    if any(d.get("taints") or d.get("consumesCounters") for d in devices):
        limit = MAX_DEVICES_TAINTS_OR_COUNTERS
    if len(devices) > limit:
        out.append(f"spec.devices: {len(devices)} devices > {limit}")
    names: set[str] = set()
    for i, d in enumerate(devices):
        out.extend(_device_problems(f"spec.devices[{i}]", d, names))
    if old is not None:
        # "This field is immutable." (driver, nodeName, pool.name)
        for path in (("driver",), ("nodeName",), ("pool", "name")):
            a, b = field_at(old["spec"], path), field_at(spec, path)
            if a != b:
                out.append(f"spec.{'.'.join(path)}: field is immutable ({a!r} -> {b!r})")
    return out


def _driver_node_pool_problems(spec: dict[str, Any]) -> list[str]:
    """slice_problems' checks of spec.driver, the node selection and spec.pool."""
    out: list[str] = []
    # "Must be a DNS subdomain ... It should use only lower case characters." (≤ 63)
    if not DNS_SUBDOMAIN.match(spec["driver"]) or len(spec["driver"]) > 63:
        out.append(f"spec.driver: {spec['driver']!r} is not a DNS subdomain of ≤ 63 characters")
    # "Exactly one of NodeName, NodeSelector, AllNodes, and PerDeviceNodeSelection"
    chosen = [k for k in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
              if spec.get(k) not in (None, False, "")]
    if len(chosen) != 1:
        out.append(f"spec: exactly one of nodeName, nodeSelector, allNodes, "
                   f"perDeviceNodeSelection must be set (got {chosen})")
    pool = spec["pool"]
    # "≤ 253 characters ... one or more DNS sub-domains separated by slashes"
    if len(pool["name"]) > 253 or not all(DNS_SUBDOMAIN.match(p) for p in pool["name"].split("/")):
        out.append(f"spec.pool.name: {pool['name']!r} is not DNS subdomains separated by '/'")
    if pool["generation"] < 0:
        out.append("spec.pool.generation: must be ≥ 0")
    if pool["resourceSliceCount"] <= 0:
        out.append("spec.pool.resourceSliceCount: must be greater than zero")
    return out


def _counter_set_problems(counter_sets: list[dict[str, Any]]) -> list[str]:
    """slice_problems' checks of spec.sharedCounters."""
    out: list[str] = []
    # "The maximum number of counter sets is 8." / "The maximum number of counters is 32."
    if len(counter_sets) > MAX_COUNTER_SETS:
        out.append(f"spec.sharedCounters: {len(counter_sets)} > {MAX_COUNTER_SETS} counter sets")
    seen: set[str] = set()
    for i, cs in enumerate(counter_sets):
        where = f"spec.sharedCounters[{i}]"
        if not DNS_LABEL.match(cs["name"]) or cs["name"] in seen:
            out.append(f"{where}.name: {cs['name']!r} is not a unique DNS label")
        seen.add(cs["name"])
        if not cs["counters"] or len(cs["counters"]) > MAX_COUNTERS:
            out.append(f"{where}.counters: 1..{MAX_COUNTERS} counters")
        for c, v in cs["counters"].items():
            if not DNS_LABEL.match(c):
                out.append(f"{where}.counters: {c!r} is not a DNS label")
            out.extend(_quantity_problem(f"{where}.counters[{c}].value", v.get("value")))
    return out


def _device_problems(where: str, d: dict[str, Any], names: set[str]) -> list[str]:
    out = []
    # "Name is unique identifier among all devices ... It must be a DNS label."
    if not DNS_LABEL.match(d["name"]) or len(d["name"]) > 63 or d["name"] in names:
        out.append(f"{where}.name: {d['name']!r} is not a unique DNS label")
    names.add(d["name"])
    attrs, caps = d.get("attributes") or {}, d.get("capacity") or {}
    # "The maximum number of attributes and capacities combined is 32."
    if len(attrs) + len(caps) > MAX_ATTRS_AND_CAPS:
        out.append(f"{where}: {len(attrs) + len(caps)} attributes and capacities > "
                   f"{MAX_ATTRS_AND_CAPS}")
    for k, a in attrs.items():
        if not qualified_name(k):
            out.append(f"{where}.attributes: {k!r} is not a qualified name")
        set_ = [t for t in ("bool", "int", "string", "version", "bools", "ints", "strings",
                            "versions") if a.get(t) is not None]
        if len(set_) != 1:
            out.append(f"{where}.attributes[{k}]: exactly one value type (got {set_})")
        if isinstance(a.get("string"), str) and len(a["string"]) > 64:
            out.append(f"{where}.attributes[{k}].string: longer than 64 characters")
        if isinstance(a.get("version"), str) and (len(a["version"]) > 64
                                                   or not SEMVER.match(a["version"])):
            out.append(f"{where}.attributes[{k}].version: {a['version']!r} is not semver 2.0.0")
    multi = bool(d.get("allowMultipleAllocations"))
    for k, c in caps.items():
        if not qualified_name(k):
            out.append(f"{where}.capacity: {k!r} is not a qualified name")
        out.extend(_quantity_problem(f"{where}.capacity[{k}].value", c.get("value")))
        out.extend(_policy_problems(f"{where}.capacity[{k}]", c, multi))
    consumes = d.get("consumesCounters") or []
    # "There can only be a single entry per counterSet. The maximum number of device
    # counter consumptions per device is 2." / counters ≤ 32
    if len(consumes) > MAX_CONSUMES:
        out.append(f"{where}.consumesCounters: {len(consumes)} > {MAX_CONSUMES}")
    sets = [c["counterSet"] for c in consumes]
    if len(sets) != len(set(sets)):
        out.append(f"{where}.consumesCounters: a counterSet named twice")
    for j, c in enumerate(consumes):
        if len(c["counters"]) > MAX_COUNTERS:
            out.append(f"{where}.consumesCounters[{j}].counters: > {MAX_COUNTERS}")
        for n, v in c["counters"].items():
            out.extend(_quantity_problem(f"{where}.consumesCounters[{j}].counters[{n}]",
                                         v.get("value")))
    taints = d.get("taints") or []
    # "The maximum number of taints is 16." key: a label name; value: a label value;
    # "Valid effects are None, NoSchedule and NoExecute."
    if len(taints) > MAX_TAINTS:
        out.append(f"{where}.taints: {len(taints)} > {MAX_TAINTS}")
    for j, t in enumerate(taints):
        prefix, _, key = t["key"].rpartition("/")
        if (prefix and not DNS_SUBDOMAIN.match(prefix)) or not LABEL_NAME.match(key) \
                or len(key) > 63:
            out.append(f"{where}.taints[{j}].key: {t['key']!r} is not a label name")
        value = t.get("value", "")
        if len(value) > 63 or not LABEL_VALUE.match(value):
            out.append(f"{where}.taints[{j}].value: {value!r} is not a label value")
        if t["effect"] not in ("None", "NoSchedule", "NoExecute"):
            out.append(f"{where}.taints[{j}].effect: {t['effect']!r} is not valid")
    return out


def _quantity_problem(where: str, q: Any) -> list[str]:
    try:
        quantity(q)
        return []
    except ValueError as e:
        return [f"{where}: {e}"]


def field_at(d: dict[str, Any], path: tuple[str, ...]) -> Any:
    for p in path:
        d = (d or {}).get(p)  # type: ignore[assignment]
    return d


def pool_problems(slices: list[dict[str, Any]]) -> list[str]:
    """What a consumer (the scheduler) would find wrong with a complete pool: slices
    of one generation whose count matches, unique device names, every counterSet a
    device consumes published in the pool, and no counter over-consumed by a device."""
    out = []
    if not slices:
        return out
    gens = {s["spec"]["pool"]["generation"] for s in slices}
    counts = {s["spec"]["pool"]["resourceSliceCount"] for s in slices}
    if len(gens) != 1 or counts != {len(slices)}:
        out.append(f"pool incomplete: generations {sorted(gens)}, counts {sorted(counts)}, "
                   f"{len(slices)} slices")
    sets = {cs["name"]: {k: quantity(v["value"]) for k, v in cs["counters"].items()}
            for s in slices for cs in s["spec"].get("sharedCounters") or ()}
    names: list[str] = [d["name"] for s in slices for d in s["spec"].get("devices") or ()]
    if len(names) != len(set(names)):
        out.append("device names repeat across the pool's slices")
    for s in slices:
        for d in s["spec"].get("devices") or ():
            for c in d.get("consumesCounters") or ():
                have = sets.get(c["counterSet"])
                if have is None:
                    out.append(f"{d['name']}: counterSet {c['counterSet']!r} not in the pool")
                    continue
                for k, v in c["counters"].items():
                    if k not in have or quantity(v["value"]) > have[k]:
                        out.append(f"{d['name']}: consumes {k}={v['value']} beyond "
                                   f"{c['counterSet']}")
    return out


# --- the server --------------------------------------------------------------------------
