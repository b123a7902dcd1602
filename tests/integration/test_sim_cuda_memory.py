"""The simulated CUDA driver (csrc/cuda_mock.c) and the CUDA sample (cuda-vectoradd):
the sample, and memory capacity and accounting (allocation paths charge and credit, VMM,
the context reserve, processes sharing one pool, NVML seeing it, a SIGKILLed process's
memory reclaimed, MIG capacity).

The driver is built once per module from a 3-GPU topology of small GPUs (1 GiB each; GPU 2
has two MIG devices), by tests/support/simcuda.py, which says how each check runs.
Which devices a process sees and the entry points: test_sim_cuda_api.py; kernels:
test_sim_cuda_kernels.py.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import support.simcuda as _simcuda
from nvctk.sim import state
from support.simcuda import G0, G2, GPU_MIB, M0, M1, MIB, PRELUDE, Sim, run_cuda, sample, uuid_hex

sim, state_file = _simcuda.sim, _simcuda.state_file  # fixtures

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


RESERVE = 64 * MIB  # the mock's default per-context reserve


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
