"""The API server, as the DRA driver needs it: ResourceClaims read, this node's
ResourceSlices listed, created, updated and deleted (resource.k8s.io/v1), through
the official `kubernetes` client; and this node's labels (`nvctk labels --node-name`).

Only the DRA plugin and `nvctk labels` import this module, and the client only when a Kube is made
(~0.2 s with pydantic and urllib3): never the runtime, the hook or another nvctk
command. Objects go in and out as plain dicts in the API's own JSON form (camelCase),
so the slice builder and the claim reader stay pure data.

Every call retries a down or slow API server (connection refused or reset, a
timeout, 429, 5xx) with exponential back-off, bounded by `Retry.attempts` and
`Retry.deadline`; then it raises ApiUnavailable naming the call and the last error.
Answers that retrying cannot change (404, 403, 409, 422) raise at once.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from nvctk.base.errors import NvctkError

GROUP_VERSION = "resource.k8s.io/v1"
# an answer's body at most (a page of 500 slices fits many times over); more is an error
MAX_ANSWER_BYTES = 64 << 20
# statuses a retry may change: throttled, or the server (or its proxy) failing
RETRIABLE_STATUS = frozenset({429, 500, 502, 503, 504})

class KubeError(NvctkError):
    """The API server refused a call; the message names the call and why."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ApiUnavailable(KubeError):
    """The API server stayed down or slow through every retry."""


class NotFound(KubeError):
    pass


class Conflict(KubeError):
    """409: the object changed (resourceVersion) or already exists."""


@dataclasses.dataclass(frozen=True)
class Retry:
    """Back-off for calls to a down or slow API server: attempt n (from 0) waits
    min(cap, base * 2**n) * jitter(0.5..1) before the next; no attempt starts after
    deadline seconds from the first."""

    attempts: int = 6
    base: float = 0.2
    cap: float = 5.0
    deadline: float = 30.0
    timeout: float = 10.0  # one request's connect and read timeout

    def delays(self) -> Iterator[float]:
        for n in range(self.attempts - 1):
            yield min(self.cap, self.base * 2 ** n) * random.uniform(0.5, 1.0)


def load_client(kubeconfig: str | None = None) -> Any:
    """An ApiClient from kubeconfig, else the in-cluster config (the pod's service
    account). KubeError when neither works."""
    from kubernetes import client, config

    cfg = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=cfg,
                                    persist_config=False)
        else:
            config.load_incluster_config(client_configuration=cfg)
    except Exception as e:  # ConfigException, a missing or unreadable file, bad YAML
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "in-cluster config"
        raise KubeError(f"cannot load the {where}: {e}") from None
    cfg.retries = False  # our Retry decides; urllib3's own would multiply the waits
    return client.ApiClient(cfg)


class Kube:
    """The calls the DRA driver makes, with retry. `api_client` is a
    kubernetes.client.ApiClient (load_client, or one a test points at its double)."""

    def __init__(self, api_client: Any, retry: Retry | None = None,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        from kubernetes import client

        self.api_client = api_client
        self.api = client.ResourceV1Api(api_client)
        self.retry = retry or Retry()
        self._sleep = sleep
        self._clock = clock

    # --- claims -------------------------------------------------------------------

    def get_claim(self, namespace: str, name: str, timeout: float | None = None) -> dict[str, Any]:
        """The ResourceClaim as it is now, in its API JSON form (nvctk.dra.claims reads
        it); NotFound when it is gone; ApiUnavailable when the server cannot say within
        timeout seconds (the kubelet's deadline; default: Retry.deadline)."""
        return self._call(f"reading ResourceClaim {namespace}/{name}",
                          lambda t: self.api.read_namespaced_resource_claim(
                              name, namespace, _preload_content=False, _request_timeout=t),
                          timeout)

    # --- slices -------------------------------------------------------------------

    def list_slices(self, driver: str, node: str) -> list[dict[str, Any]]:
        """This node's ResourceSlices of driver (the field selectors the API server
        indexes for ResourceSlices), all pages."""
        selector = f"spec.nodeName={node},spec.driver={driver}"
        items: list[dict[str, Any]] = []
        token: str | None = None

        def page_after(c: str | None) -> Callable[[Any], Any]:
            return lambda t: self.api.list_resource_slice(
                field_selector=selector, limit=500, _continue=c, _preload_content=False,
                _request_timeout=t)

        while True:
            page = self._call(f"listing ResourceSlices of {driver} on {node}", page_after(token))
            items.extend(page.get("items") or ())
            token = (page.get("metadata") or {}).get("continue")
            if not token:
                return items

    def create_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        body = self._model(obj)
        return self._call(f"creating ResourceSlice {_slice_name(obj)}",
                          lambda t: self.api.create_resource_slice(
                              body, _preload_content=False, _request_timeout=t))

    def update_slice(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Replace obj (its metadata.resourceVersion guards against a concurrent
        writer: Conflict then)."""
        body = self._model(obj)
        name = obj["metadata"]["name"]
        return self._call(f"updating ResourceSlice {name}",
                          lambda t: self.api.replace_resource_slice(
                              name, body, _preload_content=False, _request_timeout=t))

    def delete_slice(self, name: str) -> None:
        """Delete; a slice already gone is no error."""
        try:
            self._call(f"deleting ResourceSlice {name}",
                       lambda t: self.api.delete_resource_slice(
                           name, _preload_content=False, _request_timeout=t))
        except NotFound:
            pass

    # --- nodes --------------------------------------------------------------------

    def get_node(self, name: str) -> dict[str, Any]:
        from kubernetes import client

        core = client.CoreV1Api(self.api_client)
        return self._call(f"reading Node {name}", lambda t: core.read_node(
            name, _preload_content=False, _request_timeout=t))

    def patch_node_metadata(self, name: str, labels: dict[str, str | None],
                            annotations: dict[str, str | None]) -> dict[str, Any]:
        """A merge patch of the node's labels and annotations (None removes a key)."""
        from kubernetes import client

        core = client.CoreV1Api(self.api_client)
        body = {"metadata": {"labels": labels, "annotations": annotations}}
        return self._call(f"labelling Node {name}", lambda t: core.patch_node(
            name, body, _preload_content=False, _request_timeout=t))

    # --- the one request path ---------------------------------------------------

    @staticmethod
    def _model(obj: dict[str, Any]) -> Any:
        from kubernetes.client import V1ResourceSlice

        try:
            return V1ResourceSlice.from_dict(obj)
        except Exception as e:  # pydantic's ValidationError: a builder bug, named
            raise KubeError(f"ResourceSlice {_slice_name(obj)} is malformed: {e}") from None

    def _call(self, what: str, fn: Callable[[Any], Any],
              deadline: float | None = None) -> dict[str, Any]:
        """fn(timeout) -> an unread urllib3 response; its JSON body, retried as the
        module docstring says, within deadline seconds (default Retry.deadline)."""
        import urllib3
        from kubernetes.client.exceptions import ApiException

        r = self.retry
        deadline = r.deadline if deadline is None else min(deadline, r.deadline)
        start = self._clock()
        delays = r.delays()
        while True:
            try:
                left = max(0.001, deadline - (self._clock() - start))
                resp = fn((min(r.timeout, left), min(r.timeout, left)))
                return _json_body(_read_body(
                    resp, what, max(0.001, deadline - (self._clock() - start))), what)
            except ApiException as e:
                status = e.status or 0
                if status not in RETRIABLE_STATUS:
                    raise _status_error(what, status, e.body) from None
                last = f"HTTP {status} {_reason(e.body) or e.reason or ''}".strip()
            except (urllib3.exceptions.HTTPError, OSError) as e:
                last = _net_reason(e)
            delay = next(delays, None)
            if delay is None or self._clock() - start + delay > deadline:
                raise ApiUnavailable(f"{what}: the API server did not answer after "
                                     f"{self._clock() - start:.1f}s: {last}")
            self._sleep(delay)


def _slice_name(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return str(meta.get("name") or meta.get("generateName") or "(unnamed)")


class _Watchdog:
    """One thread for every call's deadline (a thread per call, woken by its cancel,
    measured ~4 ms a call in GIL hand-overs): it sleeps until the earliest deadline and
    runs that call's `stop` if the call is still reading. A call disarms its entry when
    done; the thread wakes only when the earliest deadline comes."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._heap: list[list[Any]] = []  # [at, seq, stop or None (disarmed)]
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, left: float, stop: Callable[[], None]) -> list[Any]:
        entry = [time.monotonic() + left, next(self._seq), stop]
        with self._cv:
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="nvctk-kube-deadlines",
                                                daemon=True)
                self._thread.start()
            elif self._heap[0] is entry:
                self._cv.notify()  # a sooner deadline than the thread sleeps until
        return entry

    def disarm(self, entry: list[Any]) -> None:
        with self._cv:
            entry[2] = None

    def _run(self) -> None:
        while True:
            due: list[Callable[[], None]] = []
            with self._cv:
                now = time.monotonic()
                while self._heap and (self._heap[0][2] is None or self._heap[0][0] <= now):
                    stop = heapq.heappop(self._heap)[2]
                    if stop is not None:
                        due.append(stop)
                if not due:
                    self._cv.wait(self._heap[0][0] - now if self._heap else None)
            for stop in due:
                stop()


_DEADLINES = _Watchdog()


def _read_body(resp: Any, what: str, left: float) -> bytes:
    """The answer's body (resp: an unread urllib3 response), read within `left` seconds in
    all: at the deadline the socket is shut (_Watchdog), so a body that trickles or never
    ends (the read timeout is per read) is cut off there; ApiUnavailable then, KubeError
    for more than MAX_ANSWER_BYTES."""
    cut = threading.Event()

    def stop() -> None:
        cut.set()
        try:
            resp.shutdown()  # wakes a read blocked in recv
        except (ValueError, RuntimeError, OSError):  # already done with the socket
            pass

    entry = _DEADLINES.arm(left, stop)
    chunks: list[bytes] = []
    total = 0
    try:
        while True:
            try:
                chunk = resp.read1(65536)
            except Exception:
                if cut.is_set():
                    break
                raise  # urllib3's own errors: the caller's retry decides
            if not chunk or cut.is_set():
                break
            total += len(chunk)
            if total > MAX_ANSWER_BYTES:
                raise KubeError(f"{what}: the API server's answer is larger than "
                                f"{MAX_ANSWER_BYTES >> 20} MiB")
            chunks.append(chunk)
    finally:
        _DEADLINES.disarm(entry)
        resp.release_conn() if not cut.is_set() else resp.close()
    if cut.is_set():
        raise ApiUnavailable(f"{what}: the API server's answer did not end within "
                             f"{left:.1f}s ({total} bytes of it came)")
    return b"".join(chunks)


def _json_body(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError:
        raise KubeError(f"{what}: the API server's answer is not JSON") from None
    except RecursionError:  # json's C parser recurses once per level
        raise KubeError(f"{what}: the API server's answer is nested too deeply") from None
    if not isinstance(obj, dict):
        raise KubeError(f"{what}: the API server's answer is not an object")
    return obj


def _reason(body: Any) -> str:
    """A Status object's message (what the API server says went wrong)."""
    try:
        return str(json.loads(body).get("message") or "")
    except (ValueError, TypeError, AttributeError):
        return ""


def _status_error(what: str, status: int, body: Any) -> KubeError:
    msg = f"{what}: HTTP {status}"
    if reason := _reason(body):
        msg += f": {reason}"
    if status == 404:
        return NotFound(msg, status)
    if status == 409:
        return Conflict(msg, status)
    return KubeError(msg, status)


def _net_reason(e: BaseException) -> str:
    """urllib3 wraps the socket error (MaxRetryError(reason=...)); name the cause."""
    reason = getattr(e, "reason", None)
    return str(reason or e) or type(e).__name__
