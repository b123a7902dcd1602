"""`nvctk configure --restart-mode` against the real containerd 2.3.4, run under a
supervisor that starts it again when it exits (what systemd's Restart=always does on a
node): configure, then SIGHUP (containerd has no reload: it exits and comes back with the
new config), then wait until its CRI lists the `nvidia` handler; `--remove` takes it out
the same way; a containerd that does not come back gets its config back, and the error
says which engine and what to do. Without ../shared these skip, saying why."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvctk.engines import restart
from support.cri import CriClient, containerd2_cri_config
from support.daemons import (
    CONTAINERD_2_TAR,
    SupervisedContainerd,
    peer_bin,
    peer_env,
    short_dir,
    supervised_containerd,
    umount_below,
)
from support.exe import nvctk_exe

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def bin2() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root: starts containerd")
    with peer_bin(CONTAINERD_2_TAR, "nvctk-rs-") as got:
        yield got


@pytest.fixture
def ctd(bin2: Path) -> Iterator[SupervisedContainerd]:
    with short_dir("nvctk-rsw-") as d:
        cfg = d / "config.toml"
        default = subprocess.run([str(bin2 / "containerd"), "config", "default"],
                                 capture_output=True, text=True, check=True).stdout
        cfg.write_text(containerd2_cri_config(d, "nvctk.test/pause:1", default))
        with supervised_containerd(d, bin2, cfg, str(d / "containerd.sock")) as s:
            yield s
        umount_below(d)


def handlers(ctd: SupervisedContainerd) -> set[str]:
    return restart.handlers("containerd", ctd.sock)


def configure(ctd: SupervisedContainerd, bin2: Path, *args: str
              ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*nvctk_exe(), "configure", "--runtime", "containerd", "--config",
                           str(ctd.config), "--socket", ctd.sock, *args],
                          capture_output=True, text=True, timeout=180, env=peer_env(bin2))


def test_signal_restarts_containerd_into_the_nvidia_handler(ctd: SupervisedContainerd,
                                                            bin2: Path) -> None:
    original = ctd.config.read_bytes()
    before = ctd.pid()
    assert "nvidia" not in handlers(ctd)
    r = configure(ctd, bin2, "--restart-mode", "signal")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"sent SIGHUP to containerd (pid {before})" in r.stdout
    assert "containerd answers with runtime 'nvidia'" in r.stdout
    # a new containerd, and its CRI (the kubelet's view) serves the handler
    assert ctd.pid() != before
    with CriClient(ctd.sock) as cri:
        status = cri.runtime.Status(cri.pb.StatusRequest(), timeout=30)
    assert "nvidia" in {h.name for h in status.runtime_handlers}
    # a second run: nothing to write, and the handler is served already: no restart
    now = ctd.pid()
    r = configure(ctd, bin2, "--restart-mode", "signal")
    assert r.returncode == 0 and "serves it as wanted" in r.stdout, r.stdout + r.stderr
    assert ctd.pid() == now
    # removed the same way: the handler gone, the config as it was
    r = configure(ctd, bin2, "--remove", "--restart-mode", "signal")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "containerd answers without runtime 'nvidia'" in r.stdout
    assert "nvidia" not in handlers(ctd) and ctd.config.read_bytes() == original


def test_containerd_that_does_not_come_back_gets_its_config_back(ctd: SupervisedContainerd,
                                                                 bin2: Path) -> None:
    original = ctd.config.read_bytes()
    ctd.stop_file.touch()  # the service manager gives up: containerd stays down
    r = configure(ctd, bin2, "--restart-mode", "signal", "--restart-timeout", "3")
    assert r.returncode == 1, r.stdout + r.stderr
    err = r.stderr
    assert "containerd did not answer with runtime handler 'nvidia' within 3 s" in err, err
    assert "journalctl -u containerd" in err and "the config is restored" in err, err
    assert "Traceback" not in err
    assert ctd.config.read_bytes() == original


def test_signal_mode_needs_the_engines_process(tmp_path: Path) -> None:
    """No engine on the socket: a clear error before anything is written."""
    cfg = tmp_path / "config.toml"
    cfg.write_text("version = 2\n")
    r = subprocess.run([*nvctk_exe(), "configure", "--runtime", "containerd", "--config",
                        str(cfg), "--socket", str(tmp_path / "none.sock"),
                        "--restart-mode", "signal", "--restart-timeout", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert f"{tmp_path / 'none.sock'}: cannot reach the engine" in r.stderr, r.stderr
    assert cfg.read_text() == "version = 2\n"
