"""libvgpu's own test harness (libvgpu/tests/harness.py: the library built, a simulated
driver of its own) for nvctk's tests of libvgpu."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nvctk.sim.state import read_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H


def driver_of(factory: pytest.TempPathFactory, name: str) -> H.Driver:
    """libvgpu built and a simulated driver of 1 GPU of 8 GiB; skips without root."""
    if os.geteuid() != 0:
        pytest.skip("needs root (device nodes)")
    H.build()
    return H.make_driver(factory.mktemp(name), gpus=1, memory_mib=8192)


# The head of a launch loop run as `python -c`: the driver by ctypes, `ok` (a call that
# must succeed), GPU 0's primary context current, a kernel `fn`, and Cfg
# (CUlaunchConfig) for cuLaunchKernelEx. The loop ends after sys.argv[-1] seconds and
# prints how many launches it made (loop_share).
CU_PRELUDE = r"""
import ctypes as C, os, sys, time
cu = C.CDLL("libcuda.so.1")
def ok(name, *a):
    f = getattr(cu, name); f.restype = C.c_int
    r = f(*a)
    if r: raise SystemExit(f"{name} returned {r}")
ok("cuInit", 0)
ctx = C.c_void_p(); ok("cuDevicePrimaryCtxRetain", C.byref(ctx), 0); ok("cuCtxSetCurrent", ctx)
mod, fn = C.c_void_p(), C.c_void_p()
ok("cuModuleLoadData", C.byref(mod), b"any image"); ok("cuModuleGetFunction", C.byref(fn), mod, b"busy")
class Cfg(C.Structure):
    _fields_ = [("g", C.c_uint * 3), ("b", C.c_uint * 3), ("shmem", C.c_uint),
                ("stream", C.c_void_p), ("attrs", C.c_void_p), ("nattrs", C.c_uint)]
"""


# The tail of such a loop: calls `launch()` until `seconds` have passed, prints the count.
LAUNCH_FOR = r"""
end = time.monotonic() + seconds
n = 0
while time.monotonic() < end:
    launch(); n += 1
print(n)
"""

# how long a measured loop runs on past its window: the window's last reading comes
# while it still launches (the reading takes a few ms); every second the loops run more
# is a second of make test's exclusive phase
TAIL = 0.25


def loop_share(state: Path, argv: list[str], env: dict[str, str], devices: int = 1,
               warmup: float = 1.0, window: float = 4.0) -> list[float]:
    """Run a launch loop (argv, given its running time as its last argument) and return
    its busy share (%) of each of the first `devices` GPUs over `window` s after `warmup`,
    from the simulated GPUs' counters (state: its state file). The sleeps are the
    measurement's window, not a wait for an event."""
    p = subprocess.Popen([*argv, str(warmup + window + TAIL)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        def busy() -> list[int]:
            st = read_state(state)
            return [s.busy_ns if (s := st.proc(p.pid, d)) else 0 for d in range(devices)]

        time.sleep(warmup)
        b0, t0 = busy(), time.monotonic()
        time.sleep(window)
        b1, t1 = busy(), time.monotonic()
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err
    assert int(out) > 0, out
    return [100 * (x1 - x0) / ((t1 - t0) * 1e9) for x0, x1 in zip(b0, b1, strict=True)]
