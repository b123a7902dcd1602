"""`nvctk monitor`: a snapshot every interval in a background thread, served over HTTP.

    /metrics        Prometheus text format (the latest snapshot); OpenMetrics 1.0 when the
                    Accept header prefers it, gzip'd when Accept-Encoding allows it
    /api/snapshot   the latest snapshot as JSON (the dashboard's source)
    /               the dashboard: plain HTML and JavaScript from this package, no CDN
    /healthz        200 while snapshots keep coming; 503 before the first and once the
                    latest is older than `stale_after` (collection stalled: the liveness
                    probe restarts the monitor)

A scrape serves the snapshot the collector last took; it never waits on a collection,
so nothing the collector reads (a slow /proc, a hanging file) can block a scrape. The
collector renders each new snapshot in the formats scraped since the one before, and
shows it then, so a scrape only sends; the first scrape in a new format renders it.

The HTTP side is one asyncio loop, not a thread per connection: any Pod can reach the
port, and an idle connection must cost a few kilobytes, not a thread. Every connection
has a deadline for its request head (and body), one for writing the answer, and an idle
limit between keep-alive requests. At most `max_connections` are open; a new one beyond
that makes room by closing the connection that has waited on its own client the longest,
idle ones first, then those still sending a request, then those not taking their answer
(every connection is one of these whenever another runs), so no number of idle,
half-sent or unread connections shuts out a client that sends its request whole. An
answer is closed after its last byte has gone (never cut short by the close). Nothing a
client sends reaches the log as a traceback; a stop closes every connection and returns.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import resource
import socket
import threading
import time
from importlib import resources

from prometheus_client import CONTENT_TYPE_LATEST

from nvctk.base.errors import NvctkError, literal
from nvctk.monitor.collect import Collector, run_every
from nvctk.monitor.exposition import CONTENT_TYPE_OPENMETRICS
from nvctk.monitor.model import Snapshot
from nvctk.monitor.prom import Exposition
from nvctk.monitor.webconfig import WebConfig

log = logging.getLogger("nvctk.monitor")

HEAD_TIMEOUT = 10.0  # seconds for a request's head (and its body), from its first byte on
IDLE_TIMEOUT = 30.0  # seconds a keep-alive connection may wait for its next request
WRITE_TIMEOUT = 30.0  # seconds for a client to take an answer
MAX_HEAD = 16 << 10  # bytes of request line and headers
MAX_BODY = 64 << 10  # bytes of a request body (none is needed; one is read and dropped)
MAX_CONNECTIONS = 256
# what a connection is waiting on its client for, in the order a full server closes them
IDLE, READING, WRITING = 0, 1, 2


class Monitor:
    def __init__(self, collector: Collector, interval: float,
                 stale_after: float | None = None, compat: tuple[str, ...] = ()) -> None:
        self.collector = collector
        self.interval = interval
        # a collection may take a while on a loaded node: stalled is several intervals late
        self.stale_after = stale_after if stale_after is not None else 3 * interval + 10
        self.latest: Snapshot | None = None
        self.stop = threading.Event()
        self.taken = threading.Condition()
        self.exposition = Exposition(compat, collector.host)
        self._json: tuple[Snapshot | None, bytes] = (None, b"null")
        self._asked: set[tuple[bool, bool]] = set()  # (openmetrics, gzip) scraped since the last snapshot
        self.thread: threading.Thread | None = None

    def _take(self) -> None:
        snap = self.collector.collect()
        # the formats scraped since the last snapshot, rendered for this one before it is
        # shown: scrapes meanwhile get the previous one, and none waits on a render (no
        # scraper, nothing rendered)
        asked, self._asked = self._asked, set()
        for om, gz in asked:
            self.exposition.body(snap, time.time(), dict(self.collector.errors_total), om, gz)
        with self.taken:
            self.latest = snap
            self.taken.notify_all()

    def start(self) -> None:
        self.thread = run_every(self.interval, self._take, self.stop)

    def wait_first(self, timeout: float) -> bool:
        with self.taken:
            return self.taken.wait_for(lambda: self.latest is not None, timeout)

    def metrics(self, openmetrics: bool = False, gzipped: bool = False) -> bytes:
        self._asked.add((openmetrics, gzipped))
        return self.exposition.body(self.latest, time.time(), dict(self.collector.errors_total),
                                    openmetrics, gzipped)

    def snapshot_json(self) -> bytes:
        snap = self.latest
        cached, body = self._json
        if snap is not None and snap is not cached:  # once per snapshot, as /metrics
            body = json.dumps(snap.to_dict()).encode()
            self._json = (snap, body)
        return body

    def health(self) -> tuple[bool, str]:
        snap = self.latest
        if snap is None:
            return False, "no snapshot yet"
        age = time.time() - snap.time
        if age > self.stale_after:
            return False, f"collection stalled: the latest snapshot is {age:.0f} s old"
        return True, "ok"


def bound_heap() -> None:
    """glibc's malloc, told to give the monitor's large short-lived buffers back: a
    snapshot's text is megabytes, made and dropped every interval. By default glibc raises
    its mmap threshold to the largest block freed, so every later text lands on the heap,
    which fragments and never shrinks (84 MiB at 1024 containers), and keeps an arena per
    thread. A fixed threshold and two arenas; nothing where the libc is not glibc. Call it
    before any thread starts."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, 256 << 10)
    mallopt(M_ARENA_MAX, 2)


M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's <malloc.h>


def dashboard_html() -> bytes:
    return resources.files("nvctk.monitor").joinpath("dashboard.html").read_bytes()


_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
            408: "Request Timeout", 413: "Content Too Large", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 501: "Not Implemented", 503: "Service Unavailable"}


def bind(host: str, port: int) -> socket.socket:
    """The listening socket for host:port (a name, an IPv4 or an IPv6 address);
    NvctkError naming --listen for anything the system refuses."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if not 0 <= port <= 65535:
        raise NvctkError(f"--listen {where}: port {port} out of range (0-65535)")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as e:
        raise NvctkError(f"--listen {where}: not an address, nor a name this host resolves ({e})") from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise NvctkError(f"--listen {where}: cannot listen there ({e.strerror})") from None
    sock.setblocking(False)
    return sock


class MonitorServer:
    """The HTTP side of `nvctk monitor`, on one asyncio loop in the thread that calls
    serve_forever(). stop() may be called from a signal handler or another thread."""

    def __init__(self, monitor: Monitor, sock: socket.socket,
                 max_connections: int = MAX_CONNECTIONS, web: WebConfig | None = None) -> None:
        self.monitor = monitor
        self.web = web or WebConfig()
        self.sock = sock
        self.server_address = sock.getsockname()
        self.page = dashboard_html()
        # descriptors: the connections must never starve the collector of its own
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.max_connections = max(8, min(max_connections, soft - 64))
        self.loop = asyncio.new_event_loop()
        self.loop.set_exception_handler(self._loop_error)
        self._stopping: asyncio.Event | None = None
        self._stop_requested = False
        # every open connection while it waits on its client -> (IDLE/READING/WRITING, since)
        self._waiting: dict[asyncio.StreamWriter, tuple[int, float]] = {}
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._done = threading.Event()

    # --- life ---------------------------------------------------------------------------
    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Serves until stop(); closes every connection before it returns."""
        try:
            self.loop.run_until_complete(self._serve())
        finally:
            self._done.set()

    def stop(self) -> None:
        self._stop_requested = True
        if self._stopping is not None and not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self._stopping.set)
            except RuntimeError:  # the loop closed meanwhile
                pass

    def shutdown(self) -> None:
        """stop() and wait for serve_forever to return (from another thread)."""
        self.stop()
        self._done.wait()

    def server_close(self) -> None:
        if not self.loop.is_closed():
            self.loop.close()
        self.sock.close()

    async def _serve(self) -> None:
        self._stopping = asyncio.Event()
        if self._stop_requested:
            return
        self._auth_lock = asyncio.Lock()  # one bcrypt check at a time: a guessing flood is serial
        server = await asyncio.start_server(self._client, sock=self.sock, limit=MAX_HEAD, ssl=self.web.tls,
                                            ssl_handshake_timeout=HEAD_TIMEOUT if self.web.tls else None)
        tasks = self._tasks
        try:
            await self._stopping.wait()
        finally:
            server.close()
            for w in list(self._open):
                w.transport.abort()
            pending = [t for t in tasks if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)

    def _loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, object]) -> None:
        # one line, never a traceback: e.g. accept() out of descriptors (asyncio retries)
        exc = context.get("exception")
        log.warning("http: %s%s", context.get("message", "error"), f" ({exc})" if exc else "")

    # --- one connection -----------------------------------------------------------------
    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if len(self._open) >= self.max_connections:
            self._evict()
        self._open.add(writer)
        try:
            fresh = True
            while await self._one_request(reader, writer, fresh):
                fresh = False
            # the answer's last bytes are still in the transport's buffer: a graceful close
            # sends them first (abort would drop them: a Connection: close client got a
            # truncated body)
            self._waiting[writer] = (WRITING, time.monotonic())
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), WRITE_TIMEOUT)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                ValueError):
            pass  # the client went, stalled or sent nonsense: its connection ends
        finally:
            self._open.discard(writer)
            self._waiting.pop(writer, None)
            writer.transport.abort()

    def _evict(self) -> None:
        """Closes the connection waiting on its client the longest, idle ones first."""
        if not self._waiting:
            return  # every other one is being answered this instant: none can be
        oldest = min(self._waiting, key=self._waiting.__getitem__)
        del self._waiting[oldest]
        self._open.discard(oldest)
        oldest.transport.abort()

    async def _one_request(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                           fresh: bool) -> bool:
        """Reads and answers one request (the connection's first when fresh); whether the
        connection stays open for another."""
        head = await self._read_head(reader, writer, fresh)
        if head is None:
            return False
        request = parse_head(head)
        if isinstance(request, bytes):
            await self._answer(writer, 400, "text/plain", request, False)
            return False
        method, target, version, headers = request
        keep = (version == "HTTP/1.1" and headers.get("connection", "").lower() != "close")
        refusal = body_refusal(headers)
        if refusal is not None:
            await self._answer(writer, refusal[0], "text/plain", refusal[1], False)
            return False
        length = int(headers.get("content-length", "0"))
        if length:
            await asyncio.wait_for(reader.readexactly(length), HEAD_TIMEOUT)
        self._waiting.pop(writer, None)  # being answered: no await until the answer is written
        extra: dict[str, str] = {}
        if target.split("?", 1)[0] != "/healthz" and not await self._authorized(headers):
            # /healthz stays open: the kubelet's probes carry no credentials, and it tells
            # only whether snapshots come
            extra["WWW-Authenticate"] = 'Basic realm="nvctk monitor"'
            await self._answer(writer, 401, "text/plain", b"unauthorized\n", keep, extra=extra)
            return keep
        try:
            code, ctype, body = self._route(method, target, headers, extra)
        except Exception as e:  # a bug of the monitor's: one line, the connection goes on
            log.warning("http: %s %s failed: %s", literal(method), literal(target[:200]), e)
            code, ctype, body = 500, "text/plain", b"internal error\n"
        await self._answer(writer, code, ctype, body, keep, head_only=method == "HEAD", extra=extra)
        log.debug("%s %s %s", literal(method), literal(target[:200]), code)
        return keep

    async def _read_head(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         fresh: bool) -> bytes | None:
        """A request's head, through its blank line; None when the connection is to close
        (nothing came, or it was too large or slow: answered so where it had begun)."""
        # a new connection is a request under way (its head may be in the socket, unread: it
        # is no idle one to close first) and has the head's deadline; a kept-alive one is idle
        # until its next request's first byte, within the idle limit
        self._waiting[writer] = (READING if fresh else IDLE, time.monotonic())
        head_begun = False
        try:
            first = await asyncio.wait_for(reader.read(1), HEAD_TIMEOUT if fresh else IDLE_TIMEOUT)
            if not first:
                return None
            head_begun = True
            if not fresh:
                self._waiting[writer] = (READING, time.monotonic())
            return first + await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT)
        except asyncio.LimitOverrunError:
            await self._answer(writer, 431, "text/plain", b"request head too large\n", False)
            return None
        except asyncio.IncompleteReadError:
            return None
        except TimeoutError:
            if head_begun:  # else idle past the limit, or nothing sent: closed without a word
                await self._answer(writer, 408, "text/plain", b"request head too slow\n", False)
            return None

    async def _authorized(self, headers: dict[str, str]) -> bool:
        header = headers.get("authorization", "")
        seen = self.web.known(header)
        if seen is not None:
            return seen
        async with self._auth_lock:  # a bcrypt check (~0.1 s) off the loop
            return await asyncio.get_running_loop().run_in_executor(None, self.web.authorized, header)

    def _route(self, method: str, target: str, headers: dict[str, str],
               extra: dict[str, str]) -> tuple[int, str, bytes]:
        """The answer to a request; extra gets the answer's own headers."""
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"GET or HEAD only\n"
        path = target.split("?", 1)[0]
        mon = self.monitor
        if path == "/metrics":
            om = prefers_openmetrics(headers.get("accept", ""))
            gz = accepts_gzip(headers.get("accept-encoding", ""))
            extra["Vary"] = "Accept, Accept-Encoding"
            if gz:
                extra["Content-Encoding"] = "gzip"
            return 200, CONTENT_TYPE_OPENMETRICS if om else CONTENT_TYPE_LATEST, mon.metrics(om, gz)
        if path == "/api/snapshot":
            return 200, "application/json", mon.snapshot_json()
        if path in ("/", "/index.html"):
            return 200, "text/html; charset=utf-8", self.page
        if path == "/healthz":
            ok, why = mon.health()
            return (200 if ok else 503), "text/plain", why.encode() + b"\n"
        return 404, "text/plain", b"not found\n"

    async def _answer(self, writer: asyncio.StreamWriter, code: int, ctype: str, body: bytes,
                      keep: bool, head_only: bool = False, extra: dict[str, str] | None = None) -> None:
        more = "".join(f"{k}: {v}\r\n" for k, v in (extra or {}).items())
        head = (f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\nServer: nvctk-monitor\r\n"
                f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n{more}"
                f"Cache-Control: no-store\r\nConnection: {'keep-alive' if keep else 'close'}\r\n\r\n")
        writer.write(head.encode("latin-1") if head_only else head.encode("latin-1") + body)
        self._waiting[writer] = (WRITING, time.monotonic())
        await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT)


def _weights(header: str) -> dict[str, float]:
    """An Accept or Accept-Encoding header: each value (lower case, parameters but q
    dropped) -> its q (1 unless given; the highest where a value repeats)."""
    out: dict[str, float] = {}
    for item in header.split(","):
        value, *params = (p.strip() for p in item.split(";"))
        if not value:
            continue
        q = 1.0
        for p in params:
            k, _, v = p.partition("=")
            if k.strip().lower() == "q":
                try:
                    q = float(v)
                except ValueError:
                    q = 0.0
        out[value.lower()] = max(q, out.get(value.lower(), 0.0))
    return out


def prefers_openmetrics(accept: str) -> bool:
    """OpenMetrics when the client asks for it at least as much as for the text format
    (Prometheus asks for it first unless told otherwise)."""
    w = _weights(accept)
    om = w.get("application/openmetrics-text", 0.0)
    return om > 0 and om >= max(w.get("text/plain", 0.0), w.get("*/*", 0.0))


def accepts_gzip(accept_encoding: str) -> bool:
    w = _weights(accept_encoding)
    return max(w.get("gzip", 0.0), w.get("x-gzip", 0.0), w.get("*", 0.0)) > 0


def make_server(monitor: Monitor, host: str, port: int, web: WebConfig | None = None) -> MonitorServer:
    return MonitorServer(monitor, bind(host, port), web=web)


def parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]] | bytes:
    """(method, target, version, headers by lower-case name) of a request head, or the
    400 answer's text for a bad request line or header."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return b"bad request line\n"
    method, target, version = parts
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                return b"bad header\n"
            headers[name.strip().lower()] = value.strip()
    return method, target, version, headers


def body_refusal(headers: dict[str, str]) -> tuple[int, bytes] | None:
    """The answer to a request whose body the monitor does not take (chunked, or past
    MAX_BODY); None for one it reads (a Content-Length within it)."""
    if "transfer-encoding" in headers:
        return 501, b"no request bodies\n"
    length = headers.get("content-length", "0")
    if not (length.isascii() and length.isdigit()) or int(length) > MAX_BODY:
        return 413, b"request body too large\n"
    return None


__all__ = ["Monitor", "MonitorServer", "bind", "bound_heap", "dashboard_html", "make_server"]
