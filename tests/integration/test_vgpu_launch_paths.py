"""Every entry point that starts device work or holds device memory is wrapped (issue
25, family 10): the legacy launches (cuLaunch, cuLaunchGrid, cuLaunchGridAsync),
cuLaunchCooperativeKernelMultiDevice and graph memory-allocation nodes, whether the
program reaches them by linking, dlsym or cuGetProcAddress; and the SM estimate of a
launch shape cannot be steered by making only some of its runs cheap. Judged by the
simulated GPU's own counters."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H

from nvctk.sim.state import read_state
from support.libvgpu import CU_PRELUDE, LAUNCH_FOR, driver_of, loop_share

# shares measured over wall-clock windows: run alone (tests/README.md)
pytestmark = pytest.mark.exclusive

MIB = H.MIB
LIMIT = 25


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> H.Driver:
    return driver_of(tmp_path_factory, "vgpu-paths")


# How the program finds an entry point: dlsym on libcuda's handle (CU_PRELUDE's `cu`),
# the process's global scope (the preloaded exports, as a linked program binds), or
# cuGetProcAddress_v2 with a CUDA version (the CUDA runtime's way).
RESOLVE = r"""
how = sys.argv[1]
if how == "link":  # a linked program has libcuda in its global scope, after the preloaded library
    C.CDLL("libcuda.so.1", mode=C.RTLD_GLOBAL)
glob = C.CDLL(None)
def entry(name, *argtypes):
    if how == "dlsym":
        f = getattr(cu, name)
    elif how == "link":
        f = getattr(glob, name)
    else:
        p, st = C.c_void_p(), C.c_int()
        g = cu.cuGetProcAddress_v2; g.restype = C.c_int
        r = g(name.encode(), C.byref(p), 12040, C.c_ulonglong(0), C.byref(st))
        if r or not p.value: raise SystemExit(f"cuGetProcAddress({name}) returned {r}")
        f = C.CFUNCTYPE(C.c_int, *argtypes)(p.value)
    f.restype = C.c_int
    return f
def must(f, *a):
    r = f(*a)
    if r: raise SystemExit(f"returned {r}")
"""

LEGACY_LOOP = CU_PRELUDE + RESOLVE + r"""
kind, seconds = sys.argv[2], float(sys.argv[-1])
shape = entry("cuFuncSetBlockShape", C.c_void_p, C.c_int, C.c_int, C.c_int)
must(shape, fn, 32, 1, 1)
if kind == "launch":
    f = entry("cuLaunch", C.c_void_p); launch = lambda: must(f, fn)
elif kind == "grid":
    f = entry("cuLaunchGrid", C.c_void_p, C.c_int, C.c_int); launch = lambda: must(f, fn, 2, 1)
elif kind == "gridasync":
    f = entry("cuLaunchGridAsync", C.c_void_p, C.c_int, C.c_int, C.c_void_p); launch = lambda: must(f, fn, 2, 1, None)
else:
    class LP(C.Structure):
        _fields_ = [("function", C.c_void_p), ("dims", C.c_uint * 7), ("stream", C.c_void_p),
                    ("params", C.c_void_p)]
    s = C.c_void_p(); ok("cuStreamCreate", C.byref(s), 0)
    lp = LP(fn, (C.c_uint * 7)(1, 1, 1, 1, 1, 1, 0), s, None)
    f = entry("cuLaunchCooperativeKernelMultiDevice", C.c_void_p, C.c_uint, C.c_uint)
    launch = lambda: must(f, C.byref(lp), 1, 0)
""" + LAUNCH_FOR


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "how"), [("launch", "link"), ("grid", "dlsym"), ("gridasync", "proc"),
                                           ("multidevice", "proc"), ("multidevice", "link")])
def test_every_launch_entry_point_is_gated(kind: str, how: str, driver: H.Driver, tmp_path: Path) -> None:
    """A greedy loop of 2 ms kernels through each entry point gets its share
    (ungated it keeps the GPU fully busy)."""
    env = driver.env(tmp_path / "state", NVSIM_KERNEL_US="2000", CUDA_DEVICE_SM_LIMIT=str(LIMIT),
                     CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"),
                     LD_PRELOAD=str(H.LIB), PYTHONPATH=os.pathsep.join(sys.path))
    share, = loop_share(tmp_path / "state", [sys.executable, "-c", LEGACY_LOOP, how, kind], env,
                        window=2.5)  # ungated ~100 %: far above the bound
    assert share <= LIMIT + 10, f"{kind} via {how}: {share:.1f} % of the GPU under a {LIMIT} % limit"


GRAPH_MEM = CU_PRELUDE + RESOLVE + r"""
size, n_exec = int(sys.argv[2]), int(sys.argv[3])
class Props(C.Structure):
    _fields_ = [("alloc_type", C.c_int), ("handle_types", C.c_int), ("loc_type", C.c_int), ("loc_id", C.c_int),
                ("win32", C.c_void_p), ("max_size", C.c_size_t), ("usage", C.c_ushort),
                ("reserved", C.c_ubyte * 54)]
class AllocParams(C.Structure):
    _fields_ = [("props", Props), ("access", C.c_void_p), ("naccess", C.c_size_t), ("bytesize", C.c_size_t),
                ("dptr", C.c_ulonglong)]
add = entry("cuGraphAddMemAllocNode", C.c_void_p, C.c_void_p, C.c_void_p, C.c_size_t, C.c_void_p)
inst = entry("cuGraphInstantiateWithFlags", C.c_void_p, C.c_void_p, C.c_ulonglong)
destroy = entry("cuGraphExecDestroy", C.c_void_p)
g, node = C.c_void_p(), C.c_void_p()
ok("cuGraphCreate", C.byref(g), 0)
p = AllocParams(Props(1, 0, 1, 0), None, 0, size, 0)
must(add, C.byref(node), g, None, C.c_size_t(0), C.byref(p))
execs, results = [], []
for _ in range(n_exec):
    x = C.c_void_p()
    results.append(inst(C.byref(x), g, C.c_ulonglong(0)))
    execs.append(x)
print("instantiate", *results, flush=True)
sys.stdin.readline()  # the test reads the GPU's counters while the execs hold their memory
first = next(x for x, r in zip(execs, results) if r == 0)
must(destroy, first)
x = C.c_void_p()
print("again", inst(C.byref(x), g, C.c_ulonglong(0)), flush=True)
"""


@pytest.mark.parametrize("how", ["link", "dlsym", "proc"])
def test_graph_allocations_are_charged_per_instantiated_graph(how: str, driver: H.Driver, tmp_path: Path) -> None:
    """A graph with a 384 MiB allocation node, instantiated 3 times under a 512 MiB
    cap (the context holds 64 MiB): one instantiation fits, the others are refused,
    the GPU's own count stays within the cap, and destroying the instantiated graph
    gives the memory back (a new instantiation fits again)."""
    env = driver.env(tmp_path / "state", CUDA_DEVICE_MEMORY_LIMIT="512m",
                     CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"),
                     LD_PRELOAD=str(H.LIB), PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-c", GRAPH_MEM, how, str(384 * MIB), "3"], env=env, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout and p.stdin
    first = p.stdout.readline()
    used = read_state(tmp_path / "state").gpus[0].mem_used
    p.stdin.write("\n")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, first + out + err
    assert first.split() == ["instantiate", "0", "2", "2"], first + err  # CUDA_ERROR_OUT_OF_MEMORY
    assert used <= 512 * MIB, f"{used / MIB:.0f} MiB on the GPU under a 512 MiB cap ({how})"
    assert out.split() == ["again", "0"], out + err


STEER = CU_PRELUDE + r"""
cheap_us, dear_us, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[-1])
spin = C.c_void_p(); ok("cuModuleGetFunction", C.byref(spin), mod, b"spin")
us = C.c_uint(0)
params = (C.c_void_p * 1)(C.cast(C.pointer(us), C.c_void_p))
end = time.monotonic() + seconds
n = 0
while time.monotonic() < end:
    us.value = dear_us if n % 2 else cheap_us  # one shape, alternately cheap and expensive
    ok("cuLaunchKernel", spin, 1, 1, 1, 1, 1, 1, 0, None, params, None); n += 1
print(n)
"""


@pytest.mark.slow
@pytest.mark.parametrize(("cheap_us", "dear_us"), [(20, 4000), (500, 5000)])
def test_alternating_cheap_and_expensive_runs_stay_within_the_share(cheap_us: int, dear_us: int,
                                                                     driver: H.Driver, tmp_path: Path) -> None:
    """One kernel and shape, its runs alternately cheap and expensive: the share
    holds (charged by its cheapest run, it got several times the share)."""
    env = driver.env(tmp_path / "state", CUDA_DEVICE_SM_LIMIT=str(LIMIT),
                     CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"),
                     LD_PRELOAD=str(H.LIB), PYTHONPATH=os.pathsep.join(sys.path))
    if os.environ.get("NVSIM_ASYNC"):
        env["NVSIM_ASYNC"] = os.environ["NVSIM_ASYNC"]
    share, = loop_share(tmp_path / "state", [sys.executable, "-c", STEER, str(cheap_us), str(dear_us)], env)
    assert share <= LIMIT + 5, f"{share:.1f} % of the GPU under a {LIMIT} % limit ({cheap_us}/{dear_us} us runs)"
