"""The simulated driver's nvidia-smi (list, queries, apps, no driver without nvidiactl)
and its build (stub libraries, libc only, the topology header). How everything is built
and each check runs: tests/support/simnvml.py; the rest: test_sim_nvml_pynvml.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import support.simnvml as _simnvml
from nvctk.sim import build
from nvctk.sim.topology import make_topology
from support.devnodes import make_dev
from support.simnvml import GPU0, GPU1, MIB, MIG0, MIG1, TOPO, Helper, Sim, smi

sim, state_file, helpers = _simnvml.sim, _simnvml.state_file, _simnvml.helpers  # fixtures

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


# ---- nvidia-smi ----


def test_smi_list(sim: Sim, state_file: Path) -> None:
    assert smi(sim, "-L", state_file=state_file) == (
        f"GPU 0: {GPU0.name} (UUID: {GPU0.uuid})\n"
        f"  MIG 1g.10gb     Device  0: (UUID: {MIG0.uuid})\n"
        f"  MIG 2g.20gb     Device  1: (UUID: {MIG1.uuid})\n"
        f"GPU 1: {GPU1.name} (UUID: {GPU1.uuid})\n"
    )


def test_no_nvidiactl_is_no_driver(sim: Sim, state_file: Path, tmp_path: Path) -> None:
    """As the real library: without /dev/nvidiactl (the module unloaded) init fails with
    Driver Not Loaded, and nvidia-smi says it cannot reach the driver."""
    dev = make_dev(tmp_path / "dev", TOPO, [0, 1])
    (dev / "nvidiactl").unlink()
    script = "import pynvml\ntry:\n    pynvml.nvmlInit()\nexcept pynvml.NVMLError as e:\n" \
             "    print(e.value, e)\n"
    r = subprocess.run([sys.executable, "-c", script], env=sim.env(state_file, dev),
                       capture_output=True, text=True, timeout=30)
    assert r.stdout == "9 Driver Not Loaded\n", r.stdout + r.stderr
    r = subprocess.run([str(sim.smi), "-L"], env=sim.env(state_file, dev), capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 9 and r.stdout == "", r
    assert "couldn't communicate with the NVIDIA driver" in r.stderr, r.stderr


QUERY = "index,uuid,name,memory.total,memory.used,memory.free"


@pytest.mark.parametrize(
    ("fmt", "header", "unit"),
    [
        (
            "csv",
            "index, uuid, name, memory.total [MiB], memory.used [MiB], memory.free [MiB]",
            " MiB",
        ),
        ("csv,nounits", "index, uuid, name, memory.total, memory.used, memory.free", ""),
        ("csv,noheader", None, " MiB"),
        ("csv,noheader,nounits", None, ""),
    ],
)
def test_smi_query_gpu(
    sim: Sim, state_file: Path, helpers: list[Helper], fmt: str, header: str | None, unit: str
) -> None:
    helpers.append(Helper(sim, state_file, "charge", 1, 300 * MIB))
    out = smi(sim, f"--query-gpu={QUERY}", f"--format={fmt}", state_file=state_file)
    rows = [
        f"{g.index}, {g.uuid}, {g.name}, {g.memory_mib}{unit}, {used}{unit}, "
        f"{g.memory_mib - used}{unit}"
        for g, used in ((GPU0, 0), (GPU1, 300))
    ]
    assert out.splitlines() == ([header] if header else []) + rows


def test_smi_query_apps_and_table(sim: Sim, state_file: Path, helpers: list[Helper]) -> None:
    h = Helper(sim, state_file, "charge", 0, 512 * MIB)
    helpers.append(h)
    out = smi(
        sim,
        "--query-compute-apps=pid,gpu_uuid,used_memory",
        "--format=csv,noheader",
        state_file=state_file,
    )
    assert out == f"{h.pid}, {GPU0.uuid}, 512 MiB\n"
    table = smi(sim, state_file=state_file)
    assert f"Driver Version: {TOPO.driver_version}" in table
    assert "  512/81920MiB" in table
    assert f"    0 {h.pid:>10}   512 MiB" in table


def test_smi_rejects_unknown_field(sim: Sim, state_file: Path) -> None:
    r = subprocess.run(
        [str(sim.smi), "--query-gpu=bogus", "--format=csv"],
        env=sim.env(state_file),
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert '"bogus" is not a valid field' in r.stderr


# ---- building ----


def test_stub_libraries(tmp_path: Path) -> None:
    names = [f"libnvidia-stub{i}.so.1" for i in range(40)]
    for n in names:
        build.build_stub_library(str(tmp_path / n.replace(".so.1", ".so.550.54.15")), n)
    for n in (names[0], names[-1]):
        r = subprocess.run(
            ["readelf", "-d", str(tmp_path / n.replace(".so.1", ".so.550.54.15"))],
            capture_output=True,
            text=True,
            check=True,
        )
        assert f"Library soname: [{n}]" in r.stdout
    # and it is a loadable library
    import ctypes

    ctypes.CDLL(str(tmp_path / "libnvidia-stub0.so.550.54.15")).nvsim_stub_library()


def test_driver_libs_need_only_libc(sim: Sim) -> None:
    lib = sim.lib / f"libnvidia-ml.so.{TOPO.driver_version}"
    r = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True)
    needed = {
        line.split("[")[1].rstrip("]") for line in r.stdout.splitlines() if "(NEEDED)" in line
    }
    assert needed <= {"libc.so.6", "libpthread.so.0", "libdl.so.2"}
    assert "Library soname: [libnvidia-ml.so.1]" in r.stdout


def test_topology_header_escapes_strings() -> None:
    topo = make_topology(1, product='Odd "GPU" \\ name')
    header = build.generate_topology_header(topo, "/sim/root")
    assert r'"Odd \"GPU\" \\ name"' in header
    assert '"/sim/root"' in header
