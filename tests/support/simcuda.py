"""What tests/integration/test_sim_cuda_*.py share: a 3-GPU topology of small GPUs (1 GiB
each; GPU 2 has two MIG devices) whose simulated CUDA driver (csrc/cuda_mock.c) is built
once per module. Every check runs in a subprocess, since the mock enumerates devices once
per process: either the sample, or a small ctypes harness (run_cuda) that loads
libcuda.so.1 and reports JSON. Each test gets its own state file, so the shared accounting
it reads is its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nvctk.sim.topology import make_topology
from support.devnodes import make_dev
from support.simdriver import build_sim_driver

MIB = 1 << 20
GPU_MIB = 1024

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
