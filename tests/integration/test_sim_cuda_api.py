"""The simulated CUDA driver (csrc/cuda_mock.c): which devices a process sees
(CUDA_VISIBLE_DEVICES, device nodes, properties) and its entry points (cuGetProcAddress,
the CUDA 12.4 API list, exports, stubs, the build cache). How each check runs:
tests/support/simcuda.py; the rest: test_sim_cuda_memory.py, test_sim_cuda_kernels.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

import support.simcuda as _simcuda
from nvctk.sim import apilist, build
from nvctk.sim.topology import make_topology
from support.devnodes import make_dev
from support.simcuda import G0, G1, G2, GPU_MIB, M0, M1, MIB, TOPO, Sim, run_cuda, uuid_hex
from support.simdriver import build_sim_driver

sim, state_file = _simcuda.sim, _simcuda.state_file  # fixtures

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


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
