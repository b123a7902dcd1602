"""`nvctk monitor --web-config-file`: TLS and basic auth in Prometheus exporters' web config
format (exporter-toolkit), on a simulated node: a real TLS client (Python's ssl, the
monitor's own certificate as its CA) with and without the right credentials; /healthz
open to the kubelet's probes; every wrong file one line naming the file and the key.
(A real Prometheus scraping it over TLS with basic auth: tests/e2e/test_monitor_alerts.py.)
"""

from __future__ import annotations

import base64
import os
import re
import signal
import ssl
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.monitor import NODE_TESTS, NVCTK, Node, node_in
from support.prometheus import make_cert, web_config
from support.wait import until

pytestmark = NODE_TESTS


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    with node_in(tmp_path_factory.mktemp("monitor-web")) as n:
        yield n


def start(node: Node, tmp: Path, *args: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    log = tmp / "monitor.log"
    proc = subprocess.Popen([NVCTK, "monitor", "--listen", "127.0.0.1:0", "--interval", "0.5",
                             "--runtime-root", node.runc_root, *args],
                            env={**os.environ, **node.sim.env}, stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"))  # noqa: SIM115 - the child keeps it

    def serving() -> re.Match[str] | None:
        assert proc.poll() is None, log.read_text()
        return re.search(r"serving https://127\.0\.0\.1:(\d+)/", log.read_text())

    return proc, int(until(serving, 60, "the monitor to listen").group(1)), log


def fetch(url: str, ca: Path | None, user: str | None = None, password: str = "") -> tuple[int, bytes]:
    ctx = ssl.create_default_context(cafile=str(ca)) if ca else None
    headers = {}
    if user is not None:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10,
                                    context=ctx) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        assert e.code != 401 or e.headers["WWW-Authenticate"] == 'Basic realm="nvctk monitor"'
        return e.code, e.read()


def test_tls_and_basic_auth_as_exporters_configure_them(node: Node, tmp_path: Path) -> None:
    cfg = web_config(tmp_path)
    proc, port, log = start(node, tmp_path, "--web-config-file", str(cfg))
    url, ca = f"https://127.0.0.1:{port}", tmp_path / "tls.crt"
    try:
        until(lambda: b"nvctk_gpu_memory_used_bytes" in fetch(url + "/metrics", ca, "prometheus", "s3cret")[1],
              60, "/metrics over TLS with the password")
        assert fetch(url + "/metrics", ca, "prometheus", "s3cret")[0] == 200  # remembered: no bcrypt again
        assert fetch(url + "/metrics", ca)[0] == 401
        assert fetch(url + "/metrics", ca, "prometheus", "wrong")[0] == 401
        assert fetch(url + "/metrics", ca, "someone", "s3cret")[0] == 401
        assert fetch(url + "/api/snapshot", ca)[0] == 401 and fetch(url + "/", ca)[0] == 401
        assert fetch(url + "/healthz", ca) == (200, b"ok\n")  # the kubelet's probes carry no password
        # plain HTTP to the TLS port: no answer in clear text
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
        # an untrusted certificate is refused by the client, as it should be
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            urllib.request.urlopen(url + "/healthz", timeout=10, context=ssl.create_default_context())
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize("content, why", [
    ("tls_server_config: {cert_file: CRT}\n", "tls_server_config.key_file: missing"),
    ("tls_server_config: {cert_file: CRT, key_file: /nonexistent}\n", "tls_server_config.cert_file/key_file:"),
    ("tls_server_config: {cert_file: CRT, key_file: KEY, client_auth_type: RequireAnyClientCert}\n",
     "tls_server_config.client_auth_type: 'RequireAnyClientCert', not one of"),
    ("tls_server_config: {cert_file: CRT, key_file: KEY, client_auth_type: RequireAndVerifyClientCert}\n",
     "tls_server_config.client_ca_file: needed by RequireAndVerifyClientCert"),
    ("tls_server_config: {cert_file: CRT, key_file: KEY, min_version: TLS9}\n",
     "tls_server_config.min_version: 'TLS9', not one of"),
    ("tls_server_config: {cert_file: CRT, key_file: KEY, cipher_suites: [x]}\n",
     "tls_server_config.cipher_suites: not supported"),
    ("http_server_config: {http2: true}\n", "http_server_config: not supported"),
    ("basic_auth_users: {prometheus: plaintext}\n", "basic_auth_users.prometheus: not a bcrypt hash"),
    ("basic_auth_users: [prometheus]\n", "basic_auth_users: not a mapping"),
    ("[unclosed\n", "not YAML"),
    (None, "cannot read it (No such file or directory)"),
])
def test_a_wrong_web_config_is_one_line_naming_it(node: Node, tmp_path: Path, content: str | None,
                                                  why: str) -> None:
    crt, key = make_cert(tmp_path)
    cfg = tmp_path / "web.yml"
    if content is not None:
        cfg.write_text(content.replace("CRT", str(crt)).replace("KEY", str(key)))
    r = subprocess.run([NVCTK, "monitor", "--listen", "127.0.0.1:0", "--web-config-file", str(cfg),
                        "--runtime-root", node.runc_root], env={**os.environ, **node.sim.env},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith(f"nvctk: --web-config-file {cfg}: ") and why in line, line
