"""The simulated CUDA driver (csrc/cuda_mock.c)'s kernels: busy counters, one kernel at a
time across processes, launch paths and errors, stream capture, zero-time kernels,
asynchronous launches. How each check runs: tests/support/simcuda.py; the rest:
test_sim_cuda_memory.py, test_sim_cuda_api.py.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

import support.simcuda as _simcuda
from nvctk.sim import state
from support.simcuda import Sim, run_cuda, sample

sim, state_file = _simcuda.sim, _simcuda.state_file  # fixtures

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


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
