"""A real Prometheus (Debian's package) and `nvctk monitor` as processes on a simulated
node, for the monitor's end-to-end tests (tests/e2e/test_monitor_*.py)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from support.monitor import Node
from support.tls import make_cert
from support.wait import until as wait_until

BIN = os.path.dirname(sys.executable)
PASSWORD = "s3cret"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 5) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        data: bytes = r.read()
        return data


class Monitor:
    """`nvctk monitor` on a free loopback port, every second, its log in tmp."""

    def __init__(self, node: Node, tmp: Path, *args: str) -> None:
        self.log = tmp / "monitor.log"
        self.proc = subprocess.Popen(
            [os.path.join(BIN, "nvctk"), "monitor", "--listen", "127.0.0.1:0", "--interval", "1",
             "--runtime-root", f"containerd={node.runc_root}", *args],  # K8S: containerd's keys
            env={**os.environ, **node.sim.env}, stdout=subprocess.DEVNULL,
            stderr=open(self.log, "w"))  # noqa: SIM115 - the child keeps it
        self.port = 0

        def listening() -> bool:
            assert self.proc.poll() is None, self.log.read_text()
            m = re.search(r"serving http://127\.0\.0\.1:(\d+)/", self.log.read_text())
            self.port = int(m.group(1)) if m else 0
            return bool(self.port)

        wait_until(listening, 60, "the monitor to listen")
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until(lambda: b"nvctk_container" in get(self.url + "/metrics"), 60,
                   "the monitor's first snapshot")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


class Prometheus:
    def __init__(self, target: str, tmp: Path, labels: dict[str, str] | None = None,
                 jobs: list[dict[str, Any]] | None = None, rules: list[Path] | None = None,
                 job: str = "nvctk") -> None:
        """jobs: scrape jobs of their own (each names its targets) instead of one plain job
        named `job`; rules: rule files to load (alerts, evaluated every second)."""
        assert PROMETHEUS
        cfg = tmp / "prometheus.yml"
        cfg.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(r) for r in rules or []],
            "scrape_configs": jobs or [{"job_name": job, "static_configs": [
                {"targets": [target], "labels": labels or {}}]}],
        }))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "w"))  # noqa: SIM115

        def ready() -> bool:
            assert self.proc.poll() is None, (tmp / "prometheus.log").read_text()
            try:
                return get(self.url + "/-/ready", 1).startswith(b"Prometheus")
            except OSError:
                return False

        wait_until(ready, 60, "prometheus to be ready")

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = json.loads(get(self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert body["status"] == "success", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def firing(self) -> set[str]:
        """The names of the alerts firing now."""
        body = json.loads(get(self.url + "/api/v1/alerts"))
        return {a["labels"]["alertname"] for a in body["data"]["alerts"] if a["state"] == "firing"}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def web_config(tmp: Path, password: str = PASSWORD) -> Path:
    """An exporter-toolkit web config: TLS with make_cert's pair, user prometheus."""
    import bcrypt

    crt, key = make_cert(tmp, cn="nvctk-monitor")
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=10)).decode()
    cfg = tmp / "web.yml"
    cfg.write_text(f"tls_server_config:\n  cert_file: {crt}\n  key_file: {key}\n"
                   f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    return cfg

