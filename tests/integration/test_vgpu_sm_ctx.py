"""SM share and the current context: libvgpu caches each thread's current device
for the launch path and asks the driver again after any wrapped call that can
switch, create, destroy or reset a context. A stale answer would charge a launch
to the wrong device's bucket. Two simulated GPUs, an SM limit of 25 % on GPU 0
only; one process alternates 100 us kernels (asynchronous launches: most take the
fast path, charged an estimate) between the GPUs, switching contexts
between launches in each way the driver API offers, with the entry points taken
by dlsym or by cuGetProcAddress (as the CUDA runtime does). Judged by the
simulated GPUs' busy counters: charged right, GPU 0 gets ~25 % (and, the loop
alternating, GPU 1 as much); a GPU 0 launch taken for GPU 1 escapes its limit
(GPU 0 at ~50 %), a GPU 1 launch charged to GPU 0 halves both (~12.5 %)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H

from support.libvgpu import CU_PRELUDE, loop_share

pytestmark = [pytest.mark.slow, pytest.mark.exclusive]  # shares over wall-clock windows

SWITCH_LOOP = r"""
import ctypes as C, sys, threading, time
cu = C.CDLL("libcuda.so.1")
pattern, resolve, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
PROTO = {}
def fn(name):
    if resolve == "dlsym":
        f = getattr(cu, name)
    else:  # the CUDA runtime's way: cuGetProcAddress_v2 with the base name
        base = name[:-3] if name.endswith(("_v2", "_v3")) else name
        p, st = C.c_void_p(), C.c_int()
        gpa = cu.cuGetProcAddress_v2
        r = gpa(base.encode(), C.byref(p), 12040, C.c_ulonglong(0), C.byref(st))
        if r or not p.value: raise SystemExit(f"cuGetProcAddress({base}) = {r}")
        f = C.CFUNCTYPE(C.c_int)(p.value)
    return f
def ok(name, *a):
    f = PROTO.get(name) or PROTO.setdefault(name, fn(name))
    f.restype = C.c_int
    r = f(*a)
    if r: raise SystemExit(f"{name} returned {r}")
ok("cuInit", 0)
dev = [C.c_int(), C.c_int()]
ok("cuDeviceGet", C.byref(dev[0]), 0); ok("cuDeviceGet", C.byref(dev[1]), 1)
def primary(i):
    c = C.c_void_p(); ok("cuDevicePrimaryCtxRetain", C.byref(c), dev[i]); return c
def kernel():
    m, f = C.c_void_p(), C.c_void_p()
    ok("cuModuleLoadData", C.byref(m), b"any image"); ok("cuModuleGetFunction", C.byref(f), m, b"busy")
    return f
def launch(f):
    ok("cuLaunchKernel", f, 1, 1, 1, 1, 1, 1, 0, None, None, None)
c0, c1 = primary(0), primary(1)
ok("cuCtxSetCurrent", c0); f0 = kernel()
ok("cuCtxSetCurrent", c1); f1 = kernel()
end = time.monotonic() + seconds
n = 0
if pattern == "setcurrent":
    while time.monotonic() < end:
        ok("cuCtxSetCurrent", c0); launch(f0)
        ok("cuCtxSetCurrent", c1); launch(f1); n += 1
elif pattern == "pushpop":  # GPU 1 current; GPU 0's context pushed for one launch, popped
    ok("cuCtxSetCurrent", c1)
    while time.monotonic() < end:
        ok("cuCtxPushCurrent_v2", c0); launch(f0)
        ok("cuCtxPopCurrent_v2", None); launch(f1); n += 1
elif pattern == "create":  # a new context on GPU 0 each time (made current), destroyed (popped)
    ok("cuCtxSetCurrent", c1)
    while time.monotonic() < end:
        c = C.c_void_p()
        if resolve == "dlsym": ok("cuCtxCreate_v2", C.byref(c), 0, dev[0])
        else: ok("cuCtxCreate_v3", C.byref(c), None, 0, 0, dev[0])  # what "cuCtxCreate" at 12040 is
        launch(kernel())
        ok("cuCtxDestroy_v2", c); launch(f1); n += 1
elif pattern == "reset":  # GPU 0's primary context reset and retained again between launches
    while time.monotonic() < end:
        ok("cuCtxSetCurrent", c0); launch(f0)
        ok("cuCtxSetCurrent", c1); launch(f1)
        ok("cuDevicePrimaryCtxReset_v2", dev[0]); c0 = primary(0)
        ok("cuCtxSetCurrent", c0); f0 = kernel(); n += 1
elif pattern == "threads":  # one thread per GPU, each with its own current context, both greedy
    counts = [0, 0]
    def run(i, c, f):
        ok("cuCtxSetCurrent", c)
        while time.monotonic() < end:
            launch(f); counts[i] += 1
    ts = [threading.Thread(target=run, args=(0, c0, f0)), threading.Thread(target=run, args=(1, c1, f1))]
    for t in ts: t.start()
    for t in ts: t.join()
    n = min(counts)
print(n)
"""


def run_pattern(tmp_path: Path, pattern: str, resolve: str) -> list[float]:
    """GPU 0's and GPU 1's busy share (%) over the window."""
    H.build()
    driver = H.make_driver(tmp_path / "sim", gpus=2, memory_mib=8192)
    env = driver.env(tmp_path / "state", NVSIM_KERNEL_US="100", NVSIM_ASYNC="1",
                     CUDA_DEVICE_SM_LIMIT_0="25",
                     CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"), LD_PRELOAD=str(H.LIB))
    # a 2.5 s window: a wrong charge moves GPU 0 to ~50 % or ~12.5 %, far outside 18-32 %
    return loop_share(tmp_path / "state", [sys.executable, "-c", SWITCH_LOOP, pattern, resolve],
                      env, devices=2, window=2.5)


@pytest.mark.parametrize("resolve", ["dlsym", "proc"])
@pytest.mark.parametrize("pattern", ["setcurrent", "pushpop", "create", "reset"])
def test_switching_contexts_charges_each_launch_to_its_device(pattern: str, resolve: str, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (device nodes)")
    g0, g1 = run_pattern(tmp_path, pattern, resolve)
    # right: ~25 % each (the loop alternates); GPU 0 launches taken for GPU 1: ~50 %;
    # GPU 1 launches charged to GPU 0: ~12.5 % each
    assert 18 <= g0 <= 32, f"{pattern}/{resolve}: GPU 0 at {g0:.1f} % under a 25 % limit (GPU 1 {g1:.1f} %)"
    assert g1 >= 18, f"{pattern}/{resolve}: GPU 1 (no limit) at {g1:.1f} %"


def test_threads_on_two_devices_each_charge_their_own(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (device nodes)")
    g0, g1 = run_pattern(tmp_path, "threads", "dlsym")
    assert 18 <= g0 <= 32, f"GPU 0 at {g0:.1f} % under a 25 % limit"
    # GPU 1 has no limit: its thread keeps it busy (charged to GPU 0, it would get ~25 % at most)
    assert g1 >= 60, f"GPU 1 (no limit) at {g1:.1f} %"


EX_LOOP = CU_PRELUDE + r"""
cfg = Cfg((C.c_uint * 3)(1, 1, 1), (C.c_uint * 3)(1, 1, 1), 0, None, None, 0)
end = time.monotonic() + float(sys.argv[1])
n = 0
while time.monotonic() < end:  # bursts of 15 x 100 us every ~6.2 ms: ~24 % of the GPU
    for _ in range(15):
        ok("cuLaunchKernelEx", C.byref(cfg), fn, None, None); n += 1
    time.sleep(0.006)
print(n)
"""


def test_a_launch_the_driver_reenters_is_charged_once(tmp_path: Path) -> None:
    """The simulated cuLaunchKernelEx calls cuLaunchKernel through the PLT. libvgpu learns
    that (its first, guarded, call sees the inner wrapper entered) and keeps calling it
    guarded, also on the fast path, so the inner launch is not charged again. A process
    asking ~24 % of the GPU in bursts under a 25 % limit (most launches take the fast
    path) gets it (24.5 % measured); calling the driver's cuLaunchKernelEx unguarded, the
    inner launch charged again, held it to 17 %."""
    if os.geteuid() != 0:
        pytest.skip("needs root (device nodes)")
    H.build()
    driver = H.make_driver(tmp_path / "sim", gpus=1, memory_mib=4096)
    env = driver.env(tmp_path / "state", NVSIM_KERNEL_US="100", NVSIM_ASYNC="1", CUDA_DEVICE_SM_LIMIT="25",
                     CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"), LD_PRELOAD=str(H.LIB))
    share, = loop_share(tmp_path / "state", [sys.executable, "-c", EX_LOOP], env)
    assert 20 <= share <= 26.5, f"cuLaunchKernelEx: {share:.1f} % of the GPU (~24 % asked) under a 25 % limit"
