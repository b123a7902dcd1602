"""nvctk.host.cache: the host inventory cache that spares a GPU create pynvml and NVML.

Real pynvml over the simulated NVML. Most tests share one module-scoped 2-GPU sim
and each gets its own state dir; the tests that change the sim undo the change
(the mock NVML enumerates at every nvmlInit, so one process sees the changes).
"""

from __future__ import annotations

import copy
import os
import pickle
import shutil
import stat
import subprocess
import sys
import sysconfig
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nvctk.base import jsonio
from nvctk.base.errors import DriverError
from nvctk.host import cache as nvhost
from nvctk.host import inventory, nvml
from nvctk.host.cache import CACHE_FILE, load_host
from nvctk.host.inventory import HostInfo
from nvctk.sim import host as simhost
from nvctk.sim.topology import make_topology

REPO = Path(__file__).resolve().parents[2]
# what the cache-hit path must not import (the create's start-up budget)
FORBIDDEN = ("pynvml", "nvctk.host.nvml", "ctypes", "dataclasses", "typing", "re", "json",
             "collections", "functools", "contextlib", "hashlib", "tempfile", "enum")


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> simhost.SimHost:
    if os.geteuid() != 0:
        pytest.skip("needs root (the simulated host has device nodes)")
    return simhost.init(str(tmp_path_factory.mktemp("hostcache") / "host"), make_topology(gpus=2))


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state" / "nvctk"  # two levels that do not exist yet


def cache_file(state: Path) -> Path:
    return state / CACHE_FILE


# --- miss, hit, the file --------------------------------------------------------------------


def test_miss_then_hit(sim: simhost.SimHost, state: Path) -> None:
    live = nvml.query_host(sim.root)
    h1, from_cache1 = load_host(sim.root, str(state))
    assert (h1, from_cache1) == (live, False)
    st = os.stat(cache_file(state))
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
    assert os.listdir(state) == [CACHE_FILE]  # no temp file left behind
    data = jsonio.loads(cache_file(state).read_bytes())
    assert data["version"] == 1 and data["host"] == live.to_dict()
    assert data["stamp"] == nvhost.host_stamp(sim.root)

    h2, from_cache2 = load_host(sim.root, str(state))
    assert (h2, from_cache2) == (live, True)
    assert len(h2.gpus) == 2 and h2.gpu(live.gpus[1].uuid.lower()) == live.gpus[1]
    assert os.stat(cache_file(state)).st_ino == st.st_ino  # a hit writes nothing


CHILD = """
import sys
sys.path[:0] = [{repo!r}, {site!r}]
from nvctk.host.cache import load_host
from nvctk.base import jsonio
host, hit = load_host({root!r}, {state!r})
bad = sorted(m for m in {forbidden!r} if m in sys.modules)
sys.stdout.write(jsonio.dumps({{"hit": hit, "imported": bad, "host": host.to_dict()}}))
"""


@pytest.mark.parametrize("primed", [True, False], ids=["hit", "miss"])
def test_hit_never_imports_pynvml(sim: simhost.SimHost, state: Path, primed: bool) -> None:
    """In a fresh `python3 -I -S` (as nvctk-runtime runs): a hit imports none of the
    heavy modules; a miss does import pynvml (so the check can fail)."""
    live = nvml.query_host(sim.root)
    if primed:
        load_host(sim.root, str(state))
    code = CHILD.format(repo=str(REPO), site=sysconfig.get_paths()["purelib"], root=sim.root,
                        state=str(state), forbidden=FORBIDDEN)
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = jsonio.loads(r.stdout)
    assert out["host"] == live.to_dict()
    if primed:
        assert out == {"hit": True, "imported": [], "host": live.to_dict()}
    else:
        assert out["hit"] is False and "pynvml" in out["imported"]


# --- what invalidates ---------------------------------------------------------------------

Undo = list[Callable[[], object]]


def _rewrite_version(root: Path, undo: Undo) -> Path:
    f = root / "proc/driver/nvidia/version"
    old = f.read_bytes()
    undo.append(lambda: f.write_bytes(old))
    f.write_bytes(old.replace(b"550.54.15", b"550.54.14"))
    return root


def _rewrite_information(root: Path, undo: Undo) -> Path:
    [f, *_] = sorted(root.glob("proc/driver/nvidia/gpus/*/information"))
    old = f.read_bytes()
    undo.append(lambda: f.write_bytes(old))
    f.write_bytes(old.replace(b"IRQ:", b"IRQ: 1"))
    return root


def _remove_gpu_dir(root: Path, undo: Undo) -> Path:  # the module lets go of a GPU
    [*_, d] = sorted(root.glob("proc/driver/nvidia/gpus/*"))
    keep = root / "gpu-dir-saved"
    d.rename(keep)
    undo.append(lambda: keep.rename(d))
    return root


def _remove_node(root: Path, undo: Undo) -> Path:
    node = root / "dev/nvidia1"
    rdev = os.lstat(node).st_rdev
    undo.append(lambda: os.mknod(node, 0o666 | stat.S_IFCHR, rdev))
    node.unlink()
    return root


def _renumber_node(root: Path, undo: Undo) -> Path:
    node = root / "dev/nvidia1"
    st = os.lstat(node)

    def mknod(rdev: int) -> None:
        node.unlink()
        os.mknod(node, 0o666 | stat.S_IFCHR, rdev)

    undo.append(lambda: mknod(st.st_rdev))
    mknod(os.makedev(os.major(st.st_rdev), 77))
    return root


def _add_caps_dir(root: Path, undo: Undo) -> Path:
    d = root / "proc/driver/nvidia/capabilities/gpu0/mig/gi1"
    undo.append(lambda: shutil.rmtree(root / "proc/driver/nvidia/capabilities/gpu0"))
    d.mkdir(parents=True)
    return root


def _touch_ldcache(root: Path, undo: Undo) -> Path:
    f = root / "etc/ld.so.cache"
    st = os.stat(f)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    return root


def _replace_ldcache(root: Path, undo: Undo) -> Path:  # as ldconfig does: a new inode
    f = root / "etc/ld.so.cache"
    tmp = root / "etc/ld.so.cache~"
    shutil.copy2(f, tmp)  # same size and mtime: only the inode tells
    os.replace(tmp, f)
    return root


def _other_root(root: Path, undo: Undo) -> Path:
    link = root.parent / "same-host-other-path"
    link.symlink_to(root)
    undo.append(link.unlink)
    return link


def _new_boot(root: Path, undo: Undo) -> Path:
    Path(nvhost.BOOT_ID).write_text("boot-b\n")
    return root


def _unrelated_files(root: Path, undo: Undo) -> Path:  # control: no ingredient changes
    params = root / "proc/driver/nvidia/params"
    old = params.read_bytes()
    added = [root / "dev/null-ish", root / "usr/share/nvctk-test-file"]

    def restore() -> None:
        params.write_bytes(old)
        for f in added:
            f.unlink()

    undo.append(restore)
    for f in added:
        f.write_text("")
    params.write_bytes(old + b"Extra: 1\n")
    return root


@pytest.mark.parametrize(
    ("change", "gpus", "hit"),
    [
        (_rewrite_version, 2, False),
        (_rewrite_information, 2, False),
        (_remove_gpu_dir, 2, False),
        (_remove_node, 1, False),  # the mock (as NVML) no longer enumerates GPU 1
        (_renumber_node, 2, False),  # the mock only stats the node; NVML would not open it
        (_add_caps_dir, 2, False),
        (_touch_ldcache, 2, False),
        (_replace_ldcache, 2, False),
        (_other_root, 2, False),
        (_new_boot, 2, False),
        (_unrelated_files, 2, True),
    ],
    ids=lambda v: v.__name__.strip("_") if callable(v) else None,
)
def test_stamp_ingredient_invalidates(sim: simhost.SimHost, state: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch,
                                      change: Callable[[Path, Undo], Path], gpus: int,
                                      hit: bool) -> None:
    boot = tmp_path / "boot_id"
    boot.write_text("boot-a\n")
    monkeypatch.setattr(nvhost, "BOOT_ID", str(boot))
    root = Path(sim.root)
    assert load_host(sim.root, str(state))[1] is False
    assert load_host(sim.root, str(state))[1] is True
    undo: Undo = []
    try:
        new_root = change(root, undo)
        got, from_cache = load_host(str(new_root), str(state))
        assert from_cache is hit
        assert len(got.gpus) == gpus
        if not hit:  # the file now describes the new state: the next create hits
            assert load_host(str(new_root), str(state)) == (got, True)
    finally:
        for fn in reversed(undo):
            fn()
    assert len(nvml.query_host(sim.root).gpus) == 2  # the sim is whole again


def test_stamp_is_plain_and_tolerates_a_missing_root(tmp_path: Path) -> None:
    stamp = nvhost.host_stamp(str(tmp_path / "nothing"))
    assert jsonio.loads(jsonio.dumps(stamp)) == stamp
    assert stamp[0] == str(tmp_path / "nothing")
    assert stamp[1] == [None, [None], [None], [None], None]


def test_stamp_of_another_root_covers_the_hosts_own_proc_and_dev(tmp_path: Path) -> None:
    """A driver container's root: the real driver still reads the host's /proc and /dev."""
    assert nvhost.host_stamp(str(tmp_path))[2] == nvhost.host_stamp("/")[1]
    assert nvhost.host_stamp("/")[2] is None


# --- MIG ----------------------------------------------------------------------------------


def test_mig_host_is_never_served_from_cache(sim_host_mig: simhost.SimHost, state: Path) -> None:
    live = nvml.query_host(sim_host_mig.root)
    assert any(g.mig_enabled for g in live.gpus)
    for _ in range(3):
        assert load_host(sim_host_mig.root, str(state)) == (live, False)
    # the file is kept (and not rewritten while NVML's answer is the same)
    ino = os.stat(cache_file(state)).st_ino
    assert load_host(sim_host_mig.root, str(state)) == (live, False)
    assert os.stat(cache_file(state)).st_ino == ino
    assert HostInfo.from_dict(jsonio.loads(cache_file(state).read_bytes())["host"]) == live


# --- bad files, unwritable dirs, fresh, NVML failing --------------------------------------


def _valid(sim: simhost.SimHost, tmp_path: Path) -> bytes:
    other = tmp_path / "other"
    load_host(sim.root, str(other))
    return (other / CACHE_FILE).read_bytes()


def _doc(sim: simhost.SimHost, tmp_path: Path, **changes: Any) -> bytes:
    d = jsonio.loads(_valid(sim, tmp_path))
    d.update(changes)
    return jsonio.dumps(d).encode()


def _gpu_field(sim: simhost.SimHost, tmp_path: Path, key: str, value: Any) -> bytes:
    d = jsonio.loads(_valid(sim, tmp_path))
    d["host"]["gpus"][0][key] = value
    return jsonio.dumps(d).encode()


BadFile = Callable[[simhost.SimHost, Path, Path], None]


def _write(content: Callable[[simhost.SimHost, Path], bytes], mode: int = 0o600) -> BadFile:
    def make(sim: simhost.SimHost, tmp_path: Path, f: Path) -> None:
        f.write_bytes(content(sim, tmp_path))
        os.chmod(f, mode)

    return make


def _symlink(sim: simhost.SimHost, tmp_path: Path, f: Path) -> None:
    (tmp_path / "target").write_bytes(_valid(sim, tmp_path))
    os.chmod(tmp_path / "target", 0o600)
    f.symlink_to(tmp_path / "target")


def _not_ours(sim: simhost.SimHost, tmp_path: Path, f: Path) -> None:
    _write(_valid)(sim, tmp_path, f)
    os.chown(f, 12345, 12345)


BAD_FILES: dict[str, tuple[BadFile, bool]] = {  # name -> (make it, rewritten afterwards)
    "corrupt-json": (_write(lambda s, t: b'{"version": 1, "stamp": ['), True),
    "empty": (_write(lambda s, t: b""), True),
    "not-utf8": (_write(lambda s, t: b"\xff\xfe\x00garbage"), True),
    "a-list": (_write(lambda s, t: b"[1, 2]"), True),
    "wrong-version": (_write(lambda s, t: _doc(s, t, version=2)), True),
    "version-true": (_write(lambda s, t: _doc(s, t, version=True)), True),
    "other-stamp": (_write(lambda s, t: _doc(s, t, stamp=["elsewhere"])), True),
    "no-host": (_write(lambda s, t: _doc(s, t, host=None)), True),
    "host-missing-gpus": (_write(lambda s, t: _doc(s, t, host={"driver_version": "1",
                                                               "cuda_version": "1"})), True),
    "memory-as-string": (_write(lambda s, t: _gpu_field(s, t, "memory_mib", "81920")), True),
    "mig-enabled-as-int": (_write(lambda s, t: _gpu_field(s, t, "mig_enabled", 0)), True),
    "group-writable": (_write(_valid, 0o620), True),
    "world-readable": (_write(_valid, 0o644), True),
    "symlink": (_symlink, True),
    "fifo": (lambda s, t, f: os.mkfifo(f, 0o600), True),
    "directory": (lambda s, t, f: f.mkdir(), False),
    "not-ours": (_not_ours, True),
}


@pytest.mark.parametrize("bad", sorted(BAD_FILES))
def test_bad_cache_file_is_ignored(sim: simhost.SimHost, state: Path, tmp_path: Path,
                                   bad: str) -> None:
    make, rewritten = BAD_FILES[bad]
    live = nvml.query_host(sim.root)
    state.mkdir(parents=True)
    make(sim, tmp_path, cache_file(state))
    assert load_host(sim.root, str(state)) == (live, False)
    assert load_host(sim.root, str(state)) == (live, rewritten)
    if rewritten:
        st = os.lstat(cache_file(state))
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.geteuid()
    assert [n for n in os.listdir(state) if n != CACHE_FILE] == []  # no temp files left


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Any:
    d = tmp_path / "ro"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs: {r.stderr.decode().strip()}")
    yield d
    subprocess.run(["umount", str(d)], check=True)


@pytest.mark.parametrize("where", ["under-a-file", "in-proc", "read-only-fs"])
def test_unwritable_state_dir_still_gives_the_host(sim: simhost.SimHost, tmp_path: Path,
                                                  request: pytest.FixtureRequest,
                                                  where: str) -> None:
    if where == "under-a-file":
        (tmp_path / "file").write_text("")
        state = tmp_path / "file" / "nvctk"
    elif where == "in-proc":
        state = Path("/proc/nvctk-host-cache-test")
    else:
        state = request.getfixturevalue("read_only_dir")
    live = nvml.query_host(sim.root)
    for _ in range(2):
        assert load_host(sim.root, str(state)) == (live, False)
    assert not os.path.lexists(state / CACHE_FILE)


def test_fresh_asks_nvml_and_refreshes(sim: simhost.SimHost, state: Path) -> None:
    load_host(sim.root, str(state))
    ino = os.stat(cache_file(state)).st_ino
    live = nvml.query_host(sim.root)
    assert load_host(sim.root, str(state), fresh=True) == (live, False)
    # NVML said what the file says: not rewritten (a request naming an unknown id,
    # which retries fresh, must not cost every create a rewrite)
    assert os.stat(cache_file(state)).st_ino == ino
    assert load_host(sim.root, str(state)) == (live, True)


def test_driver_error_is_not_cached(sim: simhost.SimHost, state: Path, tmp_path: Path) -> None:
    nothing = tmp_path / "no-driver"
    nothing.mkdir()
    with pytest.raises(DriverError, match=r"etc/ld\.so\.cache"):
        load_host(str(nothing), str(state))
    assert not state.exists()
    # a cache for another root in the same state dir survives and still serves that root
    load_host(sim.root, str(state))
    before = cache_file(state).read_bytes()
    with pytest.raises(DriverError):
        load_host(str(nothing), str(state))
    assert cache_file(state).read_bytes() == before
    assert load_host(sim.root, str(state))[1] is True


def test_concurrent_cold_creates(sim: simhost.SimHost, state: Path) -> None:
    """Creates racing on an empty cache all get the host; the file ends up whole."""
    code = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(REPO)!r}, {sysconfig.get_paths()["purelib"]!r}]
        from nvctk.host.cache import load_host
        from nvctk.base import jsonio
        sys.stdout.write(jsonio.dumps(load_host({sim.root!r}, {str(state)!r})[0].to_dict()))
    """)
    procs = [subprocess.Popen([sys.executable, "-I", "-S", "-c", code], stdout=subprocess.PIPE)
             for _ in range(4)]
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    live = nvml.query_host(sim.root).to_dict()
    assert all(jsonio.loads(o) == live for o in outs)
    assert os.listdir(state) == [CACHE_FILE]
    assert load_host(sim.root, str(state))[1] is True


# --- the records --------------------------------------------------------------------------


def test_records_round_trip_and_stay_immutable(sim_host_mig: simhost.SimHost) -> None:
    live = nvml.query_host(sim_host_mig.root)
    assert type(live) is HostInfo and type(live.gpus[0]) is inventory.GpuInfo
    back = HostInfo.from_dict(jsonio.loads(jsonio.dumps(live.to_dict())))
    assert back == live and hash(back) == hash(live)
    assert isinstance(back.gpus, tuple) and isinstance(back.gpus[0].mig_devices, tuple)
    assert copy.deepcopy(live) == live == pickle.loads(pickle.dumps(live))
    assert live.replace(cuda_version="1.0").cuda_version == "1.0"
    g0 = live.gpus[0]
    assert g0.mig_devices and g0.mig_devices[0].profile == "3g.40gb"
    with pytest.raises(AttributeError):
        g0.name = "x"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del live.gpus  # type: ignore[misc]
    assert list(live.to_dict()) == ["driver_version", "cuda_version", "gpus"]


def test_hit_serves_the_file_and_info_ignores_it(sim: simhost.SimHost, tmp_path: Path) -> None:
    """A hit returns what the file says (no NVML); `nvctk info` asks NVML all the same."""
    from nvctk.cli.info import info_dict

    state = Path(sim.root) / "run/nvctk"  # the sim's configured state dir
    live = nvml.query_host(sim.root)
    forged = live.replace(gpus=(live.gpus[0].replace(name="Forged GPU"), *live.gpus[1:]))
    doc = {"version": 1, "stamp": nvhost.host_stamp(sim.root), "host": forged.to_dict()}
    cache_file(state).write_text(jsonio.dumps(doc))
    os.chmod(cache_file(state), 0o600)
    try:
        assert load_host(sim.root, str(state)) == (forged, True)
        assert info_dict(sim.root)["gpus"][0]["name"] == live.gpus[0].name != "Forged GPU"
        # fresh (the planner's retry): NVML's answer differs from the file, which is rewritten
        assert load_host(sim.root, str(state), fresh=True) == (live, False)
        assert load_host(sim.root, str(state)) == (live, True)
    finally:
        cache_file(state).unlink()
