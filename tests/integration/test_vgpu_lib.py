"""libvgpu over the mock libcuda/NVML: caps, allocation paths, entry-point
routing, queries, device mapping, fail-closed config, the limits file."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H

from nvctk.sim.state import read_state
from nvctk.vgpu import ledger
from nvctk.vgpu import limits as vgpu

MIB = H.MIB
RESERVE = 64 * MIB  # the mock's and libvgpu's default per-context reserve


@pytest.fixture(scope="session")
def built() -> None:
    H.build()


@pytest.fixture(scope="session")
def driver(built: None, tmp_path_factory: pytest.TempPathFactory) -> H.Driver:
    if os.geteuid() != 0:
        pytest.skip("needs root (device nodes)")
    return H.make_driver(tmp_path_factory.mktemp("vgpu-sim"), gpus=2, memory_mib=4096)


@pytest.fixture
def env(driver: H.Driver, tmp_path: Path) -> dict[str, str]:
    return driver.env(tmp_path / "state", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"))


def ok(cp: subprocess.CompletedProcess[str]) -> dict[str, list[list[str]]]:
    assert cp.returncode == 0, cp.stdout + cp.stderr
    return H.parse(cp.stdout)


# ---- the library itself ----


def test_glibc_versions_at_most_2_17(built: None) -> None:
    out = subprocess.run(["objdump", "-T", str(H.LIB)], capture_output=True, text=True, check=True)
    versions = set(re.findall(r"GLIBC_([0-9.]+)", out.stdout))
    assert versions
    too_new = [v for v in versions if tuple(map(int, v.split("."))) > (2, 17)]
    assert not too_new, out.stdout


def test_exports_only_interposed_names(built: None) -> None:
    out = subprocess.run(["objdump", "-T", str(H.LIB)], capture_output=True, text=True, check=True)
    defined = {
        line.split()[-1] for line in out.stdout.splitlines() if " .text" in line and "DF" in line
    }
    assert "dlsym" in defined and "cuGetProcAddress_v2" in defined and "cuMemAlloc_v2" in defined
    assert all(n == "dlsym" or n.startswith(("cu", "nvml")) for n in defined), defined
    assert not any(n.startswith("vgpu_") for n in defined)


# ---- caps and allocation paths ----


@pytest.mark.parametrize("mode", ["--proc", "--dlsym", "--global"])
def test_exact_cap(env: dict[str, str], mode: str) -> None:
    cap = 256 * MIB
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "256m"
    room = cap - RESERVE
    r = ok(H.probe(env, "init", "ctx", "0", "alloc", str(room), "alloc", "1", "free", "alloc", str(room - 4096), "alloc", "4096", "alloc", "1", mode=mode))
    assert [x[0] for x in r["alloc"]] == ["0", "2", "0", "0", "2"]


def test_every_allocation_path_counts_and_frees(env: dict[str, str]) -> None:
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "256m"
    room = 256 * MIB - RESERVE  # 192 MiB
    cases = [
        (["alloc", str(room)], ["free"]),
        (["managed", str(room)], ["free"]),
        (["async", str(room)], ["freeasync"]),
        (["pool", str(room)], ["freeasync"]),
        (["vmm", str(room)], ["vmmrelease"]),
        # pitch: width 1000 is padded to a 1024-byte pitch: 192 Ki rows fill the room
        (["pitch", "1000", str(room // 1024)], ["free"]),
        (["array", str(room // 4 // 1024), "1024"], ["arraydestroy"]),  # float, 1 ch
        (["array3d", "1024", "64", str(room // 4 // 1024 // 64)], ["arraydestroy"]),  # u8 x4
    ]
    for make, undo in cases:
        args = ["init", "ctx", "0", *make, "alloc", "1", *undo, "alloc", str(room), "free"]
        r = ok(H.probe(env, *args))
        cmd = make[0]
        k = 1 if cmd == "alloc" else 0
        assert r[cmd][0][0] == "0", (cmd, r)
        assert r["alloc"][k][0] == "2", f"{cmd}: one more byte after filling the cap must fail"
        assert r["alloc"][k + 1][0] == "0", f"{cmd}: freeing must credit the whole size back"
    r = ok(H.probe(env, "init", "ctx", "0", "pitch", "1000", "10"))
    assert r["pitch"][0] == ["0", "1024"]
    # host-located VMM memory is not device memory
    r = ok(H.probe(env, "init", "ctx", "0", "vmmhost", str(1024 * MIB), "alloc", str(room)))
    assert r["vmmhost"][0][0] == "0" and r["alloc"][0][0] == "0"
    # mipmapped: level sizes summed (1024x1024 float: 4 MiB + 1 MiB + 256 KiB ...)
    r = ok(H.probe(env, "init", "ctx", "0", "alloc", str(room - 5 * MIB), "mipmap", "1024", "1024", "2", "mipmap", "1024", "1024", "3"))
    assert r["mipmap"][0][0] == "0" and r["mipmap"][1][0] == "2"


def test_context_reserve_counts(env: dict[str, str]) -> None:
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "200m"
    # primary ctx (64) + created ctx (64) + 72 MiB = 200 MiB
    r = ok(H.probe(env, "init", "ctx", "0", "ctxcreate", "0", "alloc", str(72 * MIB), "alloc", "1", "ctxdestroy", "alloc", str(64 * MIB)))
    assert [x[0] for x in r["alloc"]] == ["0", "2", "0"]
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "32m"
    r = H.parse(H.probe(env, "init", "ctx", "0").stdout)
    assert r["ctx"][0][0] == "2"  # the context alone is over the cap


def test_forked_child_cannot_touch_its_parents_usage(env: dict[str, str]) -> None:
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "1g"
    r = ok(H.probe(env, "init", "ctx", "0", "alloc", str(100 * MIB), "meminfo", "forkchild",
                   "meminfo", "free", "meminfo"))
    assert r["childalloc"][0][0] == "2"  # CUDA_ERROR_OUT_OF_MEMORY
    assert r["forkchild"] == [["0"]]
    before, after_child, after_free = (int(m[1]) for m in r["meminfo"])
    assert after_child == before  # the child's free and exit credited nothing
    assert after_free == before + 100 * MIB


def _assert_every_bad_call_refused(r: dict[str, list[list[str]]]) -> None:
    """The probe's answers to test_bad_frees_never_credit's bad calls."""
    # the driver refused every bad call (freeing 0 is its documented no-op)
    assert r["freelast"] == [["0"], ["1"]] and r["freeasynclast"][0][0] != "0"
    assert r["freeoff"][0][0] != "0"
    assert [x[0] != "0" for x in r["freeraw"]] == [True, False]
    assert all(x[0] != "0" for x in r["freeasyncraw"] + r["arraydestroyraw"])
    assert r["arraydestroylast"][0][0] == "0" and r["arraydestroylast"][1][0] != "0"
    assert r["vmmreleaselast"][0][0] == "0" and r["vmmreleaselast"][1][0] != "0"
    assert r["ctxdestroy"][0][0] == "0" and r["ctxdestroy"][1][0] != "0"
    assert [x[0] != "0" for x in r["release"]] == [False, False, True]  # "ctx" twice: two retains


def test_bad_frees_never_credit(env: dict[str, str], tmp_path: Path) -> None:
    """No underflow, ever: a double free (sync and async), a free of an unknown
    or an interior pointer, destroying an unknown or already destroyed array, a
    double VMM release, a double context destroy and one primary-context release
    too many credit nothing. The container's usage (this process's and a
    neighbour's) stays exact and never wraps."""
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "1g"
    cap = 1024 * MIB
    pre = {**env, "LD_PRELOAD": str(H.LIB)}
    holder = subprocess.Popen([str(H.PROBE), "init", "ctx", "0", "alloc", str(256 * MIB), "wait"], env=pre,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    abuser = None
    try:
        assert holder.stdout is not None and holder.stdin is not None
        while "ready" not in holder.stdout.readline():
            pass
        neighbour = RESERVE + 256 * MIB
        bad = [
            "freelast", "freeasynclast",  # the 50 MiB pointer again: double frees
            "drop", "freeoff", "4096",  # an interior pointer of the 100 MiB one
            "freeraw", "0x1234", "freeasyncraw", "0x1234", "freeraw", "0", "freeasyncraw", "0", "meminfo",
            "array", "1024", "1024", "arraydestroylast", "arraydestroylast",
            "arraydestroyraw", "0x1234", "arraydestroyraw", "0", "meminfo",
            "vmm", str(8 * MIB), "vmmreleaselast", "vmmreleaselast", "meminfo",
            "ctxcreate", "0", "ctxdestroy", "ctxdestroy", "ctx", "0", "meminfo",
        ]
        args = ["init", "ctx", "0", "alloc", str(100 * MIB), "alloc", str(50 * MIB), "meminfo", "freelast",
                "meminfo", *bad, "wait", "free", "release", "release", "release", "nvmlmem", "0"]
        abuser = subprocess.Popen([str(H.PROBE), *args], env=pre, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        assert abuser.stdout is not None
        head = ""
        while not head.endswith("ready 0\n"):
            line = abuser.stdout.readline()
            assert line, head  # it exited early
            head += line
        # mid-run, from the accounting file: both processes' usage, exactly
        assert sum(u.used for u in ledger.read_usage(tmp_path / "cache").values()) == neighbour + RESERVE + 100 * MIB
        tail, _ = abuser.communicate("\n", timeout=30)
        assert abuser.returncode == 0, head + tail
        r = H.parse(head + tail)
        _assert_every_bad_call_refused(r)
        free = [int(m[1]) for m in r["meminfo"]]
        assert free[0] == cap - neighbour - RESERVE - 150 * MIB
        assert free[1:] == [cap - neighbour - RESERVE - 100 * MIB] * (len(free) - 1), free
        # after the real free and the last release only the neighbour's usage is left
        rc, total, used, nfree, _t2, used2 = map(int, r["nvmlmem"][0])
        assert (rc, total, used, nfree, used2) == (0, cap, neighbour, cap - neighbour, neighbour)
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.wait(timeout=30) == 0
    finally:
        holder.kill()
        holder.wait()
        if abuser is not None:
            abuser.kill()
            abuser.wait()
    assert sum(u.used for u in ledger.read_usage(tmp_path / "cache").values()) == 0


@pytest.mark.parametrize("create, destroy", [
    (["ctxcreate", "0"], ["ctxdestroy"]),  # a created context, destroyed
    ([], ["release"]),  # the primary context's last release destroys it
])
def test_destroying_a_context_credits_what_the_driver_freed_with_it(
        env: dict[str, str], create: list[str], destroy: list[str]) -> None:
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "1g"
    r = ok(H.probe(env, "init", "ctx", "0", "meminfo", *create, "alloc", str(100 * MIB),
                   "array", "1024", "1024", "meminfo", *destroy, "ctx", "0", "meminfo"))
    start, held, after = (int(m[1]) for m in r["meminfo"])  # free bytes under the cap
    assert start - held >= 100 * MIB + 4 * MIB  # the pointer and the 4 MiB float array
    # the driver freed them with their context: back to one primary context's reserve
    assert after == start


def test_a_refused_free_keeps_the_allocation_tied_to_its_context(env: dict[str, str]) -> None:
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "1g"
    r = ok(H.probe(env, "init", "ctx", "0", "meminfo", "ctxcreate", "0", "alloc", str(100 * MIB),
                   "freeasyncbadstream", "ctxdestroy", "ctx", "0", "meminfo"))
    assert r["freeasyncbadstream"][0][0] != "0"  # the driver refused it
    start, after = (int(m[1]) for m in r["meminfo"])
    assert after == start  # still credited when its context went


def test_queries_report_the_cap(env: dict[str, str], driver: H.Driver) -> None:
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "1.5g"
    cap = 1536 * MIB
    r = ok(H.probe(env, "init", "ctx", "0", "alloc", str(100 * MIB), "meminfo", "totalmem", "0", "nvmlmem", "0"))
    free, total = map(int, r["meminfo"][0][1:])
    assert total == cap and free == cap - RESERVE - 100 * MIB
    assert r["totalmem"][0] == ["0", str(cap)]
    rc, t, used, fr, t2, used2 = map(int, r["nvmlmem"][0])
    assert (rc, t, used, fr, t2, used2) == (0, cap, RESERVE + 100 * MIB, cap - RESERVE - 100 * MIB, cap, RESERVE + 100 * MIB)
    # a cap above the physical memory reports the physical memory
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "64g"
    r = ok(H.probe(env, "init", "totalmem", "0"))
    assert r["totalmem"][0] == ["0", str(driver.memory)]


def test_nvidia_smi_shows_cap(env: dict[str, str], driver: H.Driver) -> None:
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "300m"
    env["LD_PRELOAD"] = str(H.LIB)
    out = subprocess.run([str(driver.root / "bin" / "nvidia-smi")], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert re.search(r"/\s*300MiB", out.stdout), out.stdout
    assert "4096MiB" not in out.stdout


@contextmanager
def _holding(env: dict[str, str], nbytes: int) -> Iterator[Callable[[], int]]:
    """A probe under libvgpu holding nbytes on GPU 0, ready when the block starts;
    the block's finish() tells it to exit and returns its status. Killed on leaving."""
    holder = subprocess.Popen([str(H.PROBE), "init", "ctx", "0", "alloc", str(nbytes), "wait"],
                              env={**env, "LD_PRELOAD": str(H.LIB)}, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        while "ready" not in holder.stdout.readline():
            pass
        stdin = holder.stdin

        def finish() -> int:
            stdin.write("\n")
            stdin.flush()
            return holder.wait(timeout=30)

        yield finish
    finally:
        holder.kill()


def test_usage_shared_across_processes(env: dict[str, str], tmp_path: Path) -> None:
    """One cap per container: a second process sees the first one's usage."""
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "512m"
    with _holding(env, 256 * MIB) as finish:
        r = ok(H.probe(env, "init", "ctx", "0", "fill", str(MIB)))
        assert int(r["fill"][0][1]) == 512 * MIB - 2 * RESERVE - 256 * MIB
        usage = ledger.read_usage(tmp_path / "cache")
        assert sum(u.used for u in usage.values()) == 256 * MIB + RESERVE  # the holder only
        assert finish() == 0
    assert sum(u.used for u in ledger.read_usage(tmp_path / "cache").values()) == 0


def test_stricter_limit_across_processes_holds(env: dict[str, str]) -> None:
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "256m"
    holder = subprocess.Popen([str(H.PROBE), "init", "wait"], env={**env, "LD_PRELOAD": str(H.LIB)},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        while "ready" not in holder.stdout.readline():
            pass
        env["CUDA_DEVICE_MEMORY_LIMIT"] = "1g"
        cp = H.probe(env, "init", "ctx", "0", "meminfo")
        r = ok(cp)
        assert int(r["meminfo"][0][2]) == 256 * MIB
        assert "stricter" in cp.stderr
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=30)
    finally:
        holder.kill()
    # no latching: once the strict process is gone its limit goes with it
    r = ok(H.probe(env, "init", "ctx", "0", "meminfo"))
    assert int(r["meminfo"][0][2]) == 1024 * MIB


# ---- device mapping ----


def test_per_device_caps_follow_uuid_under_reordering(env: dict[str, str], driver: H.Driver) -> None:
    env.update(CUDA_DEVICE_MEMORY_LIMIT_0="256m", CUDA_DEVICE_MEMORY_LIMIT_1="512m")
    r = ok(H.probe(env, "init", "totalmem", "0", "totalmem", "1"))
    assert [x[1] for x in r["totalmem"]] == [str(256 * MIB), str(512 * MIB)]
    r = ok(H.probe({**env, "CUDA_VISIBLE_DEVICES": "1,0"}, "init", "totalmem", "0", "totalmem", "1"))
    assert [x[1] for x in r["totalmem"]] == [str(512 * MIB), str(256 * MIB)]
    r = ok(H.probe({**env, "CUDA_VISIBLE_DEVICES": driver.uuids[1]}, "init", "totalmem", "0", "ctx", "0", "fill", str(MIB)))
    assert r["totalmem"][0][1] == str(512 * MIB)
    assert int(r["fill"][0][1]) == 512 * MIB - RESERVE


def test_container_index_is_nvml_order(env: dict[str, str], driver: H.Driver, tmp_path: Path) -> None:
    """A container that holds only GPU 1: its index 0 is GPU 1."""
    dev = H.make_devdir(tmp_path / "dev1", [1])
    env.update(NVSIM_DEV_DIR=str(dev), CUDA_DEVICE_MEMORY_LIMIT_0="300m")
    r = ok(H.probe(env, "init", "uuids", "totalmem", "0"))
    assert r["uuid"][0][2] == driver.uuids[1]
    assert r["totalmem"][0][1] == str(300 * MIB)


def test_devices_do_not_merge(env: dict[str, str]) -> None:
    """Two processes of one container on different GPUs keep separate accounts."""
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "256m"
    a = ok(H.probe({**env, "CUDA_VISIBLE_DEVICES": "0"}, "init", "ctx", "0", "fill", str(MIB), "meminfo"))
    b = ok(H.probe({**env, "CUDA_VISIBLE_DEVICES": "1"}, "init", "ctx", "0", "fill", str(MIB)))
    assert a["fill"][0][1] == b["fill"][0][1] == str(256 * MIB - RESERVE)


# ---- configuration ----


@pytest.mark.parametrize(
    "var,value",
    [
        ("CUDA_DEVICE_MEMORY_LIMIT", "1x"),
        ("CUDA_DEVICE_MEMORY_LIMIT", "-1g"),
        ("CUDA_DEVICE_MEMORY_LIMIT", ""),
        ("CUDA_DEVICE_MEMORY_LIMIT_0", "1.5"),
        ("CUDA_DEVICE_MEMORY_LIMIT_X", "1g"),
        ("CUDA_DEVICE_SM_LIMIT", "101"),
        ("CUDA_DEVICE_SM_LIMIT_1", "50%"),
    ],
)
def test_malformed_env_fails_closed(env: dict[str, str], var: str, value: str) -> None:
    env[var] = value
    cp = H.probe(env, "init", "ctx", "0", "alloc", "1")
    r = H.parse(cp.stdout)
    assert r["init"][0][0] != "0"
    assert var in cp.stderr
    assert r["alloc"][0][0] != "0"


def test_gb_is_a_gib_not_a_byte(env: dict[str, str]) -> None:
    for value in ("1gb", "1.0g", "1GiB", "1024m", "1073741824"):
        env["CUDA_DEVICE_MEMORY_LIMIT"] = value
        r = ok(H.probe(env, "init", "totalmem", "0"))
        assert r["totalmem"][0][1] == str(1 << 30), value


def test_no_limit_passthrough(env: dict[str, str], tmp_path: Path, driver: H.Driver) -> None:
    r = ok(H.probe(env, "init", "ctx", "0", "totalmem", "0", "alloc", str(3 * 1024 * MIB)))
    assert r["totalmem"][0][1] == str(driver.memory)
    assert r["alloc"][0][0] == "0"
    assert not (tmp_path / "cache").exists()  # no accounting at all
    # zero means no limit (HAMi's convention)
    env.update(CUDA_DEVICE_MEMORY_LIMIT="0", CUDA_DEVICE_SM_LIMIT="0")
    r = ok(H.probe(env, "init", "ctx", "0", "alloc", str(3 * 1024 * MIB)))
    assert r["alloc"][0][0] == "0"


def test_limits_file_cannot_be_escaped(env: dict[str, str], tmp_path: Path) -> None:
    limits = vgpu.limits_from_env({"CUDA_DEVICE_MEMORY_LIMIT": "256m"}, 2)
    cache = tmp_path / "ctr" / "cache"
    vgpu.write_limits_file(tmp_path / "ctr" / "limits", limits.values(), cache=str(cache))
    env.pop("CUDA_DEVICE_MEMORY_SHARED_CACHE")
    env["NVCTK_VGPU_LIMITS_FILE"] = str(tmp_path / "ctr" / "limits")
    room = str(256 * MIB - RESERVE)
    # no env at all: the file's cap holds
    r = ok(H.probe(env, "init", "ctx", "0", "alloc", room, "alloc", "1"))
    assert [x[0] for x in r["alloc"]] == ["0", "2"]
    # a looser env does not lift it; a private accounting file is ignored
    env.update(CUDA_DEVICE_MEMORY_LIMIT="8g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "mine"))
    with _holding(env, 100 * MIB) as finish:
        r = ok(H.probe(env, "init", "ctx", "0", "fill", str(MIB)))
        assert int(r["fill"][0][1]) == 256 * MIB - 2 * RESERVE - 100 * MIB
        finish()
    assert not (tmp_path / "mine").exists()
    # a stricter env still applies
    env["CUDA_DEVICE_MEMORY_LIMIT"] = "128m"
    r = ok(H.probe(env, "init", "totalmem", "0"))
    assert r["totalmem"][0][1] == str(128 * MIB)


# ---- neighbours ----


def test_neighbours_capped_vs_greedy(driver: H.Driver, tmp_path: Path) -> None:
    state = tmp_path / "state"
    capped = driver.env(state, CUDA_DEVICE_MEMORY_LIMIT="1g", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "a"))
    greedy = driver.env(state, CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "b"))
    # the capped container cannot take more than its cap, the rest stays for others
    p = subprocess.Popen([str(H.PROBE), "init", "ctx", "0", "fill", str(MIB), "wait"], env={**capped, "LD_PRELOAD": str(H.LIB)},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdin is not None
        line = p.stdout.readline()
        while not line.startswith("fill"):
            line = p.stdout.readline()
        assert int(line.split()[2]) == 1024 * MIB - RESERVE
        assert read_state(state).gpus[0].mem_used == 1024 * MIB
        r = ok(H.probe(greedy, "init", "ctx", "0", "fill", str(MIB), preload=False))
        assert int(r["fill"][0][1]) == driver.memory - 1024 * MIB - RESERVE
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(timeout=30)
    finally:
        p.kill()
    # without caps, a greedy neighbour starves the other one
    g = subprocess.Popen([str(H.PROBE), "init", "ctx", "0", "fill", str(MIB), "wait"], env=greedy,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert g.stdout is not None and g.stdin is not None
        while "ready" not in g.stdout.readline():
            pass
        r = H.parse(H.probe(greedy, "init", "ctx", "0", "alloc", str(MIB), preload=False).stdout)
        assert r["ctx"][0][0] == "2" or r["alloc"][0][0] == "2"
        g.stdin.write("\n")
        g.stdin.flush()
        g.wait(timeout=30)
    finally:
        g.kill()


def _nvmlprocs(out: dict[str, list[list[str]]]) -> dict[str, tuple[int, int, int, set[int]]]:
    """"v1:r1:n:r2:n2:pid..." -> version -> (count-query rc, its count, rc, pids)"""
    res = {}
    for field in out["nvmlprocs"][0][1:]:
        v, r1, n, r2, _n2, *pids = field.split(":")
        res[v] = (int(r1), int(n), int(r2), {int(p) for p in pids})
    return res


def test_nvml_process_lists_show_only_the_container(driver: H.Driver, tmp_path: Path) -> None:
    """HAMi's "NVML process lists not filtered": with libvgpu, NVML's compute
    process lists (v1/v2/v3) show only the processes of the caller's container
    (the pids in its accounting file), not the neighbours on the same GPU."""
    holders = {}
    try:
        for name in ("a", "b"):
            env = driver.env(tmp_path / "state", CUDA_DEVICE_MEMORY_LIMIT="1g",
                             CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / f"cache-{name}"), LD_PRELOAD=str(H.LIB))
            holders[name] = subprocess.Popen([str(H.PROBE), "init", "ctx", "0", "alloc", str(MIB), "wait"], env=env,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            out = holders[name].stdout
            assert out is not None
            while "ready" not in out.readline():
                pass
        base = driver.env(tmp_path / "state")
        everyone = _nvmlprocs(ok(H.probe(base, "nvmlprocs", "0")))
        want_all = {holders["a"].pid, holders["b"].pid}
        for v in ("v1", "v2", "v3"):
            assert everyone[v][2] == 0 and everyone[v][3] == want_all, everyone
        # a process of container a (only NVML, no CUDA) sees a's process only
        seen = _nvmlprocs(ok(H.probe({**base, "CUDA_DEVICE_MEMORY_LIMIT": "1g", "LD_PRELOAD": str(H.LIB),
                                      "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "cache-a")},
                                     "nvmlprocs", "0")))
        for v in ("v1", "v2", "v3"):
            # the count query (NULL array) answers the filtered count
            assert seen[v] == (7, 1, 0, {holders["a"].pid}), seen
        # a container with no process on the GPU sees none
        empty = _nvmlprocs(ok(H.probe({**base, "CUDA_DEVICE_MEMORY_LIMIT": "1g", "LD_PRELOAD": str(H.LIB),
                                       "CUDA_DEVICE_MEMORY_SHARED_CACHE": str(tmp_path / "cache-c")},
                                      "nvmlprocs", "0")))
        for v in ("v1", "v2", "v3"):
            assert empty[v] == (0, 0, 0, set()), empty
    finally:
        for h in holders.values():
            h.kill()
            h.wait()
