"""The parsed-config cache (nvctk.base.config): only root writes and trusts it, so
these run as root."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nvctk.base import config as nvconfig
from nvctk.base import stamped
from nvctk.base.errors import ConfigError
from nvctk.sim import host

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="only root writes the parsed-config cache")


def _sim_config_file(tmp_path: Path) -> Path:
    """A config as `nvctk sim init` writes it (nvctk.sim.host._build)."""
    p = tmp_path / "config.toml"
    p.write_text(nvconfig.render(host.sim_config(str(tmp_path / "host"))))
    return p


def _load_in_child(p: Path, cache: Path) -> tuple[set[str], nvconfig.Config]:
    """config.load(p) in a fresh `python -I -S` (as the runtime runs): the modules it
    imported, and the config it read."""
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from nvctk.base import config; "
        f"cfg = config.load({str(p)!r}); "
        "print(sorted(sys.modules)); print(repr(cfg.to_dict()))"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env[nvconfig.CACHE_VAR] = str(cache)
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True,
                       text=True, check=True, env=env)
    modules, values = r.stdout.splitlines()
    d = eval(values)
    d["extra_mounts"] = tuple(nvconfig.ExtraMount(**m) for m in d["extra_mounts"])
    return set(eval(modules)), nvconfig.Config(**{
        k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@pytest.fixture
def settled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Configs written just now count as settled (the racy rule is tested in
    test_launcher.py): the cache is written at once."""
    monkeypatch.setattr(stamped, "RACY_NS", -(10**12))
    monkeypatch.setattr(stamped, "RACY_COARSE_NS", -(10**12))


def test_a_cache_hit_imports_no_tomllib(tmp_path: Path, settled: None) -> None:
    """The runtime reads the config at every container start: from the second load on,
    the parsed-config cache serves it without tomllib (nor dataclasses, typing, re, json,
    enum, inspect)."""
    p = _sim_config_file(tmp_path)
    cache = tmp_path / "cache"
    slow = {"tomllib", "dataclasses", "typing", "re", "json", "enum", "inspect"}
    untrusted = tmp_path / "untrusted"  # others may write it: never read nor written
    untrusted.mkdir()
    untrusted.chmod(0o777)
    loaded, cold = _load_in_child(p, untrusted)  # a miss: parses
    assert "tomllib" in loaded
    assert list(untrusted.iterdir()) == []
    with pytest.MonkeyPatch.context() as m:
        m.setenv(nvconfig.CACHE_VAR, str(cache))
        want = nvconfig.load(str(p))  # settled here: writes the cache
    entry = cache / f"config-{nvconfig.cache_name(str(p))}.json"
    assert entry.stat().st_mode & 0o777 == 0o600 and entry.stat().st_uid == 0
    loaded, warm = _load_in_child(p, cache)
    assert not slow & loaded, sorted(slow & loaded)
    assert warm == cold == want == host.sim_config(str(tmp_path / "host"))
    assert warm.extra_mounts and warm.log_level == "debug" and warm.path == str(p)


def test_a_changed_config_is_read_again(tmp_path: Path, settled: None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nvconfig.CACHE_VAR, str(tmp_path / "cache"))
    p = tmp_path / "c.toml"
    p.write_text('log-level = "debug"\n')
    assert nvconfig.load(str(p)).log_level == "debug"
    entry = Path(nvconfig.parsed_cache_path(str(p)))
    assert entry.exists()
    p.write_text('log-level = "error"\n')  # same size, same inode
    st = p.stat()  # the write may fall in the same timer tick: set another mtime
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))
    assert nvconfig.load(str(p)).log_level == "error"
    p.write_text('log-level = "warning"\n')  # another size
    assert nvconfig.load(str(p)).log_level == "warning"
    q = tmp_path / "q.toml"
    q.write_text('log-level = "info"\n')
    os.replace(q, p)  # another inode
    assert nvconfig.load(str(p)).log_level == "info"
    p.write_text("log-level = 3\n")  # now broken: the cache does not hide it
    with pytest.raises(ConfigError, match="log-level must be a string"):
        nvconfig.load(str(p))


def test_a_forged_or_unsafe_cache_is_ignored(tmp_path: Path, settled: None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv(nvconfig.CACHE_VAR, str(cache))
    p = tmp_path / "c.toml"
    p.write_text('runtimes = ["runc"]\n')
    assert nvconfig.load(str(p)).runtimes == ("runc",)
    entry = Path(nvconfig.parsed_cache_path(str(p)))
    good = entry.read_text()
    forged = good.replace('"runc"', '"/tmp/evil"')
    assert forged != good

    def served(text: str, mode: int = 0o600, uid: int = 0) -> tuple[str, ...]:
        entry.unlink(missing_ok=True)
        entry.write_text(text)
        os.chmod(entry, mode)
        os.chown(entry, uid, 0)
        return nvconfig.load(str(p)).runtimes

    assert served(forged) == ("/tmp/evil",)  # a root-owned 0600 entry is the cache
    assert served(forged, 0o644) == ("runc",)  # others could have read or ... : ignored
    assert served(forged, 0o620) == ("runc",)
    assert served(forged, uid=65534) == ("runc",)  # not root's
    assert served(good.replace('"stamp":[', '"stamp":[1,')) == ("runc",)  # another stamp
    assert served(good.replace(str(p), str(p) + "x")) == ("runc",)  # another path
    assert served("{not json") == ("runc",)
    assert served(good.replace('"runc"', "5")) == ("runc",)  # fails the checks: a miss
    assert served(good.replace('"runtimes"', '"bogus"')) == ("runc",)
    # a link in the entry's place is not followed
    entry.unlink()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(forged)
    os.chmod(elsewhere, 0o600)
    entry.symlink_to(elsewhere)
    assert nvconfig.load(str(p)).runtimes == ("runc",)
    # a cache dir others can write is not trusted (nor written)
    entry.unlink()
    entry.write_text(forged)
    os.chmod(entry, 0o600)
    os.chmod(cache, 0o777)
    assert nvconfig.load(str(p)).runtimes == ("runc",)
    assert entry.read_text() == forged
    os.chmod(cache, 0o755)
    # and a miss writes the right entry back over a forged one
    entry.write_text(good.replace('"stamp":[', '"stamp":[1,'))
    assert nvconfig.load(str(p)).runtimes == ("runc",)
    assert entry.read_text() == good
