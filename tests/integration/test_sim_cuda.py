"""The simulated CUDA driver (csrc/cuda_mock.c) and the CUDA sample (cuda-vectoradd).

The driver is built once per module with build_driver from a 3-GPU topology of
small GPUs (1 GiB each; GPU 2 has two MIG devices). Every check runs in a
subprocess, since the mock enumerates devices once per process: either the
sample, or a small ctypes harness (run_cuda) that loads libcuda.so.1 and
reports JSON. Each test gets its own state file, so the shared accounting it
reads is its own.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nvctk.sim import apilist, build, state
from nvctk.sim.topology import make_topology
from support.devnodes import make_dev
from support.simdriver import build_sim_driver

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

MIB = 1 << 20
GPU_MIB = 1024
RESERVE = 64 * MIB  # the mock's default per-context reserve
TOPO = make_topology(3, memory_mib=GPU_MIB, mig={2: ["3g.40gb", "1g.10gb"]}, seed="test_sim_cuda")
G0, G1, G2 = TOPO.gpus
M0, M1 = G2.mig_devices

# Prelude of every harness script: `cu` is the mock, helpers wrap its calls.
PRELUDE = r"""
import ctypes as C, json, os, sys
from nvctk.sim import state as S
cu = C.CDLL("libcuda.so.1")
MIB = 1 << 20

def call(name, *args):
    f = getattr(cu, name)
    f.restype = C.c_int
    return f(*args)

def ok(name, *args):
    r = call(name, *args)
    if r != 0:
        raise SystemExit(f"{name} returned {r}")

def ctx(dev=0):
    c = C.c_void_p()
    ok("cuDevicePrimaryCtxRetain", C.byref(c), dev)
    ok("cuCtxSetCurrent", c)
    return c

def meminfo():
    f, t = C.c_size_t(), C.c_size_t()
    ok("cuMemGetInfo_v2", C.byref(f), C.byref(t))
    return f.value, t.value

def mine(gpu=0):
    # what the shared state charges this process on topology GPU `gpu`
    p = S.read_state(os.environ["NVSIM_STATE"]).proc(os.getpid(), gpu)
    return p.mem_used if p else 0

def alloc(n):
    p = C.c_uint64()
    r = call("cuMemAlloc_v2", C.byref(p), C.c_size_t(n))
    return r, p.value

def uuid(dev):
    u = (C.c_char * 16)()
    ok("cuDeviceGetUuid_v2", u, dev)
    return bytes(u).hex()

def hold():
    # tell the test we are ready, then keep everything until stdin closes
    print("ready", flush=True)
    sys.stdin.read()

class Loc(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]

class AllocProp(C.Structure):
    _fields_ = [("type", C.c_int), ("requestedHandleTypes", C.c_int), ("location", Loc),
                ("win32HandleMetaData", C.c_void_p), ("compressionType", C.c_ubyte),
                ("gpuDirectRDMACapable", C.c_ubyte), ("usage", C.c_ushort),
                ("reserved", C.c_ubyte * 4)]

class AccessDesc(C.Structure):
    _fields_ = [("location", Loc), ("flags", C.c_int)]

class PoolProps(C.Structure):
    _fields_ = [("allocType", C.c_int), ("handleTypes", C.c_int), ("location", Loc),
                ("win32SecurityAttributes", C.c_void_p), ("maxSize", C.c_size_t),
                ("usage", C.c_ushort), ("reserved", C.c_ubyte * 54)]

class ArrDesc(C.Structure):
    _fields_ = [("Width", C.c_size_t), ("Height", C.c_size_t), ("Format", C.c_int),
                ("NumChannels", C.c_uint)]

class Arr3DDesc(C.Structure):
    _fields_ = [("Width", C.c_size_t), ("Height", C.c_size_t), ("Depth", C.c_size_t),
                ("Format", C.c_int), ("NumChannels", C.c_uint), ("Flags", C.c_uint)]
"""


def uuid_hex(uuid: str) -> str:
    return uuid.split("-", 1)[1].replace("-", "")


@dataclass(frozen=True)
class Sim:
    root: Path
    lib: Path
    sample: Path
    dev: Path
    tmp: Path

    def env(
        self, state_file: Path, dev: Path | None = None, extra: dict[str, str] | None = None
    ) -> dict[str, str]:
        env = {
            **os.environ,
            "LD_LIBRARY_PATH": str(self.lib),
            "NVSIM_DEV_DIR": str(dev or self.dev),
            "NVSIM_STATE": str(state_file),
            "PYTHONPATH": os.pathsep.join(sys.path),
        }
        for k in ("CUDA_VISIBLE_DEVICES", "NVSIM_KERNEL_US", "NVSIM_CONTEXT_RESERVE_MIB"):
            env.pop(k, None)
        env.update(extra or {})
        return env


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Sim:
    tmp = tmp_path_factory.mktemp("simcuda")
    root, lib, bindir = build_sim_driver(tmp, TOPO)
    dev = make_dev(tmp / "dev", TOPO, [0, 1, 2])
    return Sim(root, lib, bindir / "cuda-vectoradd", dev, tmp)


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    return tmp_path / "state"


def run_cuda(
    sim: Sim,
    code: str,
    state_file: Path,
    dev: Path | None = None,
    env: dict[str, str] | None = None,
) -> Any:
    """Runs `code` (which sets `out`) after PRELUDE in a subprocess; returns out."""
    script = PRELUDE + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    r = subprocess.run(
        [sys.executable, "-c", script],
        env=sim.env(state_file, dev, env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


class Holder:
    """A harness process that holds nbytes in a context on device `gpu` (until close,
    or the end of a with block)."""

    def __init__(self, sim: Sim, state_file: Path, gpu: int, nbytes: int) -> None:
        code = f"ok('cuInit', 0); ctx({gpu}); r, p = alloc({nbytes}); assert r == 0"
        script = PRELUDE + code + "\nhold()\n"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script],
            env=sim.env(state_file),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"holder exited {self.proc.wait()}"

    def __enter__(self) -> Holder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)


def sample(
    sim: Sim, *args: str, state_file: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(sim.sample), *args],
        env=sim.env(state_file, extra=env),
        capture_output=True,
        text=True,
        timeout=30,
    )


# ---- the sample ----


@pytest.mark.parametrize(
    "args",
    [[], ["--graph", "--kernels", "3"], ["--n", "1"], ["--n", "1000003", "--device", "1"]],
    ids=["plain", "graph", "one-element", "large-device1"],
)
def test_vectoradd_passes(sim: Sim, state_file: Path, args: list[str]) -> None:
    r = sample(sim, *args, state_file=state_file)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Test PASSED" in r.stdout


def test_vectoradd_help_and_info(sim: Sim, state_file: Path) -> None:
    r = sample(sim, "--help", state_file=state_file)
    assert r.returncode == 0 and "--alloc-mib" in r.stdout
    r = sample(sim, "--info", state_file=state_file)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "devices: 4"  # GPU 0, GPU 1, GPU 2's two MIG devices
    assert G0.uuid in lines[1] and f"total {GPU_MIB * MIB}" in lines[1]
    assert f"MIG {M0.profile}" in lines[3] and f"total {M0.memory_mib * MIB}" in lines[3]


def test_vectoradd_alloc_cap(sim: Sim, state_file: Path) -> None:
    avail = GPU_MIB - RESERVE // MIB
    r = sample(sim, "--alloc-mib", str(avail), state_file=state_file)
    assert (r.returncode, r.stdout.strip()) == (0, f"alloc {avail} MiB: OK")
    r = sample(sim, "--alloc-mib", str(avail + 1), state_file=state_file)
    assert r.returncode == 2
    assert "CUDA_ERROR_OUT_OF_MEMORY (2)" in r.stdout


def test_no_device_fails_init(sim: Sim, state_file: Path) -> None:
    r = sample(sim, "--info", state_file=state_file, env={"CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 3 and "CUDA_ERROR_NO_DEVICE (100)" in r.stderr
    out = run_cuda(
        sim,
        """
        n = C.c_int(-1)
        out = [call("cuInit", 0), call("cuDeviceGetCount", C.byref(n))]
        """,
        state_file,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert out == [100, 3]


# ---- capacity and accounting ----


@pytest.mark.parametrize("reserve_mib", [None, "0", "100"])
def test_capacity_is_exact(sim: Sim, state_file: Path, reserve_mib: str | None) -> None:
    env = {} if reserve_mib is None else {"NVSIM_CONTEXT_RESERVE_MIB": reserve_mib}
    reserve = RESERVE if reserve_mib is None else int(reserve_mib) * MIB
    out = run_cuda(
        sim,
        """
        ok("cuInit", 0)
        before = mine()
        ctx(0)
        reserve = mine() - before
        free0, total = meminfo()
        r1, p1 = alloc(free0)
        r2, _ = alloc(1)
        free1, _ = meminfo()
        ok("cuMemFree_v2", C.c_uint64(p1))
        r3, _ = alloc(1)
        out = [reserve, free0, total, r1, r2, free1, r3, mine()]
        """,
        state_file,
        env=env,
    )
    cap = GPU_MIB * MIB
    assert out == [reserve, cap - reserve, cap, 0, 2, 0, 0, reserve + 1]


# Each case allocates through one path (setting `release` to undo it) and
# names the bytes a real driver would take for it.
ALLOC_CASES = {
    "cuMemAlloc": (
        """
        p = C.c_uint64(); ok("cuMemAlloc_v2", C.byref(p), C.c_size_t(12345))
        release = lambda: ok("cuMemFree_v2", p)
        """,
        12345,
    ),
    "cuMemAllocPitch": (
        """
        p, pitch = C.c_uint64(), C.c_size_t()
        ok("cuMemAllocPitch_v2", C.byref(p), C.byref(pitch), C.c_size_t(1000), C.c_size_t(3), 4)
        assert pitch.value == 1024, pitch.value
        release = lambda: ok("cuMemFree_v2", p)
        """,
        1024 * 3,
    ),
    "cuMemAllocManaged": (
        """
        p = C.c_uint64(); ok("cuMemAllocManaged", C.byref(p), C.c_size_t(5000), 1)
        release = lambda: ok("cuMemFree_v2", p)
        """,
        5000,
    ),
    "cuMemAllocAsync": (
        """
        s = C.c_void_p(); ok("cuStreamCreate", C.byref(s), 0)
        p = C.c_uint64(); ok("cuMemAllocAsync", C.byref(p), C.c_size_t(7000), s)
        release = lambda: ok("cuMemFreeAsync", p, s)
        """,
        7000,
    ),
    "cuMemAllocFromPoolAsync": (
        """
        props = PoolProps(allocType=1, location=Loc(1, 0))
        pool = C.c_void_p(); ok("cuMemPoolCreate", C.byref(pool), C.byref(props))
        p = C.c_uint64(); ok("cuMemAllocFromPoolAsync", C.byref(p), C.c_size_t(9000), pool, None)
        used = C.c_uint64(); ok("cuMemPoolGetAttribute", pool, 7, C.byref(used))
        assert used.value == 9000, used.value
        release = lambda: (ok("cuMemFreeAsync", p, None), ok("cuMemPoolDestroy", pool))
        """,
        9000,
    ),
    "cuArrayCreate": (
        """
        a = C.c_void_p(); d = ArrDesc(100, 10, 0x20, 4)  # float4
        ok("cuArrayCreate_v2", C.byref(a), C.byref(d))
        release = lambda: ok("cuArrayDestroy", a)
        """,
        100 * 10 * 4 * 4,
    ),
    "cuArray3DCreate": (
        """
        a = C.c_void_p(); d = Arr3DDesc(10, 20, 30, 0x01, 2, 0)  # uchar2
        ok("cuArray3DCreate_v2", C.byref(a), C.byref(d))
        release = lambda: ok("cuArrayDestroy", a)
        """,
        10 * 20 * 30 * 2,
    ),
    "cuMipmappedArrayCreate": (
        """
        a = C.c_void_p(); d = Arr3DDesc(8, 8, 0, 0x20, 1, 0)  # 2D float, 4 levels
        ok("cuMipmappedArrayCreate", C.byref(a), C.byref(d), 4)
        release = lambda: ok("cuMipmappedArrayDestroy", a)
        """,
        (64 + 16 + 4 + 1) * 4,
    ),
    "cuMemCreate-device": (
        """
        prop = AllocProp(type=1, location=Loc(1, 0))
        h = C.c_uint64(); ok("cuMemCreate", C.byref(h), C.c_size_t(4 * MIB), C.byref(prop), C.c_ulonglong(0))
        release = lambda: ok("cuMemRelease", h)
        """,
        4 * MIB,
    ),
    "cuMemCreate-host": (
        """
        prop = AllocProp(type=1, location=Loc(2, 0))
        h = C.c_uint64(); ok("cuMemCreate", C.byref(h), C.c_size_t(4 * MIB), C.byref(prop), C.c_ulonglong(0))
        release = lambda: ok("cuMemRelease", h)
        """,
        0,
    ),
}


@pytest.mark.parametrize("case", ALLOC_CASES)
def test_allocation_paths_charge_and_credit(sim: Sim, state_file: Path, case: str) -> None:
    code, expected = ALLOC_CASES[case]
    out = run_cuda(
        sim,
        "ok('cuInit', 0)\nctx(0)\nbase = mine()\nfree_base, _ = meminfo()\n"
        + textwrap.dedent(code)
        + "\nheld = mine() - base\nfree_held, _ = meminfo()\nrelease()\n"
        "out = [held, free_base - free_held, mine() - base]\n",
        state_file,
    )
    assert out == [expected, expected, 0]


def test_vmm_map_access_and_deferred_free(sim: Sim, state_file: Path) -> None:
    out = run_cuda(
        sim,
        """
        ok("cuInit", 0); ctx(0); base = mine()
        prop = AllocProp(type=1, location=Loc(1, 0))
        g = C.c_size_t(); ok("cuMemGetAllocationGranularity", C.byref(g), C.byref(prop), 0)
        h = C.c_uint64(); ok("cuMemCreate", C.byref(h), C.c_size_t(2 * g.value), C.byref(prop), C.c_ulonglong(0))
        va = C.c_uint64(); ok("cuMemAddressReserve", C.byref(va), C.c_size_t(4 * g.value), C.c_size_t(0), C.c_uint64(0), C.c_ulonglong(0))
        ptr, size = C.c_uint64(va.value), C.c_size_t(2 * g.value)
        ok("cuMemMap", ptr, size, C.c_size_t(0), h, C.c_ulonglong(0))
        before_access = call("cuMemsetD32_v2", ptr, C.c_uint(7), C.c_size_t(4))
        acc = AccessDesc(Loc(1, 0), 3)
        ok("cuMemSetAccess", ptr, size, C.byref(acc), C.c_size_t(1))
        ok("cuMemsetD32_v2", ptr, C.c_uint(7), C.c_size_t(4))
        buf = (C.c_uint * 4)(); ok("cuMemcpyDtoH_v2", buf, ptr, C.c_size_t(16))
        remap = call("cuMemMap", ptr, size, C.c_size_t(0), h, C.c_ulonglong(0))
        ok("cuMemRelease", h)
        after_release = mine() - base  # still mapped: still held
        ok("cuMemUnmap", ptr, size)
        after_unmap = mine() - base
        ok("cuMemAddressFree", C.c_uint64(va.value), C.c_size_t(4 * g.value))
        out = [g.value, before_access, list(buf), remap, after_release, after_unmap]
        """,
        state_file,
    )
    gran = 2 * MIB
    assert out == [gran, 1, [7, 7, 7, 7], 208, 2 * gran, 0]


def test_context_reserve_and_teardown(sim: Sim, state_file: Path) -> None:
    out = run_cuda(
        sim,
        """
        ok("cuInit", 0)
        c = C.c_void_p(); ok("cuCtxCreate_v2", C.byref(c), 0, 1)
        with_ctx = mine(1)
        r, p = alloc(10 * MIB)
        with_alloc = mine(1)
        ok("cuCtxDestroy_v2", c)  # frees what the context held, as a real driver does
        after = mine(1)
        cur = C.c_void_p(1); ok("cuCtxGetCurrent", C.byref(cur))
        r2, _ = alloc(1)
        pc = ctx(1); ok("cuDevicePrimaryCtxRetain", C.byref(pc), 1)  # refcount 2
        ok("cuDevicePrimaryCtxRelease_v2", 1)
        still = mine(1)
        ok("cuDevicePrimaryCtxRelease_v2", 1)
        out = [with_ctx, with_alloc, after, cur.value, r2, still, mine(1)]
        """,
        state_file,
    )
    assert out == [RESERVE, RESERVE + 10 * MIB, 0, None, 201, RESERVE, 0]


def test_two_processes_share_one_pool(sim: Sim, state_file: Path) -> None:
    with Holder(sim, state_file, 0, 512 * MIB) as holder:
        out = run_cuda(
            sim,
            """
            ok("cuInit", 0); ctx(0)
            free, total = meminfo()
            r_big, _ = alloc(free + 1)
            r_fit, _ = alloc(free)
            out = [free, total, r_big, r_fit]
            """,
            state_file,
        )
        cap = GPU_MIB * MIB
        assert out == [cap - 2 * RESERVE - 512 * MIB, cap, 2, 0]
        slot = state.read_state(state_file).proc(holder.proc.pid, 0)
        assert slot is not None and slot.mem_used == RESERVE + 512 * MIB
    # the holder released everything by exiting
    free = run_cuda(sim, "ok('cuInit', 0); ctx(0); out = meminfo()[0]", state_file)
    assert free == GPU_MIB * MIB - RESERVE


def test_nvml_sees_cuda_usage(sim: Sim, state_file: Path) -> None:
    with Holder(sim, state_file, 1, 100 * MIB) as holder:
        out = run_cuda(
            sim,
            """
            import pynvml
            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(1)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            out = [pynvml.nvmlDeviceGetMemoryInfo(h).used,
                   [(p.pid, p.usedGpuMemory) for p in procs]]
            """,
            state_file,
        )
    used = RESERVE + 100 * MIB
    assert out == [used, [[holder.proc.pid, used]]]


def test_sigkilled_process_memory_is_reclaimed(sim: Sim, state_file: Path) -> None:
    holder = Holder(sim, state_file, 1, 700 * MIB)
    assert state.read_state(state_file).gpus[1].mem_used == RESERVE + 700 * MIB
    holder.kill()
    out = run_cuda(
        sim,
        "ok('cuInit', 0); ctx(1); free = meminfo()[0]; r, _ = alloc(900 * MIB); out = [free, r]",
        state_file,
    )
    assert out == [GPU_MIB * MIB - RESERVE, 0]


def test_mig_device_capacity(sim: Sim, state_file: Path) -> None:
    out = run_cuda(
        sim,
        """
        ok("cuInit", 0)
        name = C.create_string_buffer(128); ok("cuDeviceGetName", name, 64, 3)
        ctx(3)
        free, total = meminfo()
        r_big, _ = alloc(free + 1)
        r_fit, _ = alloc(free)
        out = [name.value.decode(), uuid(3), total, r_big, r_fit, mine(2)]
        """,
        state_file,
    )
    cap = M1.memory_mib * MIB
    assert out == [f"{G2.name} MIG {M1.profile}", uuid_hex(M1.uuid), cap, 2, 0, cap]


# ---- which devices a process sees ----

CVD_CASES = [
    (None, [G0.uuid, G1.uuid, M0.uuid, M1.uuid]),
    ("1", [G1.uuid]),
    ("1,0", [G1.uuid, G0.uuid]),
    (G1.uuid, [G1.uuid]),
    (G1.uuid[:12], [G1.uuid]),  # unambiguous prefix
    (f"{M1.uuid},0", [M1.uuid, G0.uuid]),
    (f" 2 , {G0.uuid.lower()}", [M0.uuid, G0.uuid]),
    ("0,9,1", [G0.uuid]),  # an invalid entry ends the list
    ("0,0,1", [G0.uuid]),  # so does a repeated one
    ("GPU-ffffffff", []),  # nothing valid: no device at all
]


@pytest.mark.parametrize("cvd,expected", CVD_CASES, ids=[str(c[0]) for c in CVD_CASES])
def test_cuda_visible_devices(
    sim: Sim, state_file: Path, cvd: str | None, expected: list[str]
) -> None:
    env = {} if cvd is None else {"CUDA_VISIBLE_DEVICES": cvd}
    out = run_cuda(
        sim,
        """
        r = call("cuInit", 0)
        n = C.c_int(0)
        if r == 0:
            ok("cuDeviceGetCount", C.byref(n))
        out = [r, [uuid(i) for i in range(n.value)]]
        """,
        state_file,
        env=env,
    )
    assert out == [0 if expected else 100, [uuid_hex(u) for u in expected]]


def test_dev_nodes_decide_visibility(sim: Sim, state_file: Path, tmp_path: Path) -> None:
    dev = make_dev(tmp_path / "dev", TOPO, [0, 1])
    (dev / "nvidia0").unlink()
    code = """
    ok("cuInit", 0)
    n = C.c_int(0); ok("cuDeviceGetCount", C.byref(n))
    bus = C.c_int(); ok("cuDeviceGetAttribute", C.byref(bus), 33, 0)
    out = [[uuid(i) for i in range(n.value)], bus.value]
    """
    out = run_cuda(sim, code, state_file, dev=dev)
    assert out == [[uuid_hex(G1.uuid)], int(G1.pci_bus_id.split(":")[1], 16)]
    # the container's device 0 is the only one it has, whatever its host index
    out = run_cuda(sim, code, state_file, dev=dev, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert out[0] == [uuid_hex(G1.uuid)]
    assert run_cuda(sim, "out = call('cuInit', 0)", state_file, dev=tmp_path / "empty") == 100


def test_device_properties(sim: Sim, state_file: Path) -> None:
    out = run_cuda(
        sim,
        """
        ok("cuInit", 0)
        def attr(a, d=1):
            v = C.c_int(); ok("cuDeviceGetAttribute", C.byref(v), a, d); return v.value
        name = C.create_string_buffer(128); ok("cuDeviceGetName", name, 128, 1)
        tm = C.c_size_t(); ok("cuDeviceTotalMem_v2", C.byref(tm), 1)
        bus = C.create_string_buffer(32); ok("cuDeviceGetPCIBusId", bus, 32, 1)
        v1 = (C.c_char * 16)(); ok("cuDeviceGetUuid", v1, 3)
        ver = C.c_int(); ok("cuDriverGetVersion", C.byref(ver))
        d = C.c_int(); ok("cuDeviceGetByPCIBusId", C.byref(d), bus)
        out = [name.value.decode(), tm.value, bus.value.decode(), bytes(v1).hex(), ver.value,
               d.value, [attr(a) for a in (75, 76, 16, 1, 41, 50)], call("cuDeviceGet", C.byref(d), 9)]
        """,
        state_file,
    )
    dom, bus, devfn = G1.pci_bus_id.split(":")
    assert out == [
        G1.name,
        GPU_MIB * MIB,
        f"{dom[-4:]}:{bus}:{devfn}",
        uuid_hex(G2.uuid),  # v1 of a MIG device names its parent GPU
        TOPO.cuda_version_int,
        1,
        [*G1.compute_capability, 132, 1024, 1, int(dom, 16)],
        101,
    ]


# ---- entry points ----

PROC_CASES = [
    # (base name, cudaVersion, symbol it resolves to | CUresult, status)
    ("cuMemAlloc", 12040, "cuMemAlloc_v2"),
    ("cuMemAlloc", 3020, "cuMemAlloc_v2"),
    ("cuMemAlloc", 3010, (500, 2)),  # the 32-bit v1 is not simulated
    ("cuMemGetInfo", 12040, "cuMemGetInfo_v2"),
    ("cuDeviceTotalMem", 12040, "cuDeviceTotalMem_v2"),
    ("cuMemcpyHtoD", 12040, "cuMemcpyHtoD_v2"),
    ("cuCtxCreate", 12040, "cuCtxCreate_v3"),
    ("cuCtxCreate", 11000, "cuCtxCreate_v2"),
    ("cuCtxCreate", 12080, "cuCtxCreate_v4"),
    ("cuGetProcAddress", 12040, "cuGetProcAddress_v2"),
    ("cuGetProcAddress", 11080, "cuGetProcAddress"),
    ("cuDeviceGetUuid", 11030, "cuDeviceGetUuid"),
    ("cuDeviceGetUuid", 12040, "cuDeviceGetUuid_v2"),
    ("cuGraphInstantiate", 12040, "cuGraphInstantiateWithFlags"),
    ("cuGraphAddKernelNode", 12040, "cuGraphAddKernelNode_v2"),
    ("cuLaunchKernel", 12040, "cuLaunchKernel"),
    ("cuLaunchKernelEx", 11040, (500, 2)),
    ("cuMemAlloc_v2", 12040, (500, 1)),  # base names only
    ("cudnnCreate", 12040, (500, 1)),
    # the rest of the driver API (generated table): the newest form of each name
    ("cuGraphAddMemcpyNode", 12040, "cuGraphAddMemcpyNode"),
    ("cuStreamGetCaptureInfo", 12040, "cuStreamGetCaptureInfo_v3"),
    ("cuMemcpyAtoH", 12040, "cuMemcpyAtoH_v2"),
    ("cuProfilerStart", 12040, "cuProfilerStart"),
    ("cuGetExportTable", 12040, "cuGetExportTable"),
]


def test_get_proc_address(sim: Sim, state_file: Path) -> None:
    out = run_cuda(
        sim,
        f"""
        out = []
        for name, ver, want in {[(n, v, w) for n, v, w in PROC_CASES]!r}:
            fn, st = C.c_void_p(), C.c_int(-1)
            r = call("cuGetProcAddress_v2", name.encode(), C.byref(fn), ver, C.c_uint64(0), C.byref(st))
            fn1 = C.c_void_p()
            r1 = call("cuGetProcAddress", name.encode(), C.byref(fn1), ver, C.c_uint64(0))
            assert (r1, fn1.value) == (r, fn.value)
            if isinstance(want, str):
                addr = C.cast(getattr(cu, want), C.c_void_p).value
                out.append(want if (r, st.value, fn.value) == (0, 0, addr) else [r, st.value])
            else:
                out.append([r, st.value] if fn.value is None else "non-null pfn")
        """,
        state_file,
    )
    assert out == [w if isinstance(w, str) else list(w) for _, _, w in PROC_CASES]


def _exports(lib: Path) -> dict[str, str]:
    """Defined dynamic symbols of `lib` -> nm's type (T strong, W weak)."""
    out = subprocess.run(
        ["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True
    ).stdout
    return {f[2]: f[1] for f in (line.split() for line in out.splitlines()) if len(f) == 3}


def test_api_list_is_cuda_12_4() -> None:
    names = apilist.names("cuda")
    assert list(names) == sorted(set(names)) and len(names) > 600
    # every versioned and per-thread-stream form, the interop and profiler headers
    for n in ("cuMemAlloc", "cuMemAlloc_v2", "cuMemcpy_ptds", "cuLaunchKernel_ptsz",
              "cuGetExportTable", "cuLinkComplete", "cuGraphConditionalHandleCreate",
              "cuGLGetDevices_v2", "cuEGLStreamConsumerConnect", "cuVDPAUGetDevice",
              "cuProfilerStart", "cuProfilerStop", "cuGetProcAddress_v2"):
        assert n in names, n
    assert "cuCtxCreate_v4" not in names  # CUDA 12.5: newer than the claimed 12.4


def test_api_list_derivation(tmp_path: Path) -> None:
    """derive() keeps every form the define sets select, across line breaks."""
    (tmp_path / "cuda.h").write_text(textwrap.dedent("""\
        #define CUDA_VERSION 12040
        #define CUDAAPI
        typedef int CUresult;
        #if defined(CUDA_API_PER_THREAD_DEFAULT_STREAM)
        #define cuMemcpy cuMemcpy_ptds
        #endif
        #define cuMemAlloc cuMemAlloc_v2
        CUresult CUDAAPI cuMemcpy(int a);
        CUresult CUDAAPI
        cuMemAlloc(int *p);
        typedef CUresult (CUDAAPI *PFN_cuNotAnEntry_v2000)(void);
        #if defined(__CUDA_API_VERSION_INTERNAL)
        #undef cuMemAlloc
        CUresult CUDAAPI cuMemAlloc(unsigned int *p);
        #endif
        """))
    for h in ("cudaGL.h", "cudaEGL.h", "cudaVDPAU.h"):
        (tmp_path / h).write_text('#include <GL/gl.h>\n#include "cuda.h"\nCUresult CUDAAPI cuGLInit(void);\n')
    (tmp_path / "cudaProfilerTypedefs.h").write_text("typedef int (*PFN_cuProfilerStart_v4000)(void);\n")
    assert apilist.derive("cuda", str(tmp_path)) == [
        "cuGLInit", "cuMemAlloc", "cuMemAlloc_v2", "cuMemcpy", "cuMemcpy_ptds", "cuProfilerStart",
    ]


def test_every_driver_api_name_is_exported(sim: Sim) -> None:
    exports = _exports(sim.lib / "libcuda.so.1")
    missing = set(apilist.names("cuda")) - exports.keys()
    assert not missing, sorted(missing)[:20]
    # the simulated functions keep their implementations; the rest are weak stubs
    for n in ("cuInit", "cuMemAlloc_v2", "cuLaunchKernel", "cuGetProcAddress_v2", "cuCtxCreate_v4"):
        assert exports[n] == "T", n
    for n in ("cuMemcpy3DPeer", "cuGetExportTable", "cuMemAlloc"):
        assert exports[n] == "W", n
    assert "nvsim_cuda_proc_lookup" not in exports


def test_stubs_return_not_supported(sim: Sim, state_file: Path) -> None:
    out = run_cuda(
        sim,
        """
        ok("cuInit", 0); ctx(0)
        direct = [call(n, None, None) for n in ("cuMemcpy3DPeer", "cuGetExportTable", "cuProfilerStart",
                                                 "cuMemcpyAtoH_v2_ptds", "cuGLGetDevices_v2")]
        fn, st = C.c_void_p(), C.c_int(-1)
        ok("cuGetProcAddress_v2", b"cuGraphAddMemcpyNode", C.byref(fn), 12040, C.c_uint64(0), C.byref(st))
        via_proc = C.CFUNCTYPE(C.c_int, C.c_void_p)(fn.value)(None)
        name = C.c_char_p()
        ok("cuGetErrorName", 801, C.byref(name))
        out = [direct, via_proc, name.value.decode(), meminfo()[1] > 0]
        """,
        state_file,
    )
    assert out == [[801] * 5, 801, "CUDA_ERROR_NOT_SUPPORTED", True]


def test_build_cache_trusts_only_own_files(tmp_path: Path) -> None:
    d = tmp_path / "cache"
    d.mkdir(mode=0o700)
    f = d / "cuda-stubs-0.o"
    f.write_bytes(b"x")
    f.chmod(0o644)
    assert build._trusted(f)
    f.chmod(0o666)  # anyone could have put something else there
    assert not build._trusted(f)
    f.chmod(0o644)
    d.chmod(0o777)
    assert not build._trusted(f)
    assert not build._trusted(tmp_path / "missing.o")


def test_build_cache_compiles_what_the_topology_does_not_change_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sims of different topologies from one cache: the second compiles nothing the
    cache holds (only nvsim_state.c, which defines nvsim_topo, and the links), and each
    driver reports its own GPUs. A source that changes is compiled again."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cache = tmp_path / "cache" / "nvsim"
    gpus = {}
    for n in (1, 3):
        topo = make_topology(n, seed=f"cache-{n}")
        _, lib, bindir = build_sim_driver(tmp_path / f"t{n}", topo)
        if n == 1:
            first = sorted(p.name for p in cache.iterdir())
        dev = make_dev(tmp_path / f"dev{n}", topo, list(range(n)))
        r = subprocess.run([str(bindir / "nvidia-smi"), "-L"], capture_output=True, text=True, timeout=30,
                           env={**os.environ, "LD_LIBRARY_PATH": str(lib), "NVSIM_DEV_DIR": str(dev),
                                "NVSIM_STATE": str(tmp_path / f"state{n}")})
        assert r.returncode == 0, r.stderr
        gpus[n] = [line.split("(UUID: ")[1].rstrip(")") for line in r.stdout.splitlines()]
        assert gpus[n] == [g.uuid for g in topo.gpus], r.stdout
    assert {n.rsplit("-", 1)[0] for n in first} >= {"libcuda", "libnvidia-ml", "nvidia-smi", "cuda-vectoradd",
                                                    build.STUB_PROGRAM, "cuda-stubs", "nvml-stubs"}, first
    assert sorted(p.name for p in cache.iterdir()) == first  # nothing compiled the second time
    # what an output is made of is its cache key: other sources, another object
    src = tmp_path / "one.c"
    src.write_text("int one(void) { return 1; }\n")
    (tmp_path / "work").mkdir()
    made = [build._cached(tmp_path / "work", {"one.o": (text, build._compile(src, "-c"))})["one.o"]
            for text in ("v1", "v1", "v2")]
    assert [p.parent == cache for p in made] == [False, True, False]  # compiled, cached, compiled
    assert len(list(cache.glob("one-*.o"))) == 2


def test_generated_stubs() -> None:
    fallback = build._proc_fallback(
        ["cuFoo", "cuFoo_v2", "cuFoo_v2_ptds", "cuBar_ptsz", "cuBar", "cuBaz_v3", "cuBaz_v12"]
    )
    assert fallback == [("cuBar", "cuBar"), ("cuBaz", "cuBaz_v12"), ("cuFoo", "cuFoo_v2")]
    nvml = build.generate_stubs("nvml")
    assert "NVSIM_STUB(nvmlEventSetWait_v2)" in nvml and "return 3;" in nvml
    assert "NVSIM_STUB(nvmlErrorString)" not in nvml  # returns a string: implemented for real
    assert "return 801;" in build.generate_stubs("cuda")


# ---- kernels ----


def test_kernel_time_shows_in_busy_counters(sim: Sim, state_file: Path) -> None:
    r = sample(sim, "--kernels", "4", state_file=state_file, env={"NVSIM_KERNEL_US": "5000"})
    assert r.returncode == 0, r.stderr
    r = sample(
        sim, "--graph", "--kernels", "2", state_file=state_file, env={"NVSIM_KERNEL_US": "5000"}
    )
    assert r.returncode == 0, r.stderr
    g0 = state.read_state(state_file).gpus[0]
    assert (g0.kernels, g0.busy_ns) == (6, 6 * 5_000_000)


def test_kernels_of_all_processes_run_one_at_a_time(sim: Sim, state_file: Path) -> None:
    env = sim.env(state_file, extra={"NVSIM_KERNEL_US": "50000"})
    t0 = time.monotonic_ns()  # the sim's clock (CLOCK_MONOTONIC)
    procs = [
        subprocess.Popen([str(sim.sample), "--kernels", "4"], env=env, stdout=subprocess.PIPE)
        for _ in range(2)
    ]
    assert [p.wait(timeout=30) for p in procs] == [0, 0]
    g0 = state.read_state(state_file).gpus[0]
    assert g0.busy_ns == 8 * 50_000_000
    # on the GPU's own timeline the 8 kernels of 50 ms end no sooner than one after the
    # other would: none ran beside another
    assert g0.last_busy_end_ns - t0 >= 8 * 50_000_000


def test_launch_paths_and_errors(sim: Sim, state_file: Path) -> None:
    out = run_cuda(
        sim,
        """
        ok("cuInit", 0); ctx(0)
        mod = C.c_void_p(); ok("cuModuleLoadData", C.byref(mod), b"any image")
        fn = C.c_void_p(); ok("cuModuleGetFunction", C.byref(fn), mod, b"busy")
        missing = call("cuModuleGetFunction", C.byref(C.c_void_p()), mod, b"missingKernel")
        e0, e1 = C.c_void_p(), C.c_void_p()
        ok("cuEventCreate", C.byref(e0), 0); ok("cuEventCreate", C.byref(e1), 0)
        ok("cuEventRecord", e0, None)
        ok("cuLaunchKernel", fn, 1, 1, 1, 32, 1, 1, 0, None, None, None)
        ok("cuLaunchCooperativeKernel", fn, 2, 1, 1, 32, 1, 1, 0, None, None)
        class Cfg(C.Structure):
            _fields_ = [("g", C.c_uint * 3), ("b", C.c_uint * 3), ("shmem", C.c_uint),
                        ("stream", C.c_void_p), ("attrs", C.c_void_p), ("nattrs", C.c_uint)]
        cfg = Cfg((C.c_uint * 3)(1, 1, 1), (C.c_uint * 3)(64, 1, 1), 0, None, None, 0)
        ok("cuLaunchKernelEx", C.byref(cfg), fn, None, None)
        ok("cuEventRecord", e1, None); ok("cuEventSynchronize", e1)
        ms = C.c_float(); ok("cuEventElapsedTime", C.byref(ms), e0, e1)
        bad_block = call("cuLaunchKernel", fn, 1, 1, 1, 2048, 1, 1, 0, None, None, None)
        coop_big = call("cuLaunchCooperativeKernel", fn, 1 << 20, 1, 1, 32, 1, 1, 0, None, None)
        # a graph built by hand
        g, ge, node = C.c_void_p(), C.c_void_p(), C.c_void_p()
        class KNP(C.Structure):
            _fields_ = [("func", C.c_void_p), ("g", C.c_uint * 3), ("b", C.c_uint * 3),
                        ("shmem", C.c_uint), ("params", C.c_void_p), ("extra", C.c_void_p),
                        ("kern", C.c_void_p), ("ctx", C.c_void_p)]
        knp = KNP(fn, (C.c_uint * 3)(1, 1, 1), (C.c_uint * 3)(1, 1, 1), 0, None, None, None, None)
        ok("cuGraphCreate", C.byref(g), 0)
        ok("cuGraphAddKernelNode_v2", C.byref(node), g, None, C.c_size_t(0), C.byref(knp))
        ok("cuGraphAddKernelNode_v2", C.byref(node), g, C.byref(node), C.c_size_t(1), C.byref(knp))
        ok("cuGraphInstantiateWithFlags", C.byref(ge), g, C.c_ulonglong(0))
        ok("cuGraphLaunch", ge, None)
        # out-of-bounds copies are refused, not crashed on
        r, p = alloc(64)
        oob = call("cuMemcpyHtoD_v2", C.c_uint64(p + 32), b"x" * 64, C.c_size_t(64))
        k = S.read_state(os.environ["NVSIM_STATE"]).proc(os.getpid(), 0).kernels
        out = [missing, ms.value >= 3 * 20.0, bad_block, coop_big, k, oob]
        """,
        state_file,
        env={"NVSIM_KERNEL_US": "20000"},
    )
    assert out == [500, True, 1, 720, 5, 1]


def test_capture_refuses_uncapturable_work(sim: Sim, state_file: Path) -> None:
    out = run_cuda(
        sim,
        """
        ok("cuInit", 0); ctx(0)
        s = C.c_void_p(); ok("cuStreamCreate", C.byref(s), 0)
        legacy = call("cuStreamBeginCapture_v2", None, 0)
        ok("cuStreamBeginCapture_v2", s, 0)
        st = C.c_int(); ok("cuStreamIsCapturing", s, C.byref(st))
        r, p = alloc(16)
        copy = call("cuMemcpyHtoDAsync_v2", C.c_uint64(p), b"x" * 16, C.c_size_t(16), s)
        sync = call("cuStreamSynchronize", s)
        g = C.c_void_p(); ok("cuStreamEndCapture", s, C.byref(g))
        out = [legacy, st.value, copy, sync]
        """,
        state_file,
    )
    assert out == [900, 1, 900, 900]


def test_zero_time_kernels_are_counted_with_no_busy_time(sim: Sim, state_file: Path) -> None:
    """NVSIM_KERNEL_US=0: launches are counted and take no simulated time (what a launch
    costs is bench/'s)."""
    out = run_cuda(
        sim,
        """
        ok("cuInit", 0); ctx(0)
        mod = C.c_void_p(); ok("cuModuleLoadData", C.byref(mod), b"any image")
        fn = C.c_void_p(); ok("cuModuleGetFunction", C.byref(fn), mod, b"busy")
        for _ in range(2000):
            ok("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        p = S.read_state(os.environ["NVSIM_STATE"]).proc(os.getpid(), 0)
        out = [p.kernels, p.busy_ns]
        """,
        state_file,
        env={"NVSIM_KERNEL_US": "0"},
    )
    assert out == [2000, 0]


@pytest.mark.exclusive  # bounds call and wait times
def test_async_launches_complete_later(sim: Sim, state_file: Path) -> None:
    """NVSIM_ASYNC=1: launches return at once; events complete, and are
    stamped, when the stream reaches them."""
    out = run_cuda(
        sim,
        """
        import time
        ok("cuInit", 0); ctx(0)
        mod = C.c_void_p(); ok("cuModuleLoadData", C.byref(mod), b"any image")
        fn = C.c_void_p(); ok("cuModuleGetFunction", C.byref(fn), mod, b"busy")
        e0, e1, e2 = C.c_void_p(), C.c_void_p(), C.c_void_p()
        for e in (e0, e1, e2):
            ok("cuEventCreate", C.byref(e), 0)
        never = call("cuEventQuery", e2)  # never recorded: complete
        ok("cuEventRecord", e0, None)
        t = time.monotonic()
        for _ in range(3):
            ok("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        call_s = time.monotonic() - t
        ok("cuEventRecord", e1, None)
        pending = call("cuEventQuery", e1)
        ms = C.c_float()
        early = call("cuEventElapsedTime", C.byref(ms), e0, e1)
        squery = call("cuStreamQuery", None)
        busy_counted = S.read_state(os.environ["NVSIM_STATE"]).proc(os.getpid(), 0).kernels
        ok("cuEventSynchronize", e1)
        waited = time.monotonic() - t
        ok("cuEventElapsedTime", C.byref(ms), e0, e1)
        done = call("cuEventQuery", e1)
        # a stream that waits on e1 starts its work after it
        s = C.c_void_p(); ok("cuStreamCreate", C.byref(s), 0)
        ok("cuLaunchKernel", fn, 1, 1, 1, 1, 1, 1, 0, None, None, None)
        ok("cuEventRecord", e2, None)
        ok("cuStreamWaitEvent", s, e2, 0)
        ok("cuEventRecord", e0, s)
        after = call("cuEventQuery", e0)
        ok("cuStreamSynchronize", s)
        t = time.monotonic(); ok("cuCtxSynchronize"); ctx_wait = time.monotonic() - t
        out = [never, call_s < 0.03, pending, early, squery, busy_counted, waited >= 0.06,
               59.0 <= ms.value < 90, done, after, ctx_wait < 0.01]
        """,
        state_file,
        env={"NVSIM_KERNEL_US": "20000", "NVSIM_ASYNC": "1"},
    )
    assert out == [0, True, 600, 600, 600, 3, True, True, 0, 600, True]
