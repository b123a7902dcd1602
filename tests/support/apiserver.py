"""An API-server double on loopback that the official `kubernetes` client talks to:
ResourceSlices (list with field selectors, create, replace, delete) and
ResourceClaims (read), resource.k8s.io/v1, as plain HTTP in a thread of the test.

Every ResourceSlice written is checked as a 1.36 API server would refuse it (422
Invalid, with the reasons in the Status message, like the real one): the schema of
Kubernetes 1.36, strict, and the rules it states in prose (support.slice_checks).
Tests read what was written (`slices`, `writes`) and inject faults: answers of a
status (`fail`), connections closed unanswered (`drop`), answers held back (`stall`).
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

# the checks, also named here for the tests that check slices without a server
from support.slice_checks import field_at, pool_problems, quantity, schema_problems, slice_problems

__all__ = ["GATES", "ApiServer", "Write", "client_for", "kubeconfig", "pool_problems",
           "quantity", "running", "schema_problems", "slice_problems"]

PREFIX = "/apis/resource.k8s.io/v1"
NODES = "/api/v1/nodes"


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
        """tls_dir: serve HTTPS with a certificate for 127.0.0.1 made there (tls.crt: what
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
        self._faults: list[tuple[str, int, str]] = []  # (kind, its number, a path it needs)
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
            self._faults += [("fail", status, "")] * n

    def drop(self, n: int) -> None:
        """The next n requests get their connection closed, unanswered."""
        with self.lock:
            self._faults += [("drop", 0, "")] * n

    def stall(self, n: int) -> None:
        """The next n requests wait for `release` (or 30 s) before they are served."""
        with self.lock:
            self._faults += [("stall", 0, "")] * n

    def trickle(self, n: int, pause: float = 0.05, path: str = "") -> None:
        """The next n requests (whose path has `path` in it: the plugin's own background
        calls, its slices', go by) get a 200 whose body comes one byte per `pause` s and
        never ends (the JSON, then spaces), until the client goes or `release` is set."""
        with self.lock:
            self._faults += [("trickle", int(pause * 1000), path)] * n

    def answer_raw(self, n: int, body: bytes) -> None:
        """The next n requests are answered 200 with `body` as it is."""
        with self.lock:
            self._faults += [("raw", len(self._raw), "")] * n
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

    def _take_fault(self, path: str) -> tuple[str, int] | None:
        """The first fault armed for a request to `path`, taken."""
        with self.lock:
            for i, (kind, arg, needs) in enumerate(self._faults):
                if needs in path:
                    del self._faults[i]
                    return kind, arg
            return None


def _serve_tls(httpd: http.server.HTTPServer, tls_dir: Path) -> Path:
    """A self-signed certificate for 127.0.0.1 (openssl), the server's socket wrapped
    with it (each connection's handshake in its own handler thread); its path."""
    import ssl

    from support.tls import make_cert

    cert, key = make_cert(tls_dir)
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
        fault = api._take_fault(self.path)
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
    return field_at(obj, tuple(path.split(".")))
