"""`nvctk configure --runtime crio` against the real CRI-O 1.36.3 (../shared/peers/crio):
CRI-O loads the drop-in and lists the handler (`crio config`), `--remove` takes it
out again, and a drop-in CRI-O would refuse is never written. Without ../shared
these skip, saying why."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from support.daemons import CRIO_TAR, crio_config, crio_dump, peer_bin, peer_env, short_dir

pytestmark = [pytest.mark.slow]

RUNTIME = os.path.join(os.path.dirname(sys.executable), "nvctk-runtime")
Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def crio_bin() -> Iterator[Path]:
    with peer_bin(CRIO_TAR, "nvctk-cb-") as got:
        yield got


@pytest.fixture
def work(crio_bin: Path) -> Iterator[Path]:
    with short_dir("nvctk-cw-") as d:
        crio_config(d, "nvctk.test/pause:1", crio_bin)
        yield d


def handlers(crio_bin: Path, work: Path) -> dict:
    res = crio_dump(crio_bin, work)
    assert res.returncode == 0, res.stderr[-2000:]
    return tomllib.loads(res.stdout)["crio"]["runtime"]["runtimes"]


@pytest.mark.parametrize("default", [False, True])
def test_crio_loads_the_drop_in_and_lists_the_handler(run_nvctk: Run, crio_bin: Path, work: Path,
                                                      default: bool) -> None:
    args = ["configure", "--runtime", "crio", "--config", str(work / "crio.conf"),
            "--drop-in", str(work / "conf.d" / "99-nvctk.toml")]
    if default:
        args.append("--set-as-default")
    res = run_nvctk(*args, env=peer_env(crio_bin))
    assert res.returncode == 0, res.stderr
    rts = handlers(crio_bin, work)
    assert rts["nvidia"]["runtime_path"] == RUNTIME
    assert rts["nvidia"]["runtime_type"] == "oci"
    assert {"runc", "nvidia"} <= set(rts)
    dump = tomllib.loads(crio_dump(crio_bin, work).stdout)
    assert dump["crio"]["runtime"]["default_runtime"] == ("nvidia" if default else "runc")
    res = run_nvctk(*args, "--remove", env=peer_env(crio_bin))
    assert res.returncode == 0, res.stderr
    # nothing left in the drop-in dir: CRI-O reads every file there, a .bak included
    assert os.listdir(work / "conf.d") == []
    assert (work / "conf.d-99-nvctk.toml.bak").is_file()
    assert "nvidia" not in handlers(crio_bin, work)
    dump = tomllib.loads(crio_dump(crio_bin, work).stdout)
    assert dump["crio"]["runtime"]["default_runtime"] == "runc"


def test_a_drop_in_crio_would_refuse_is_never_written(run_nvctk: Run, crio_bin: Path,
                                                      work: Path) -> None:
    """TOML that tomlkit takes but CRI-O refuses (a string where CRI-O wants a number),
    in the drop-in nvctk edits: configure says CRI-O's words and leaves it."""
    drop = work / "conf.d" / "99-nvctk.toml"
    text = '[crio.runtime]\nlog_size_max = "big"\n'
    drop.write_text(text)
    res = run_nvctk("configure", "--runtime", "crio", "--config", str(work / "crio.conf"),
                    "--drop-in", str(drop), env=peer_env(crio_bin))
    assert res.returncode == 1, res.stdout
    assert "CRI-O" in res.stderr and "would refuse" in res.stderr and "log_size_max" in res.stderr, \
        res.stderr
    assert "Traceback" not in res.stderr
    assert drop.read_text() == text and sorted(os.listdir(drop.parent)) == ["99-nvctk.toml"]


@pytest.mark.parametrize(("name", "text", "key", "extra"), [
    ("zz-other.toml", '[crio.runtime.runtimes.nvidia]\nruntime_path = "/usr/bin/runc"\n',
     "runtime_path", []),
    ("99-remote.toml", '[crio.runtime.runtimes.nvidia]\nruntime_type = "vm"\n'
     'runtime_config_path = "/etc/kata.toml"\n', "runtime_type", []),
    ("zz-default.toml", '[crio.runtime]\ndefault_runtime = "runc"\n', "default_runtime",
     ["--set-as-default"]),
])
def test_a_later_drop_in_that_wins_crios_merge_fails_configure(
        run_nvctk: Run, crio_bin: Path, work: Path, name: str, text: str, key: str,
        extra: list[str]) -> None:
    """A drop-in read after 99-nvctk.toml that sets nvctk's runtime's keys wins CRI-O's
    merge (`crio config` shows it): before, configure said "created" and exited 0.
    Now it fails naming that file, and writes nothing."""
    (work / "conf.d" / name).write_text(text)
    args = ["configure", "--runtime", "crio", "--config", str(work / "crio.conf"),
            "--drop-in", str(work / "conf.d" / "99-nvctk.toml"), *extra]
    res = run_nvctk(*args, env=peer_env(crio_bin))
    assert res.returncode == 1, res.stdout
    assert str(work / "conf.d" / name) in res.stderr and key in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert sorted(os.listdir(work / "conf.d")) == [name]
    # read before nvctk's, it loses: configure goes ahead, and CRI-O runs nvctk-runtime
    (work / "conf.d" / name).rename(work / "conf.d" / f"00-{name}")
    res = run_nvctk(*args, env=peer_env(crio_bin))
    assert res.returncode == 0, res.stderr
    assert handlers(crio_bin, work)["nvidia"]["runtime_path"] == RUNTIME
