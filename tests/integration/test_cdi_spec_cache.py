"""CDI mode's cache of parsed and checked specs (nvctk.cdi.load.SpecCache): used while a
spec file's stat is unchanged, never when it changed or when the cache is not root's
alone; one per list of spec dirs, never read for another list."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvctk.cdi import load
from nvctk.sim.host import SimHost

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the cache is root's only")


def _spec(name: str) -> str:
    return ("cdiVersion: 0.5.0\nkind: x.io/c\ndevices:\n"
            f"- name: '{name}'\n  containerEdits: {{env: [A={name}]}}\n")


def _settled(p: Path) -> None:
    """Set the file's times 10 s back: past the racy window (ctime follows the change)."""
    t = time.time() - 10
    os.utime(p, (t, t))


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    specs, cache = tmp_path / "specs", tmp_path / "cache"
    specs.mkdir()
    cache.mkdir(mode=0o755)
    return specs, cache


def _names(specs: Path, cache: Path, name: str) -> list[str]:
    return [r.device["containerEdits"]["env"][0]
            for r in load.resolve((f"x.io/c={name}",), (str(specs),), str(cache))]


def _file(cache: Path, specs: Path) -> Path:
    return Path(load.spec_cache_path(str(cache), (str(specs),)))


def _forge(cache: Path, value: str) -> None:
    """Rewrite the cached specs' content in every cache file, keeping their stamps: a
    create that uses a cache sees this value."""
    for f in cache.glob("cdi-specs*.json"):
        data = json.loads(f.read_text())
        for entry in data["files"].values():
            entry[1]["devices"][0]["containerEdits"]["env"] = [value]
        f.write_text(json.dumps(data))


def _cached_and_forged(specs: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A settled spec x.io/c=0 read once (cached), its cache then forged to say A=forged;
    the cache file."""
    (specs / "x.yaml").write_text(_spec("0"))
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 10 * 10**9)
    _names(specs, cache, "0")
    _forge(cache, "A=forged")
    return _file(cache, specs)


def test_a_fresh_spec_is_not_cached(dirs: tuple[Path, Path]) -> None:
    specs, cache = dirs
    p = specs / "x.yaml"
    p.write_text(_spec("0"))
    assert _names(specs, cache, "0") == ["A=0"]
    # ctime is now: the file is too fresh to cache
    assert not list(cache.iterdir())


def test_a_settled_spec_is_cached_and_a_changed_one_read_again(dirs: tuple[Path, Path],
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    specs, cache = dirs
    p = specs / "x.yaml"
    p.write_text(_spec("0"))
    # the file's ctime cannot be set back: move "now" 10 s ahead instead
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 10 * 10**9)
    assert _names(specs, cache, "0") == ["A=0"]
    assert _file(cache, specs).exists()
    _forge(cache, "A=cached")
    assert _names(specs, cache, "0") == ["A=cached"]  # parsed once, then the cache
    p.write_text(_spec("0").replace("A=0", "A=1"))  # a new stamp: read again
    assert _names(specs, cache, "0") == ["A=1"]


def test_the_cache_forgets_specs_that_are_gone(dirs: tuple[Path, Path],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """It holds what a create reads: a spec removed from the dirs leaves it at the next
    create (it grew with every spec dir a node ever used before)."""
    specs, cache = dirs
    for n in ("a", "b"):
        (specs / f"{n}.yaml").write_text(_spec(n))
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 10 * 10**9)
    assert _names(specs, cache, "a") == ["A=a"]

    def cached() -> list[str]:
        data = json.loads(_file(cache, specs).read_text())
        return sorted(os.path.basename(p) for p in data["files"])

    assert cached() == ["a.yaml", "b.yaml"]
    (specs / "b.yaml").unlink()
    assert _names(specs, cache, "a") == ["A=a"]
    assert cached() == ["a.yaml"]


def test_configurations_with_other_spec_dirs_in_turn_each_hit_their_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two configurations (their spec dirs), creates of each in turn: each reads its
    own cache. Before: one cache file for the node, each create forgot the other's
    specs, and every create parsed its specs again."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    dirs = {}
    for n in ("a", "b"):
        dirs[n] = tmp_path / f"specs-{n}"
        dirs[n].mkdir()
        (dirs[n] / "x.yaml").write_text(_spec(n))
    real = time.time_ns
    monkeypatch.setattr(time, "time_ns", lambda: real() + 10 * 10**9)
    for n in ("a", "b"):
        assert _names(dirs[n], cache, n) == [f"A={n}"]  # parsed, then cached
    _forge(cache, "A=cached")
    for n in ("a", "b", "a", "b"):
        assert _names(dirs[n], cache, n) == ["A=cached"], n


def test_another_lists_cache_is_never_read(dirs: tuple[Path, Path],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache file holds the spec dirs it was written for: at another list's name (a
    name collision, a file moved) it is not read, even for a file both lists hold."""
    specs, cache = dirs
    f = _cached_and_forged(specs, cache, monkeypatch)
    both = (str(specs), str(cache / "other"))
    f.rename(load.spec_cache_path(str(cache), both))
    found = load.resolve(("x.io/c=0",), both, str(cache))
    assert [r.device["containerEdits"]["env"][0] for r in found] == ["A=0"]


@pytest.mark.parametrize("how", ["group-writable", "not-root", "symlink"])
def test_a_cache_others_could_write_is_ignored(dirs: tuple[Path, Path], how: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    specs, cache = dirs
    f = _cached_and_forged(specs, cache, monkeypatch)
    if how == "group-writable":
        f.chmod(0o664)
    elif how == "not-root":
        os.chown(f, 1000, 1000)
    else:
        f.rename(cache / "elsewhere.json")
        f.symlink_to(cache / "elsewhere.json")
    assert _names(specs, cache, "0") == ["A=0"]


CREATE = """
import json, sys, time
from nvctk.base import config as nvconfig
from nvctk.runtime import create
cfg = nvconfig.load(sys.argv[1]).replace(mode="cdi", cdi_spec_dirs=(sys.argv[2],),
                                         hook_path="/usr/bin/nvctk-hook",
                                         state_dir=sys.argv[4])
if sys.argv[5] == "later":  # as if the spec were written long ago: cacheable
    real = time.time_ns
    time.time_ns = lambda: real() + 10 * 10**9
create.prepare_bundle(sys.argv[3], cfg, container_id="c1")
print(json.dumps(sorted(sys.modules)))
"""


def test_a_cdi_create_of_a_cached_yaml_spec_imports_no_yaml_or_planner(
        sim_host: SimHost, tmp_path: Path) -> None:
    """The second create of a YAML spec (in a process of its own, as nvctk-runtime's)
    reads the cache: no yaml, none of legacy mode's planning steps (the one planner,
    nvctk.plan.make, with its hooks step, is CDI mode's too), no NVML."""
    specs = tmp_path / "specs"
    exe = Path(sys.executable).with_name("nvctk")
    r = subprocess.run([str(exe), "cdi", "generate", "--output", str(specs / "nvidia.yaml")],
                       env={**os.environ, "NVCTK_CONFIG": sim_host.config_path},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    seen = []
    for when in ("later", "now"):
        b = tmp_path / f"b-{when}"
        (b / "rootfs").mkdir(parents=True)
        (b / "config.json").write_text(json.dumps({
            "ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=0"], "args": ["true"]}}))
        r = subprocess.run([sys.executable, "-I", "-c", CREATE, sim_host.config_path,
                            str(specs), str(b), str(tmp_path / "state"), when],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        seen.append(json.loads(r.stdout.splitlines()[-1]))
    assert "yaml" in seen[0]  # the first create parsed the YAML spec and cached it
    assert "yaml" not in seen[1]
    assert not [m for m in seen[1] if m.startswith((
        "nvctk.plan.devices", "nvctk.plan.mounts", "nvctk.plan.select", "nvctk.plan.vgpu",
        "nvctk.host.nvml", "nvctk.host.discover"))]
    assert {"nvctk.plan.make", "nvctk.plan.hooks"} <= set(seen[1])  # plan_container
