"""Hostile images: symlinks out of the rootfs, shared propagation, LD_PRELOAD.

Each image points a path the hook touches (library dir, bin dir,
/etc/ld.so.preload, /etc/ld.so.cache, /etc, /proc/driver, firmware dir) at
canary files and dirs outside the rootfs: absolute links, relative links with
.., chains, and magic links through a procfs mounted in the rootfs. Whatever
the hook does (succeed inside the rootfs, or fail naming the step), the
canaries' bytes and mtimes and the test process's mount table stay unchanged,
and the canary library never runs outside the container. Some cases run
through real runc with our prestart hook in config.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import support.runc as _runc
from nvctk.sim.host import SimHost
from support.canary.harness import fake_container, make_bundle, make_plan, mountinfo, run_hook
from support.fs import snapshot
from support.runc import runc_bundle

runc = _runc.runc  # fixtures

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, runc)")

CANARY_SRC = Path(__file__).parents[1] / "support" / "canary" / "canary.c"
LIB = "usr/lib/x86_64-linux-gnu"


@pytest.fixture
def canary(tmp_path: Path) -> Iterator[Path]:
    """Files and dirs the image's links aim at; unchanged at the end."""
    d = tmp_path / "canary"
    for sub in ("libdir", "bindir", "etcdir", "procdir/nvidia", "fwdir", "dir"):
        (d / sub).mkdir(parents=True)
        (d / sub / "keep").write_text(f"canary {sub}\n")
    (d / "file").write_text("canary file\n")
    (d / "etcdir/ld.so.cache").write_text("canary cache\n")
    (d / "etcdir/ld.so.preload").write_text("canary preload\n")
    before = snapshot(d)
    yield d
    assert snapshot(d) == before, "a canary changed"


@pytest.fixture
def host_table() -> Iterator[None]:
    before = mountinfo()
    yield
    assert mountinfo() == before, "the host's mount table changed"


@pytest.fixture(scope="session")
def canary_lib(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(path of the compiled canary .so, the log path baked into it)."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc for the canary library")
    d = tmp_path_factory.mktemp("canarylib")
    log = str(d / "canary.log")
    so = str(d / "canary.so")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", f'-DCANARY_LOG="{log}"', "-o", so,
                    str(CANARY_SRC)], check=True)
    return so, log


def _relink(root: Path, path: str, target: str) -> None:
    p = root / path
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, p)


_CAPLESS: list[subprocess.Popen[bytes]] = []


def _capless() -> int:
    """pid of a host process (uid 0, no capabilities, dumpable) for /proc/<pid>/root."""
    if not _CAPLESS:
        _CAPLESS.append(subprocess.Popen(["setpriv", "--bounding-set=-all", "--inh-caps=-all",
                                          "sleep", "600"]))
    return _CAPLESS[0].pid


@pytest.fixture(scope="module", autouse=True)
def _reap_capless() -> Iterator[None]:
    yield
    for p in _CAPLESS:
        p.kill()
        p.wait()
    _CAPLESS.clear()


def _up(canary: Path) -> str:
    return "../" * 12 + str(canary).lstrip("/")


# name -> (how to poison the rootfs, needs a procfs at <rootfs>/proc)
CASES: dict[str, tuple[Callable[[Path, Path], None], bool]] = {
    "libdir-absolute": (lambda r, c: _relink(r, LIB, f"{c}/libdir"), False),
    "libdir-relative": (lambda r, c: _relink(r, LIB, f"{_up(c)}/libdir"), False),
    "libdir-chain": (lambda r, c: (_relink(r, LIB, "/hop1"), _relink(r, "hop1", "hop2"),
                                   _relink(r, "hop2", f"../../..{c}/libdir")), False),
    "bindir-absolute": (lambda r, c: _relink(r, "usr/bin", f"{c}/bindir"), False),
    "etc-absolute": (lambda r, c: _relink(r, "etc", f"{c}/etcdir"), False),
    "ld.so.preload": (lambda r, c: _relink(r, "etc/ld.so.preload", f"{c}/file"), False),
    "ld.so.cache-absolute": (lambda r, c: _relink(r, "etc/ld.so.cache", f"{c}/file"), False),
    "ld.so.cache-relative": (lambda r, c: _relink(r, "etc/ld.so.cache", f"{_up(c)}/file"), False),
    "proc-driver": (lambda r, c: _relink(r, "proc/driver", f"{c}/procdir"), False),
    "firmware-dir": (lambda r, c: _relink(r, "usr/lib/firmware", f"{c}/fwdir"), False),
    # magic links: a procfs in the rootfs (runc mounts one before prestart hooks)
    "libdir-proc-self-root": (lambda r, c: _relink(r, LIB, f"/proc/self/root{c}/libdir"), True),
    "ld.so.cache-proc-1-root": (lambda r, c: _relink(r, "etc/ld.so.cache",
                                                      f"/proc/1/root{c}/file"), True),
    "etc-proc-self-root": (lambda r, c: _relink(r, "etc", f"/proc/self/root{c}/etcdir"), True),
    # a capability-less host process whose root is the host's /: ldconfig could follow
    # /proc/<it>/root if the rootfs's procfs were visible to it
    "etc-proc-pid-root": (lambda r, c: _relink(r, "etc", f"/proc/{_capless()}/root{c}/etcdir"),
                          True),
}


def _poisoned(case: str) -> str:
    """The image path a case turns into a link: a failure must be because of it."""
    for prefix, path in (("libdir", f"/{LIB}"), ("bindir", "/usr/bin"), ("etc-", "/etc"),
                         ("ld.so.preload", "/etc/ld.so.preload"),
                         ("ld.so.cache", "/etc/ld.so.cache"), ("proc-driver", "/proc/driver"),
                         ("firmware", "/lib/firmware")):
        if case.startswith(prefix):
            return path
    raise AssertionError(case)


@pytest.mark.exclusive  # compares the host's whole mount table
@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_links_stay_inside(case: str, sim_host: SimHost, rootfs: Callable[..., str],
                                   canary: Path, tmp_path: Path, host_table: None,
                                   canary_lib: tuple[str, str]) -> None:
    so, log = canary_lib
    root = Path(rootfs())
    # the image also preloads the canary everywhere it can
    shutil.copy(so, root / "canary.so")
    (root / "etc/ld.so.preload").write_text("/canary.so\n")
    poison, with_proc = CASES[case]
    poison(root, canary)
    plan = make_plan(sim_host)
    bundle = make_bundle(str(tmp_path / "bundle"), str(root), plan,
                         spec_extra={"process": {"args": ["sh"], "cwd": "/",
                                                 "env": ["LD_PRELOAD=/canary.so"]}})
    pre = f"mount -t proc proc {root}/proc" if with_proc else None
    with fake_container(pre=pre) as pid:
        r = run_hook(bundle, pid)
    print(case, r.returncode, r.stderr.strip())
    if r.returncode != 0:
        # refusing is fine, but only because of the poisoned path (a hook that failed
        # for any other reason would make the canary checks below prove nothing)
        assert r.returncode == 1 and r.stderr.startswith("nvctk-hook: prestart: step "), r.stderr
        assert _poisoned(case) in r.stderr, r.stderr
    else:
        assert "prestart done" in bundle.log_text(), bundle.log_text()
    assert not os.path.exists(log), Path(log).read_text()  # nothing on the host loaded it


def _dynamic_true(root: Path) -> str:
    """A dynamically linked program in the image (busybox is static: no preload)."""
    shutil.copy("/usr/bin/true", root / "usr/bin/dyn-true")
    return "/usr/bin/dyn-true"


@pytest.mark.exclusive  # compares the host's whole mount table
@pytest.mark.slow
def test_runc_ld_preload_runs_only_inside(sim_host: SimHost, rootfs: Callable[..., str],
                                          tmp_path: Path, canary_lib: tuple[str, str],
                                          runc: Callable[[Path], subprocess.CompletedProcess[str]],
                                          host_table: None) -> None:
    so, log = canary_lib
    root = Path(rootfs())
    shutil.copy(so, root / "canary.so")
    inside_log = root / log.lstrip("/")
    inside_log.parent.mkdir(parents=True)
    prog = _dynamic_true(root)
    bundle = runc_bundle(tmp_path, root, sim_host, [prog], ["LD_PRELOAD=/canary.so"])
    r = runc(bundle)
    assert r.returncode == 0, r.stderr + (bundle / "nvctk.log").read_text()
    assert "prestart done" in (bundle / "nvctk.log").read_text()
    assert not os.path.exists(log), "a host-side process loaded the image's LD_PRELOAD"
    st = os.stat(root)
    records = inside_log.read_text().splitlines()
    assert records, "the container's own process should have loaded the canary"
    for rec in records:
        _, exe, dev_ino = rec.split()
        assert dev_ino == f"{st.st_dev}:{st.st_ino}", rec  # root = the container's rootfs
        assert exe == prog


@pytest.mark.exclusive  # compares the host's whole mount table
@pytest.mark.slow
@pytest.mark.parametrize("case", ["ld.so.cache-proc-1-root", "libdir-absolute", "etc-absolute"])
def test_runc_hostile_rshared(case: str, sim_host: SimHost, rootfs: Callable[..., str],
                              tmp_path: Path, canary: Path, canary_lib: tuple[str, str],
                              runc: Callable[[Path], subprocess.CompletedProcess[str]],
                              host_table: None) -> None:
    so, log = canary_lib
    root = Path(rootfs())
    shutil.copy(so, root / "canary.so")
    (root / "etc/ld.so.preload").write_text("/canary.so\n")
    CASES[case][0](root, canary)
    bundle = runc_bundle(tmp_path, root, sim_host, ["/usr/bin/busybox", "true"],
                          ["LD_PRELOAD=/canary.so"])
    spec = json.loads((bundle / "config.json").read_text())
    spec["linux"]["rootfsPropagation"] = "rshared"
    (bundle / "config.json").write_text(json.dumps(spec))
    r = runc(bundle)
    hook_log = (bundle / "nvctk.log").read_text()
    print(case, r.returncode, r.stderr.strip()[-300:])
    if r.returncode != 0:
        assert "nvctk-hook: prestart: step " in r.stderr, r.stderr + hook_log
        assert _poisoned(case) in r.stderr, r.stderr + hook_log
    else:
        assert "prestart done" in hook_log, hook_log
    assert not os.path.exists(log)
