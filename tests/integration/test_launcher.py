"""The launchers (runtime_shim/launcher.c): nvctk-runtime's passthrough without
Python, and the layouts the three executables find nvctk in.

The fast path is checked by what it must not do: each test layout's python3 is a
wrapper that records every start, so a passthrough that silently fell back to
Python shows up as a line in that record.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
import time
from pathlib import Path

import pytest

from nvctk.base import stamped
from nvctk.runtime import passthrough
from support import wait
from support.launchers import PYVER, REPO, Launchers, launcher

DEPS = sysconfig.get_paths()["purelib"]
RUNC_ARGV = ["--root", "/run/x y", "--log-format", "json", "kill", "ctr-1", "SIGKILL"]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the passthrough cache is root's")


class Layout(Launchers):
    """The launchers with a counting python3, a config, a cache dir, fake runtimes."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.tmp = tmp
        self.cache = tmp / "cache"
        self.config = tmp / "config.toml"
        self.record = tmp / "argv.rec"
        self.fakes = tmp / "fakes"
        self.fakes.mkdir()

    def fake(self, name: str) -> Path:
        """A runtime that records its argv (each in its own file: which one ran)."""
        fake = self.fakes / name
        fake.write_text(f"#!/bin/sh\nprintf '%s\\0' \"$0\" \"$@\" > '{self.record}'\n")
        fake.chmod(0o755)
        return fake

    def write_config(self, text: str, mtime_ns: int | None = None) -> None:
        """Write the config (mtime_ns: put its mtime back), then let it age past the racy
        window, after which Python caches what it reads (nvctk.base.stamped.racy)."""
        self.config.write_text(text)
        if mtime_ns is not None:
            os.utime(self.config, ns=(mtime_ns, mtime_ns))
        config = self.config
        wait.until(lambda: not stamped.racy(os.stat(config).st_ctime_ns), 10, "the config to age")

    def run(self, argv: list[str], **env: str) -> subprocess.CompletedProcess[str]:
        self.record.unlink(missing_ok=True)
        full = {"PATH": f"{self.fakes}:/usr/sbin:/usr/bin:/sbin:/bin",
                "NVCTK_CONFIG": str(self.config), "NVCTK_PASSTHROUGH_CACHE": str(self.cache),
                **env}
        return subprocess.run([str(self.bin / "nvctk-runtime"), *argv], env=full,
                              capture_output=True, text=True, timeout=60, cwd=self.tmp)

    def ran(self) -> list[str]:
        return [a.decode() for a in self.record.read_bytes().split(b"\0")[:-1]]


@pytest.fixture
def layout(tmp_path: Path) -> Layout:
    return Layout(tmp_path)


def test_passthrough_starts_python_once_per_config_version(layout: Layout) -> None:
    fake = layout.fake("rt-a")
    layout.write_config(f'runtimes = ["{fake}"]\n')
    for want_starts in (1, 1, 1):
        r = layout.run(RUNC_ARGV)
        assert r.returncode == 0, r.stderr
        assert layout.ran() == [str(fake), *RUNC_ARGV]
        assert layout.python_starts() == want_starts
    # any write to the config (same size, mtime put back) is a miss: Python reads it
    other = layout.fake("rt-b")
    st = layout.config.stat()
    layout.write_config(f'runtimes = ["{other}"]\n', st.st_mtime_ns)
    assert layout.config.stat().st_size == st.st_size
    for want_starts in (2, 2):
        r = layout.run(RUNC_ARGV)
        assert r.returncode == 0, r.stderr
        assert layout.ran() == [str(other), *RUNC_ARGV]
        assert layout.python_starts() == want_starts


def test_a_replaced_config_is_a_miss(layout: Layout) -> None:
    a, b = layout.fake("rt-a"), layout.fake("rt-b")
    layout.write_config(f'runtimes = ["{a}"]\n')
    layout.run(["state", "x"])
    new = layout.tmp / "new.toml"
    new.write_text(f'runtimes = ["{b}"]\n')
    os.rename(new, layout.config)
    layout.run(["state", "x"])
    assert layout.ran()[0] == str(b) and layout.python_starts() == 2


@pytest.mark.parametrize("argv, python", [
    (["create", "--bundle", "b", "id"], True),
    (["run", "id"], True),
    (["--root", "/r", "--log", "/l", "create", "id"], True),
    (["--log=/l", "--debug", "run", "id"], True),
    (["--root", "create", "list"], False),  # "create" is --root's value
    (["--log-format", "run", "state", "x"], False),
    (["--criu", "c", "--rootless", "run", "delete", "x"], False),
    (["--", "create", "--bundle", "b", "id"], True),  # Go drops the `--`: a create
    (["--root", "/r", "--", "run", "id"], True),
    (["--", "state", "x"], False),
    (["--", "--", "create"], False),
    (["--version"], False),
    ([], False),
    (["start", "create"], False),
    (["-"], False),
])
def test_only_create_and_run_start_python(layout: Layout, argv: list[str], python: bool) -> None:
    fake = layout.fake("rt")
    layout.write_config(f'runtimes = ["{fake}"]\n')
    layout.run(["list"])  # writes the cache
    assert layout.python_starts() == 1
    layout.run(argv)
    assert layout.python_starts() == (2 if python else 1), layout.starts.read_text()
    if not python:
        assert layout.ran() == [str(fake), *argv]


def test_no_config_file_is_the_loaders_defaults(layout: Layout) -> None:
    """The defaults are the config loader's (the launcher has none of its own): cached
    as "absent" while the path has no file; a file appearing there is a miss."""
    layout.fake("runc")
    for _ in range(2):
        r = layout.run(["state", "x"])
        assert r.returncode == 0, r.stderr
        assert layout.ran() == [str(layout.fakes / "runc"), "state", "x"]
        assert layout.python_starts() == 1
    other = layout.fake("rt")
    layout.write_config(f'runtimes = ["{other}"]\n')
    layout.run(["state", "x"])
    assert layout.ran()[0] == str(other) and layout.python_starts() == 2


def test_two_copies_never_exec_each_other_forever(layout: Layout) -> None:
    """Two copies of nvctk-runtime, each the first "runc" on PATH for the other: the
    second refuses to start under the first (NVCTK_RUNTIME_HOP), naming the cause."""
    a, b = layout.bin, layout.tmp / "venv2" / "bin"  # two installs with their nvctk
    b.mkdir(parents=True)
    (b.parent / "lib").symlink_to(layout.site.parent.parent)
    (b / "python3").symlink_to(layout.bin / "python3")
    for d in (a, b):
        shutil.copy2(layout.bin / "nvctk-runtime", d / "runc")
    layout.write_config('runtimes = ["runc"]\n')
    for _ in range(2):  # Python, then the cache
        r = subprocess.run([str(a / "runc"), "list"], capture_output=True, text=True, timeout=30,
                           env={"PATH": f"{a}:{b}:/usr/bin:/bin",
                                "NVCTK_CONFIG": str(layout.config),
                                "NVCTK_PASSTHROUGH_CACHE": str(layout.cache)})
        assert r.returncode == 1, r.stderr
        assert "the low-level runtime it found is a copy of nvctk-runtime" in r.stderr


def test_never_execs_itself(layout: Layout) -> None:
    """A config naming nvctk-runtime itself first (a loop) skips it, cached or not."""
    fake = layout.fake("rt")
    layout.write_config(f'runtimes = ["{layout.bin / "nvctk-runtime"}", "{fake}"]\n')
    for _ in range(2):
        r = layout.run(["state", "x"])
        assert r.returncode == 0, r.stderr
        assert layout.ran()[0] == str(fake)
    assert layout.python_starts() == 1


def test_a_broken_config_is_never_served_from_the_cache(layout: Layout) -> None:
    """What the loader rejects goes to Python every time: the defaults and a warning."""
    layout.fake("runc")
    wanted = layout.fake("rt")
    layout.write_config(f'runtimes = ["{wanted}"]\nno-such-key = 1\n')
    for n in (1, 2):
        r = layout.run(["state", "x"])
        assert r.returncode == 0, r.stderr
        assert layout.ran()[0] == str(layout.fakes / "runc")
        assert layout.python_starts() == n
    assert not layout.cache.exists() or not list(layout.cache.iterdir())


@pytest.mark.parametrize("tamper", ["file-mode", "dir-mode", "symlink", "other-config"])
def test_an_untrusted_cache_is_ignored(layout: Layout, tamper: str) -> None:
    fake, evil = layout.fake("rt"), layout.fake("evil")
    layout.write_config(f'runtimes = ["{fake}"]\n')
    layout.run(["list"])
    entry = layout.cache / passthrough.cache_name(str(layout.config))
    good = entry.read_bytes()
    forged = good.replace(str(fake).encode(), str(evil).encode())
    if tamper == "file-mode":
        entry.write_bytes(forged)
        entry.chmod(0o666)
    elif tamper == "dir-mode":
        entry.write_bytes(forged)
        layout.cache.chmod(0o777)
    elif tamper == "symlink":
        (layout.tmp / "forged").write_bytes(forged)
        entry.unlink()
        entry.symlink_to(layout.tmp / "forged")
    else:  # an entry stamped for another config at the same name
        entry.write_bytes(forged.replace(str(layout.config).encode(), b"/etc/other.toml"))
    r = layout.run(["state", "x"])
    assert r.returncode == 0, r.stderr
    assert layout.ran()[0] == str(fake)
    assert layout.python_starts() == 2


def test_a_fresh_config_is_not_cached_yet() -> None:
    """git's racy rule: a config changed within the timer's resolution of now could
    change again without a new stamp; whole-second stamps (a coarse file system) wait
    two seconds."""
    now = time.time_ns()
    fine = now - 10_000_000
    if not fine % 1_000_000_000:
        fine += 1
    assert stamped.racy(fine, now)
    assert not stamped.racy(fine, now + stamped.RACY_NS)
    whole = now - now % 1_000_000_000 - 1_000_000_000
    assert stamped.racy(whole, whole + 1_500_000_000)
    assert not stamped.racy(whole, whole + stamped.RACY_COARSE_NS)


def test_long_runtime_lists_are_served_too(layout: Layout) -> None:
    """An entry of 50 KiB (the launcher reads up to 64 KiB, more than any config that
    the loader takes can give), long paths tried and skipped in order."""
    names = [f"/{'r' * 3990}/{i}" for i in range(12)]
    fake = layout.fake("rt")
    layout.write_config("runtimes = [\n" + "".join(f'  "{n}",\n' for n in names)
                        + f'  "{fake}",\n]\n')
    for _ in range(2):
        layout.run(["state", "x"])
        assert layout.ran()[0] == str(fake)
    assert layout.python_starts() == 1
    # the launcher's entry, beside the config loader's parsed-config cache
    (entry,) = (p for p in layout.cache.iterdir() if not p.name.startswith("config-"))
    assert entry.stat().st_size > 45_000


@pytest.mark.skipif(os.geteuid() != 0, reason="only root writes the cache")
def test_entries_not_written_racy_or_too_long(tmp_path: Path) -> None:
    """A config written this instant is not cached yet (nvctk.base.stamped.racy); nor is an entry
    over passthrough.MAX_ENTRY, which the launcher would read cut short (the loader's
    64 KiB limit on the config leaves only a long config path to get there)."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    config = tmp_path / "config.toml"
    config.write_text("")
    env = {passthrough.CACHE_VAR: str(cache)}
    passthrough.remember(str(config), os.stat(config), ("/r",), env)
    assert list(cache.iterdir()) == []  # just written: racy, not cached yet
    # from here only the size decides
    wait.until(lambda: not stamped.racy(os.stat(config).st_ctime_ns), 10, "the config to age")
    st = os.stat(config)
    for runtimes, written in (((f"/{'r' * 4000}",) * 16, True),
                              ((f"/{'r' * 4000}",) * 17, False)):
        data = passthrough.entry(str(config), st, runtimes)
        assert data is not None and (len(data) <= passthrough.MAX_ENTRY) == written
        passthrough.remember(str(config), st, runtimes, env)
        assert [p.name for p in cache.iterdir()] == ([passthrough.cache_name(str(config))]
                                                     if written else [])
        for p in cache.iterdir():
            p.unlink()


def test_cache_entry_matches_the_launchers_hash() -> None:
    """FNV-1a 64, as nvctk-runtime.c computes it (reference values of the algorithm)."""
    assert passthrough.cache_name("") == "cbf29ce484222325"
    assert passthrough.cache_name("a") == "af63dc4c8601ec8c"
    assert passthrough.cache_name("foobar") == "85944171f73967e8"


def test_the_hook_and_the_runtime_find_nvctk_in_every_layout(tmp_path: Path) -> None:
    """Debian package, venv/wheel, /usr/local dist-packages, pip --target, editable."""
    hook = launcher("nvctk-hook")
    pkg = REPO / "nvctk"
    layouts = {
        "deb": ("usr/bin", "usr/lib/nvctk/python"),
        "venv": ("v/bin", f"v/lib/{PYVER}/site-packages"),
        "local": ("usr/local/bin", f"usr/local/lib/{PYVER}/dist-packages"),
        "target": ("t/bin", "t"),
    }
    for name, (bindir, libdir) in layouts.items():
        b, lib = tmp_path / name / bindir, tmp_path / name / libdir
        b.mkdir(parents=True)
        lib.mkdir(parents=True, exist_ok=True)
        (lib / "nvctk").symlink_to(pkg)
        shutil.copy2(hook, b / "nvctk-hook")
        link = tmp_path / f"{name}-link"  # through a link of another name, too
        link.symlink_to(b / "nvctk-hook")
        for exe in (b / "nvctk-hook", link):
            r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and r.stderr.startswith("usage: nvctk-hook"), \
                (name, r.stderr)
    # nothing to find: a clear error, not a traceback
    lone = tmp_path / "lone" / "bin"
    lone.mkdir(parents=True)
    shutil.copy2(hook, lone / "nvctk-hook")
    r = subprocess.run([str(lone / "nvctk-hook")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr == f"nvctk-hook: cannot find the nvctk Python package near {lone}\n"


def test_python_starts_isolated_without_site(layout: Layout) -> None:
    """-I -S: no site module (its .pth processing costs twice a bare start), no user
    site, no PYTHON* variables; nvctk's directories come as an argument instead."""
    r = layout.run(["create", "--bundle", "/nonexistent", "id"], PYTHONPATH="/x")
    assert r.returncode == 1 and "/nonexistent" in r.stderr, r.stderr
    args = layout.last_args()
    assert args[:3] == ["-I", "-S", "-c"]
    assert args[4:] == [f"{REPO}\n{DEPS}\n{layout.site}", "nvctk.cli.runtime",
                        str(layout.bin / "nvctk-runtime"), "create", "--bundle", "/nonexistent",
                        "id"]


@pytest.mark.parametrize("name", ["nvctk", "nvctk-hook", "nvctk-runtime"])
def test_launchers_are_linked_without_a_dynamic_loader(name: str) -> None:
    """setup.py links them -static-pie (no loader or libc to map at each passthrough and
    each hook start); a build that quietly went back to dynamic linking fails here."""
    from nvctk.hook.elf import elf_interpreter

    fd = os.open(launcher(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        assert elf_interpreter(fd) is None
        # position-independent still (ASLR): an ET_DYN file
        assert int.from_bytes(os.pread(fd, 2, 16), "little") == 3
    finally:
        os.close(fd)
