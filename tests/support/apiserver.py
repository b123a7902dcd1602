"""An API-server double on loopback that the official `kubernetes` client talks to:
ResourceSlices (list with field selectors, create, replace, delete) and
ResourceClaims (read), resource.k8s.io/v1, as plain HTTP in a thread of the test.

Every ResourceSlice written is checked as a 1.36 API server would refuse it (422
Invalid, with the reasons in the Status message, like the real one):
- against the resource.k8s.io/v1 JSON schema of Kubernetes 1.36, strict (no unknown
  field), as the `kubernetes-validate` package ships it (v1.36.0-local-strict);
- against the rules the schema only states in prose (its field descriptions, quoted
  beside each check in `slice_problems`): device limits, DNS labels, qualified names,
  exactly one node selection, devices xor sharedCounters, request policies,
  immutable fields on update.
Tests read what was written (`slices`, `writes`) and inject faults: answers of a
status (`fail`), connections closed unanswered (`drop`), answers held back (`stall`).
"""

from __future__ import annotations

import dataclasses
import functools
import http.server
import json
import re
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jsonschema
import referencing
from kubernetes_validate import utils as kv

from nvctk.dra.claims import parse_quantity as quantity  # the driver's one parser

K8S_VERSION = "1.36.0"
PREFIX = "/apis/resource.k8s.io/v1"
NODES = "/api/v1/nodes"

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
    devices = spec.get("devices") or []
    counter_sets = spec.get("sharedCounters") or []
    # "Only one of Devices and SharedCounters can be set in a ResourceSlice."
    if devices and counter_sets:
        out.append("spec: only one of devices and sharedCounters can be set")
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
            a, b = _get(old["spec"], path), _get(spec, path)
            if a != b:
                out.append(f"spec.{'.'.join(path)}: field is immutable ({a!r} -> {b!r})")
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


def _get(d: dict[str, Any], path: tuple[str, ...]) -> Any:
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


@dataclasses.dataclass
class Write:
    verb: str  # create, update, delete
    name: str
    accepted: bool
    problems: list[str]


# what an API server whose feature gate is off drops from a ResourceSlice it stores
# (1.34 and 1.35: all three alpha, off by default; 1.36: beta, on)
GATES = ("DRAConsumableCapacity", "DRAPartitionableDevices", "DRADeviceTaints")


def drop_disabled(obj: dict[str, Any], disabled: frozenset[str]) -> None:
    """Strip the fields of the disabled gates from a ResourceSlice, in place."""
    spec = obj.get("spec") or {}
    if "DRAPartitionableDevices" in disabled:
        spec.pop("sharedCounters", None)
    for d in spec.get("devices") or ():
        if "DRAConsumableCapacity" in disabled:
            d.pop("allowMultipleAllocations", None)
            for c in (d.get("capacity") or {}).values():
                c.pop("requestPolicy", None)
        if "DRAPartitionableDevices" in disabled:
            d.pop("consumesCounters", None)
        if "DRADeviceTaints" in disabled:
            d.pop("taints", None)


class ApiServer:
    """The double's state; `url` is what a kubernetes Configuration's host points at.
    disabled: feature gates (GATES) off, as on a 1.34 server."""

    def __init__(self, disabled: frozenset[str] = frozenset(), tls_dir: Path | None = None
                 ) -> None:
        """tls_dir: serve HTTPS with a certificate for 127.0.0.1 made there (ca.crt: what
        a Pod's in-cluster config trusts)."""
        self.disabled = disabled
        self.lock = threading.Lock()
        self.slices: dict[str, dict[str, Any]] = {}
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        # core/v1 Nodes by name (`nvctk labels --node-name` reads and patches its own)
        self.nodes: dict[str, dict[str, Any]] = {}
        self.writes: list[Write] = []
        self.requests: list[tuple[str, str]] = []  # (method, path with query)
        self._version = 0
        # ("fail", status) | ("drop", 0) | ("stall", 0) | ("trickle", ms) | ("raw", index)
        self._faults: list[tuple[str, int]] = []
        self._raw: list[bytes] = []  # the bodies of "raw" faults
        self.trickling = threading.Semaphore(0)  # one release per request that trickles
        self.release = threading.Event()  # lets stalled requests go
        self.stalled = threading.Semaphore(0)  # one release per request that stalls
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.api = self  # type: ignore[attr-defined]
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.ca_file: Path | None = None
        if tls_dir is not None:
            self.ca_file = _serve_tls(self.httpd, tls_dir)
            self.url = f"https://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,),
                                        daemon=True, name="apiserver-double")

    # test-side API
    def start(self) -> ApiServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join()

    def fail(self, n: int, status: int = 503) -> None:
        """The next n requests are answered with status (a Status object)."""
        with self.lock:
            self._faults += [("fail", status)] * n

    def drop(self, n: int) -> None:
        """The next n requests get their connection closed, unanswered."""
        with self.lock:
            self._faults += [("drop", 0)] * n

    def stall(self, n: int) -> None:
        """The next n requests wait for `release` (or 30 s) before they are served."""
        with self.lock:
            self._faults += [("stall", 0)] * n

    def trickle(self, n: int, pause: float = 0.05) -> None:
        """The next n requests get a 200 whose body comes one byte per `pause` s and never
        ends (the JSON, then spaces), until the client goes or `release` is set."""
        with self.lock:
            self._faults += [("trickle", int(pause * 1000))] * n

    def answer_raw(self, n: int, body: bytes) -> None:
        """The next n requests are answered 200 with `body` as it is."""
        with self.lock:
            self._faults += [("raw", len(self._raw))] * n
            self._raw.append(body)

    def add_claim(self, obj: dict[str, Any]) -> dict[str, Any]:
        obj = json.loads(json.dumps(obj))
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        with self.lock:
            meta["resourceVersion"] = self._next_version()
            self.claims[(meta["namespace"], meta["name"])] = obj
        return obj

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> None:
        with self.lock:
            self.nodes[name] = {"apiVersion": "v1", "kind": "Node", "metadata": {
                "name": name, "labels": dict(labels or {}), "annotations": {},
                "uid": str(uuid.uuid4()), "resourceVersion": self._next_version()}}

    def node_labels(self, name: str) -> dict[str, str]:
        with self.lock:
            return dict(self.nodes[name]["metadata"].get("labels") or {})

    def remove_claim(self, namespace: str, name: str) -> None:
        with self.lock:
            self.claims.pop((namespace, name), None)

    def pool(self, driver: str, node: str) -> list[dict[str, Any]]:
        """The stored slices of driver on node, by name."""
        with self.lock:
            return [s for _, s in sorted(self.slices.items())
                    if s["spec"]["driver"] == driver and s["spec"].get("nodeName") == node]

    def rejected(self) -> list[Write]:
        with self.lock:
            return [w for w in self.writes if not w.accepted]

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def _take_fault(self) -> tuple[str, int] | None:
        with self.lock:
            return self._faults.pop(0) if self._faults else None


def _serve_tls(httpd: http.server.HTTPServer, tls_dir: Path) -> Path:
    """A self-signed certificate for 127.0.0.1 (openssl), the server's socket wrapped
    with it (each connection's handshake in its own handler thread); its path."""
    import ssl
    import subprocess

    tls_dir.mkdir(parents=True, exist_ok=True)
    cert, key = tls_dir / "ca.crt", tls_dir / "tls.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True,
                                   do_handshake_on_connect=False)
    return cert


@contextmanager
def running(disabled: frozenset[str] = frozenset(), tls_dir: Path | None = None
            ) -> Iterator[ApiServer]:
    api = ApiServer(disabled, tls_dir).start()
    try:
        yield api
    finally:
        api.stop()


def kubeconfig(path: Path, url: str) -> str:
    """Write a kubeconfig at path naming the double at url (a token it ignores); its path."""
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "{url}"}}}}]
users: [{{name: u, user: {{token: t}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
""")
    return str(path)


def client_for(api: ApiServer) -> Any:
    """A kubernetes ApiClient aimed at the double (as load_client would make one)."""
    from kubernetes import client

    cfg = client.Configuration(host=api.url)
    cfg.retries = False
    return client.ApiClient(cfg)


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: pytest keeps output
        pass

    @property
    def api(self) -> ApiServer:
        return self.server.api  # type: ignore[attr-defined]

    def _send(self, code: int, obj: dict[str, Any]) -> None:
        self._send_bytes(code, json.dumps(obj).encode())

    def _send_bytes(self, code: int, body: bytes) -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (stall)
            self.close_connection = True

    def _trickle(self, pause: float) -> None:
        """A body that never ends: a claim's JSON, then spaces, a byte at a time."""
        api = self.api
        body = json.dumps({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                           "metadata": {"name": "slow"}}).encode()
        self.close_connection = True
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(1 << 30))
            self.end_headers()
            self.wfile.flush()
            api.trickling.release()
            i = 0
            while not api.release.wait(pause):
                self.wfile.write(body[i:i + 1] if i < len(body) else b" ")
                self.wfile.flush()
                i += 1
        except OSError:  # the client gave up: what a bounded reader does
            pass

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n) or b"null")

    def _serve(self, method: str) -> None:
        api = self.api
        with api.lock:
            api.requests.append((method, self.path))
        fault = api._take_fault()
        if fault and fault[0] == "drop":
            self._body() if method in ("POST", "PUT") else None
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if fault and fault[0] == "stall":
            api.stalled.release()
            api.release.wait(30)
        if fault and fault[0] == "raw":
            self._send_bytes(200, api._raw[fault[1]])
            return
        if fault and fault[0] == "trickle":
            self._trickle(fault[1] / 1000)
            return
        if fault and fault[0] == "fail":
            if method in ("POST", "PUT"):
                self._body()
            self._send(fault[1], status(fault[1], "ServiceUnavailable", "injected failure"))
            return
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        parts = url.path.removeprefix(PREFIX).strip("/").split("/")
        if url.path.startswith(NODES + "/"):
            self._node(method, url.path.removeprefix(NODES + "/"))
        elif not url.path.startswith(PREFIX + "/"):
            self._send(404, status(404, "NotFound", f"no route {url.path}"))
        elif parts[0] == "resourceslices":
            self._slices(method, parts[1] if len(parts) > 1 else None, query)
        elif parts[0] == "namespaces" and len(parts) == 4 and parts[2] == "resourceclaims" \
                and method == "GET":
            self._claim(parts[1], parts[3])
        else:
            self._send(404, status(404, "NotFound", f"no route {method} {url.path}"))

    def do_GET(self) -> None:
        self._serve("GET")

    def do_POST(self) -> None:
        self._serve("POST")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def do_DELETE(self) -> None:
        self._serve("DELETE")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def _node(self, method: str, name: str) -> None:
        """GET, and a merge patch of metadata.labels/annotations only (a null removes the
        key), as the real server applies a strategic merge patch to those maps."""
        api = self.api
        patch = self._body() if method == "PATCH" else None
        kind = self.headers.get("Content-Type", "")
        with api.lock:
            node = api.nodes.get(name)
            if node is None:
                self._send(404, status(404, "NotFound", f'nodes "{name}" not found'))
                return
            if method == "PATCH":
                if kind not in ("application/merge-patch+json",
                                "application/strategic-merge-patch+json") \
                        or not isinstance(patch, dict) or set(patch) - {"metadata"} \
                        or set(patch.get("metadata") or {}) - {"labels", "annotations"}:
                    self._send(422, status(422, "Invalid", f"unexpected patch {kind} {patch}"))
                    return
                for key, changes in (patch.get("metadata") or {}).items():
                    have = node["metadata"].setdefault(key, {})
                    for k, v in (changes or {}).items():
                        if v is None:
                            have.pop(k, None)
                        else:
                            have[k] = v
                node["metadata"]["resourceVersion"] = api._next_version()
            elif method != "GET":
                self._send(405, status(405, "MethodNotAllowed", method))
                return
            body = json.loads(json.dumps(node))
        self._send(200, body)

    def _claim(self, ns: str, name: str) -> None:
        with self.api.lock:
            obj = self.api.claims.get((ns, name))
        if obj is None:
            self._send(404, status(404, "NotFound",
                                   f'resourceclaims.resource.k8s.io "{name}" not found'))
        else:
            self._send(200, obj)

    def _slices(self, method: str, name: str | None, query: dict[str, str]) -> None:
        api = self.api
        if method == "GET" and name is None:
            want = dict(t.split("=", 1) for t in query.get("fieldSelector", "").split(",") if t)
            bad = set(want) - {"spec.nodeName", "spec.driver", "metadata.name"}
            if bad:
                self._send(400, status(400, "BadRequest", f"field label not supported: {bad}"))
                return
            with api.lock:
                items = [s for _, s in sorted(api.slices.items())
                         if all(_field(s, k) == v for k, v in want.items())]
                rv = str(api._version)
            self._send(200, {"kind": "ResourceSliceList", "apiVersion": "resource.k8s.io/v1",
                             "metadata": {"resourceVersion": rv}, "items": items})
            return
        if method == "GET":
            with api.lock:
                obj = api.slices.get(name or "")
            if obj is None:
                self._send(404, status(404, "NotFound", f"resourceslice {name!r} not found"))
            else:
                self._send(200, obj)
            return
        if method == "DELETE":
            with api.lock:
                obj = api.slices.pop(name or "", None)
                api.writes.append(Write("delete", name or "", obj is not None, []))
            if obj is None:
                self._send(404, status(404, "NotFound", f"resourceslice {name!r} not found"))
            else:
                self._send(200, status(200, "", "deleted") | {"status": "Success"})
            return
        obj = self._body()
        if method == "POST" and name is None:
            self._write("create", obj)
        elif method == "PUT" and name is not None:
            if (obj.get("metadata") or {}).get("name") != name:
                self._send(400, status(400, "BadRequest", "the name in the body and URL differ"))
                return
            self._write("update", obj)
        else:
            self._send(405, status(405, "MethodNotAllowed", method))

    def _write(self, verb: str, obj: Any) -> None:
        api = self.api
        meta = obj.setdefault("metadata", {}) if isinstance(obj, dict) else {}
        if verb == "create" and not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name", "")
        with api.lock:
            old = api.slices.get(name)
            if verb == "create" and old is not None:
                api.writes.append(Write(verb, name, False, ["exists"]))
                self._send(409, status(409, "AlreadyExists", f"resourceslice {name!r} exists"))
                return
            if verb == "update" and old is None:
                api.writes.append(Write(verb, name, False, ["not found"]))
                self._send(404, status(404, "NotFound", f"resourceslice {name!r} not found"))
                return
            if verb == "update" and meta.get("resourceVersion") not in (
                    None, "", old["metadata"]["resourceVersion"]):  # type: ignore[index]
                api.writes.append(Write(verb, name, False, ["conflict"]))
                self._send(409, status(409, "Conflict", f"resourceslice {name!r} changed: "
                                       "the object has been modified"))
                return
        if isinstance(obj, dict):  # as the real one: a disabled feature's fields go first
            drop_disabled(obj, api.disabled)
        problems = slice_problems(obj, old) if isinstance(obj, dict) else ["not an object"]
        if problems:
            with api.lock:
                api.writes.append(Write(verb, name, False, problems))
            self._send(422, status(422, "Invalid", f"ResourceSlice {name!r} is invalid: "
                                   + "; ".join(problems)))
            return
        for d in obj["spec"].get("devices") or ():
            for t in d.get("taints") or ():
                t.setdefault("timeAdded", "2026-01-01T00:00:00Z")  # "Added automatically"
        with api.lock:
            meta["resourceVersion"] = api._next_version()
            meta["uid"] = old["metadata"]["uid"] if old else str(uuid.uuid4())
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            api.slices[name] = obj
            api.writes.append(Write(verb, name, True, []))
        self._send(201 if verb == "create" else 200, obj)


def _field(obj: dict[str, Any], path: str) -> Any:
    return _get(obj, tuple(path.split(".")))
