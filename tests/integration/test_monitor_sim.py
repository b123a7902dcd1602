"""What the monitor needs of the simulated NVML, with the real API's semantics:
processes in their own pid namespaces (each pid 1 there) listed by their host pids, as the
real driver reports them; per-process utilization samples since a timestamp, matching the
sim's busy counters, and NOT_FOUND when nothing ran since."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nvctk.host import nvml
from nvctk.sim import host
from nvctk.sim.state import read_state, state_path
from nvctk.sim.topology import make_topology
from support.monitor import MIB, PROBE, REPO, wait_until
from support.procs import kill_left

pytestmark = [pytest.mark.slow,  # builds a sim, runs kernels for seconds
              pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                 reason="needs root (sim device nodes, pid namespaces)")]


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> host.SimHost:
    subprocess.run(["make", "-s", "-C", str(REPO / "libvgpu")], check=True, capture_output=True)
    return host.init(str(tmp_path_factory.mktemp("monsim") / "host"),
                     make_topology(gpus=2, seed="monitor-sim"))


class Probe:
    """vgpu_probe on the sim's libcuda, in a pid namespace of its own (pid 1 there)."""

    def __init__(self, sim: host.SimHost, *cmds: str, own_ns: bool = True) -> None:
        argv = [str(PROBE), *cmds, "wait"]
        if own_ns:
            argv = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
        self.p = subprocess.Popen(argv, env={**os.environ, "LD_LIBRARY_PATH": sim.lib_dir},
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.p.stdout is not None
        for line in self.p.stdout:
            if line.startswith("ready"):
                break
            assert line.split()[1] == "0", line
        else:
            raise AssertionError(f"probe exited {self.p.wait()}")
        self.host_pid = self.p.pid
        if own_ns:  # unshare's forked child is the probe
            kids = Path(f"/proc/{self.p.pid}/task/{self.p.pid}/children").read_text().split()
            self.host_pid = int(kids[0])

    def stop(self) -> None:
        assert self.p.stdin is not None
        self.p.stdin.close()
        self.p.wait(30)


@pytest.fixture
def probes() -> Iterator[list[Probe]]:
    out: list[Probe] = []
    yield out
    kill_left(p.p for p in out)


def test_processes_in_pid_namespaces_are_listed_by_host_pid(sim: host.SimHost,
                                                              probes: list[Probe]) -> None:
    for i in range(3):
        probes.append(Probe(sim, "init", "ctx", "0", "alloc", str((10 + i) * MIB)))
    st = read_state(state_path(sim.root), live_only=True)
    # the sim records each as pid 1 of its own namespace, as the container sees itself
    assert sorted(p.pid for p in st.procs_on(0)) == [1, 1, 1]
    with nvml.session(sim.root):
        nv = nvml.pynvml
        h = nv.nvmlDeviceGetHandleByIndex(0)
        got = {p.pid: p.usedGpuMemory for p in nv.nvmlDeviceGetComputeRunningProcesses(h)}
    slot_mem = {p.pidns: p.mem_used for p in st.procs_on(0)}
    want = {p.host_pid: slot_mem[os.stat(f"/proc/{p.host_pid}/ns/pid").st_ino] for p in probes}
    assert got == want


@pytest.mark.exclusive  # utilization over wall time
def test_process_utilization_since_a_timestamp(sim: host.SimHost, probes: list[Probe]) -> None:
    busy = Probe(sim, "init", "ctx", "1", "launchfor", "1.5", own_ns=False)
    probes.append(busy)
    idle = Probe(sim, "init", "ctx", "1", "alloc", str(MIB), own_ns=False)
    probes.append(idle)
    with nvml.session(sim.root):
        nv = nvml.pynvml
        h = nv.nvmlDeviceGetHandleByIndex(1)
        # launchfor ran before "ready": its kernels are in the last 1.5 s
        start = int((time.time() - 1.2) * 1e6)
        st = read_state(state_path(sim.root), live_only=True)
        slot = next(p for p in st.procs_on(1) if p.pid == busy.host_pid)
        samples = nv.nvmlDeviceGetProcessUtilization(h, start)
        assert [s.pid for s in samples] == [busy.host_pid]  # the idle one has no sample
        (s,) = samples
        assert s.timeStamp > start
        # a steady duty cycle over the whole 1.5 s: the share of the span inside it is the
        # share the sim counted over all of it
        duty = slot.busy_ns / 1.5e9
        assert abs(s.smUtil / 100 - duty) <= 0.08, (s.smUtil, duty)
        # nothing ran since: NOT_FOUND, as real NVML answers
        def quiet() -> bool:
            try:
                nv.nvmlDeviceGetProcessUtilization(h, s.timeStamp)
            except nv.NVMLError as e:
                assert e.value == nv.NVML_ERROR_NOT_FOUND
                return True
            return False

        wait_until(quiet, 10, "no new samples")
