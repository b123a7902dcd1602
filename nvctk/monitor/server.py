"""`nvctk monitor`: a snapshot every interval in a background thread, served over HTTP.

    /metrics        Prometheus text format (the latest snapshot)
    /api/snapshot   the latest snapshot as JSON (the dashboard's source)
    /               the dashboard: plain HTML and JavaScript from this package, no CDN

A scrape renders the snapshot the collector last took; it never waits on a collection,
so nothing the collector reads (a slow /proc, a hanging file) can block a scrape.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources

from prometheus_client import CONTENT_TYPE_LATEST

from nvctk.monitor.collect import Collector, run_every
from nvctk.monitor.model import Snapshot
from nvctk.monitor.prom import Exposition

log = logging.getLogger("nvctk.monitor")


class Monitor:
    def __init__(self, collector: Collector, interval: float, compat: tuple[str, ...] = ()) -> None:
        self.collector = collector
        self.interval = interval
        self.latest: Snapshot | None = None
        self.stop = threading.Event()
        self.taken = threading.Condition()
        self.exposition = Exposition(compat, collector.host)
        self._json: tuple[Snapshot | None, bytes] = (None, b"null")
        self.thread: threading.Thread | None = None

    def _take(self) -> None:
        snap = self.collector.collect()
        with self.taken:
            self.latest = snap
            self.taken.notify_all()

    def start(self) -> None:
        self.thread = run_every(self.interval, self._take, self.stop)

    def wait_first(self, timeout: float) -> bool:
        with self.taken:
            return self.taken.wait_for(lambda: self.latest is not None, timeout)

    def metrics(self) -> bytes:
        return self.exposition.body(self.latest, time.time(), dict(self.collector.errors_total))

    def snapshot_json(self) -> bytes:
        snap = self.latest
        cached, body = self._json
        if snap is not None and snap is not cached:  # once per snapshot, as /metrics
            body = json.dumps(snap.to_dict()).encode()
            self._json = (snap, body)
        return body


def dashboard_html() -> bytes:
    return resources.files("nvctk.monitor").joinpath("dashboard.html").read_bytes()


def make_server(monitor: Monitor, host: str, port: int) -> ThreadingHTTPServer:
    page = dashboard_html()

    class Handler(BaseHTTPRequestHandler):
        server_version = "nvctk-monitor"

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, monitor.metrics())
            elif path == "/api/snapshot":
                self._send(200, "application/json", monitor.snapshot_json())
            elif path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", page)
            elif path == "/healthz":
                ok = monitor.latest is not None
                self._send(200 if ok else 503, "text/plain", b"ok\n" if ok else b"no snapshot yet\n")
            else:
                self._send(404, "text/plain", b"not found\n")

        def log_message(self, format: str, *args: object) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    srv = ThreadingHTTPServer((host, port), Handler)
    srv.daemon_threads = True
    return srv
