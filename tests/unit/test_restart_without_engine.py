"""`nvctk configure --restart-mode`'s parts without an engine: Docker's /info read over its
socket, and the systemd restart's command (in the host's root from a container)."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from nvctk.engines import restart


def serve_once(sock: Path, answer: bytes) -> threading.Thread:
    """A unix socket that answers its first request with `answer`, then closes."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock))
    srv.listen(1)

    def run() -> None:
        with srv:
            conn, _ = srv.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(answer)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_dockers_handlers_are_its_info_runtimes(tmp_path: Path) -> None:
    body = b'{"Runtimes": {"runc": {}, "nvidia": {"path": "nvctk-runtime"}}}'
    serve_once(tmp_path / "d.sock", b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n" + body)
    assert restart.handlers("docker", str(tmp_path / "d.sock")) == {"runc", "nvidia"}


@pytest.mark.parametrize(("answer", "says"), [
    (b"HTTP/1.0 500 Internal Server Error\r\n\r\n{}", "500"),
    (b"HTTP/1.0 200 OK\r\n\r\nnot json", "not JSON"),
    (b"", "no answer"),
])
def test_a_docker_that_does_not_answer_well_is_an_error(tmp_path: Path, answer: bytes,
                                                        says: str) -> None:
    serve_once(tmp_path / "d.sock", answer)
    with pytest.raises(restart.EngineError, match=says):
        restart.handlers("docker", str(tmp_path / "d.sock"))


@pytest.fixture
def systemctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A systemctl and a chroot on PATH that write their argv to tmp_path/argv."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name in ("systemctl", "chroot"):
        f = bin_ / name
        f.write_text(f'#!/bin/sh\necho {name} "$@" >> {tmp_path}/argv\n')
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_}{os.pathsep}{os.environ['PATH']}")
    return tmp_path / "argv"


@pytest.mark.parametrize(("host_root", "argv"), [
    ("/", "systemctl restart containerd"),
    ("HOST", "chroot HOST systemctl restart containerd"),  # from the installer's container
])
def test_systemd_mode_restarts_the_engines_unit(systemctl: Path, tmp_path: Path,
                                                host_root: str, argv: str) -> None:
    root = str(tmp_path) if host_root == "HOST" else "/"
    said = restart.poke(restart.Restart("containerd", "systemd", host_root=root))
    want = argv.replace("HOST", root)
    assert systemctl.read_text().split("\n")[0] == want
    assert said == f"restarted containerd ({want})"


def test_a_failed_systemctl_is_an_error(systemctl: Path) -> None:
    bin_ = systemctl.parent / "bin" / "systemctl"
    bin_.write_text("#!/bin/sh\necho 'Unit containerd.service not found.' >&2\nexit 5\n")
    with pytest.raises(restart.EngineError, match=r"exit 5.*not found"):
        restart.poke(restart.Restart("containerd", "systemd"))
