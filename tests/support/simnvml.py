"""What tests/integration/test_sim_nvml_*.py share: the simulated driver (real pynvml over
the mock NVML, nvidia-smi, the shared state), built once into a module tmp dir from a
2-GPU topology (GPU 0 with MIG). Each check runs in a subprocess, since the mock reads
NVSIM_DEV_DIR and enumerates devices once per process and the loader finds it by
LD_LIBRARY_PATH. A small C helper linked with nvsim_state.c stands in for the mock
libcuda's users (charging memory, running kernels) so these tests need only this part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from nvctk.sim import build, state
from nvctk.sim.topology import make_topology
from support.devnodes import make_dev
from support.procs import kill_left
from support.simdriver import build_sim_driver

MIB = 1 << 20
TOPO = make_topology(2, mig={0: ["1g.10gb", "2g.20gb"]}, seed="test_sim_nvml")
GPU0, GPU1 = TOPO.gpus
MIG0, MIG1 = GPU0.mig_devices

# Charges/credits memory and runs kernels through nvsim_state.c, as libcuda does;
# prints "ready" and then holds its slot until stdin closes (or it is killed).
HELPER_C = r"""
#include "nvsim_state.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
int main(int argc, char **argv)
{
    struct nvsim_state *st = nvsim_state_open();
    char buf[16];
    if (!st)
        return 3;
    for (int i = 1; i + 2 < argc; i += 3) {
        unsigned gpu = (unsigned)atoi(argv[i + 1]);
        unsigned long long n = strtoull(argv[i + 2], NULL, 10);
        if (!strcmp(argv[i], "charge") && nvsim_mem_charge(st, gpu, n) != 0)
            return 4;
        if (!strcmp(argv[i], "credit"))
            nvsim_mem_credit(st, gpu, n);
        if (!strcmp(argv[i], "kernels"))
            for (unsigned long long k = 0; k < n; k++)
                nvsim_run_kernel(st, gpu, 1000000);
    }
    printf("ready\n");
    fflush(stdout);
    while (read(0, buf, sizeof buf) > 0)
        ;
    return 0;
}
"""

# offsetof() of every field state.py reads, compared with state.OFFSETS
OFFSETS_C_HEAD = (
    '#include "nvsim_state.h"\n#include <stddef.h>\n#include <stdio.h>\nint main(void)\n{\n'
)


@dataclass(frozen=True)
class Sim:
    root: Path
    lib: Path
    smi: Path
    dev: Path
    helper: Path
    offsets: Path
    tmp: Path

    def env(self, state_file: Path, dev: Path | None = None) -> dict[str, str]:
        return {
            **os.environ,
            "LD_LIBRARY_PATH": str(self.lib),
            "NVSIM_DEV_DIR": str(dev or self.dev),
            "NVSIM_STATE": str(state_file),
        }


def _gcc(*args: str) -> None:
    subprocess.run(["gcc", *build.CFLAGS, *args, "-lpthread"], check=True)


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Sim:
    tmp = tmp_path_factory.mktemp("simnvml")
    root, lib, bindir = build_sim_driver(tmp, TOPO)
    inc = tmp / "inc"
    inc.mkdir()
    (inc / "nvsim_topology.h").write_text(build.generate_topology_header(TOPO, str(root)))
    (tmp / "helper.c").write_text(HELPER_C)
    _gcc(
        f"-I{inc}",
        f"-I{build.CSRC}",
        "-o",
        str(tmp / "helper"),
        str(tmp / "helper.c"),
        str(build.CSRC / "nvsim_state.c"),
    )
    lines = [OFFSETS_C_HEAD]
    for key in state.OFFSETS:
        expr = (
            key if key.startswith("sizeof") else "offsetof(struct {}, {})".format(*key.split("."))
        )
        lines.append(f'    printf("%s %zu\\n", "{key}", {expr});\n')
    (tmp / "offsets.c").write_text("".join([*lines, "    return 0;\n}\n"]))
    _gcc(f"-I{build.CSRC}", "-o", str(tmp / "offsets"), str(tmp / "offsets.c"))
    dev = make_dev(tmp / "dev", TOPO, [0, 1])
    return Sim(root, lib, bindir / "nvidia-smi", dev, tmp / "helper", tmp / "offsets", tmp)


@pytest.fixture
def state_file(tmp_path: Path) -> Path:
    return tmp_path / "state"


def run_py(sim: Sim, code: str, state_file: Path, dev: Path | None = None) -> Any:
    """Runs `code` (which sets `out`) under pynvml in a subprocess; returns out."""
    script = "import json, pynvml\npynvml.nvmlInit()\n" + textwrap.dedent(code)
    script += "\npynvml.nvmlShutdown()\nprint(json.dumps(out))\n"
    r = subprocess.run(
        [sys.executable, "-c", script],
        env=sim.env(state_file, dev),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.splitlines()[-1])


def smi(sim: Sim, *args: str, state_file: Path, dev: Path | None = None) -> str:
    r = subprocess.run(
        [str(sim.smi), *args], env=sim.env(state_file, dev), capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


class Helper:
    """A process holding GPU memory through the shared state."""

    def __init__(self, sim: Sim, state_file: Path, *ops: str | int, wait: bool = True) -> None:
        self.proc = subprocess.Popen(
            [str(sim.helper), *map(str, ops)],
            env=sim.env(state_file),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"helper exited {self.proc.wait()}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(10)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def helpers() -> Iterator[list[Helper]]:
    started: list[Helper] = []
    yield started
    kill_left((h.proc for h in started), 10)


GPU_MIB = GPU0.memory_mib
