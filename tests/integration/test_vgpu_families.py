"""libvgpu: the cap follows the driver's lifetime of memory.

Each family is tried through several of its members, and judged by the
simulated GPU's own count (the device counters its NVML reports as used
memory, and its busy time for the SM share), read while the attacking
process is still alive, never by libvgpu's bookkeeping:

- VMM: the physical memory of a cuMemCreate handle lives until its last
  reference (create, each cuMemRetainAllocationHandle) is released and its
  last mapping unmapped; the charge stays that long.
- stream-ordered allocation: charged to the pool's device and to the stream's
  context, whatever context is current.
- more CUDA devices than libvgpu's old 16-entry table (3 GPUs x 7 MIG devices,
  9 x 2), and more than its table (10 x 7): every device is capped or refused.
- SM share: a floor learnt on a small graph never prices a bigger one that
  reuses its exec handle.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H

from nvctk.sim.build import build_driver
from nvctk.sim.state import read_state
from nvctk.sim.topology import make_topology

MIB = H.MIB
CAP = 512 * MIB
CHUNK = 256 * MIB  # 2 MiB-granular, as cuMemCreate wants

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (device nodes)")


@pytest.fixture(scope="module")
def driver() -> Iterator[H.Driver]:
    """A two-GPU sim in a directory every uid can read (the uid 1000 members)."""
    H.build()
    root = Path(tempfile.mkdtemp(prefix="vgpu-fam-", dir="/tmp"))
    os.chmod(root, 0o755)
    try:
        yield H.make_driver(root, gpus=2, memory_mib=8192)
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


@pytest.fixture
def work() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="vgpu-fam-w-", dir="/tmp"))
    os.chmod(d, 0o777)
    try:
        yield d
    finally:
        subprocess.run(["rm", "-rf", str(d)], check=False)


def capped_env(driver: H.Driver, work: Path, **limits: str) -> dict[str, str]:
    env = driver.env(work / "state", CUDA_DEVICE_MEMORY_SHARED_CACHE=str(work / "cache"),
                     LD_PRELOAD=str(H.LIB))
    env.update(limits or {"CUDA_DEVICE_MEMORY_LIMIT": "512m"})
    return env


class Held:
    """Probe processes that ran their commands and wait: the sim is read while
    they still hold what they allocated."""

    def __init__(self) -> None:
        self.procs: list[tuple[subprocess.Popen[str], list[str]]] = []

    def start(self, env: dict[str, str], *args: str, uid: int | None = None) -> None:
        p = subprocess.Popen([str(H.PROBE), *args, "wait"], env=env, text=True, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, user=uid, group=uid)
        self.procs.append((p, []))

    def ready(self) -> None:
        for p, out in self.procs:
            assert p.stdout is not None
            for line in p.stdout:
                out.append(line)
                if line.startswith("ready"):
                    break
            else:
                raise AssertionError("".join(out) + (p.stderr.read() if p.stderr else ""))

    def finish(self) -> list[dict[str, list[list[str]]]]:
        res = []
        for p, out in self.procs:
            rest, err = p.communicate("\n", timeout=60)
            assert p.returncode == 0, "".join(out) + rest + err
            res.append(H.parse("".join(out) + rest))
        self.procs = []
        return res

    def kill(self) -> None:
        for p, _ in self.procs:
            p.kill()
            p.wait()


@pytest.fixture
def held() -> Iterator[Held]:
    h = Held()
    try:
        yield h
    finally:
        h.kill()


def sim_used(env: dict[str, str], gpu: int = 0) -> int:
    """What the simulated GPU holds for everybody (its NVML's used memory)."""
    return read_state(env["NVSIM_STATE"]).gpus[gpu].mem_used


def nvml_used(env: dict[str, str], gpu: int = 0) -> int:
    """The same, through the simulated NVML itself (no interposer)."""
    cp = H.probe(env, "nvmlmem", str(gpu), preload=False)
    r = H.parse(cp.stdout)["nvmlmem"][0]
    assert r[0] == "0", cp.stdout + cp.stderr
    return int(r[2])


def rcs(r: dict[str, list[list[str]]], cmd: str) -> list[str]:
    return [x[0] for x in r.get(cmd, [])]


# ---- VMM ------------------------------------------------------------------------------------

VMM_MEMBERS = {
    # PyTorch's expandable segments: release right after mapping; the mapping holds the memory
    "release-while-mapped": ["vmm", str(CHUNK), "vmmmap", "vmmrelease"] * 4,
    # one handle mapped twice, released, one mapping dropped: the other still holds it
    "two-mappings": ["vmm", str(CHUNK), "vmmmap", "vmmmap", "vmmrelease", "vmmunmap"] * 4,
    # a retained reference released, the creating one too, still mapped
    "retain-then-release-both": ["vmm", str(CHUNK), "vmmmap", "vmmretain", "vmmrelease", "vmmrelease"] * 4,
    # the retained reference keeps it after the mapping and the first reference go
    "retain-outlives-unmap": ["vmm", str(CHUNK), "vmmmap", "vmmretain", "vmmunmap", "vmmrelease"] * 4,
}


@pytest.mark.parametrize("member", sorted(VMM_MEMBERS))
def test_vmm_memory_is_charged_until_the_driver_frees_it(driver: H.Driver, work: Path, held: Held,
                                                        member: str) -> None:
    env = capped_env(driver, work)
    held.start(env, "init", "ctx", "0", *VMM_MEMBERS[member])
    held.ready()
    used = sim_used(env)
    assert used <= CAP and nvml_used(env) <= CAP, f"{member}: {used / MIB} MiB on the GPU under 512"
    (r,) = held.finish()
    assert rcs(r, "vmm")[0] == "0" and "2" in rcs(r, "vmm"), r  # the first fits, a later one is refused


def test_vmm_charge_comes_back_when_the_last_holder_goes(driver: H.Driver, work: Path) -> None:
    """Exact, not only safe: after unmapping (or freeing the reservation, which
    the simulated driver unmaps with it) and releasing every reference, the
    whole room is there again."""
    env = capped_env(driver, work)
    room = CAP - 64 * MIB
    big = str(room // (2 * MIB) * 2 * MIB)
    seqs = [
        ["vmm", big, "vmmmap", "vmmrelease", "vmmunmap"],
        ["vmm", big, "vmmmap", "vmmmap", "vmmrelease", "vmmunmap", "vmmunmap"],
        ["vmm", big, "vmmmap", "vmmretain", "vmmrelease", "vmmunmap", "vmmrelease"],
        ["vmm", big, "vmmmap", "vmmrelease", "vmmaddrfree"],
    ]
    for seq in seqs:
        cp = H.probe(env, "init", "ctx", "0", *seq, *seq, mode="--proc")
        r = H.parse(cp.stdout)
        assert cp.returncode == 0, cp.stdout + cp.stderr
        assert rcs(r, "vmm") == ["0", "0"], (seq, r)  # the room came back for the second round
        assert set(rcs(r, "vmmretain")) <= {"0"}, r
        assert [x[1] for x in r.get("vmmretain", [])] in ([], ["1", "1"]), r  # the same handle


@pytest.mark.parametrize("uid", [0, 1000])
def test_vmm_across_processes(driver: H.Driver, work: Path, held: Held, uid: int) -> None:
    env = capped_env(driver, work)
    for _ in range(3):
        held.start(env, "init", "ctx", "0", *VMM_MEMBERS["release-while-mapped"], uid=uid)
    held.ready()
    assert sim_used(env) <= CAP, f"{sim_used(env) / MIB} MiB under 512 (uid {uid})"
    results = held.finish()
    granted = sum(rcs(r, "vmm").count("0") for r in results)
    assert granted == 1, results  # 3 contexts (192 MiB) + one 256 MiB handle fill the cap


# ---- stream-ordered allocation --------------------------------------------------------------

def test_async_on_another_contexts_stream_survives_a_throwaway_context(driver: H.Driver, work: Path,
                                                                       held: Held) -> None:
    """The issue's example: allocate on the primary context's stream while a
    throw-away context is current, destroy the throw-away context: the memory
    stays (it is the stream's), and so does the charge."""
    env = capped_env(driver, work)
    held.start(env, "init", "ctx", "0", "stream", "ctxcreate", "0", "asyncs", str(300 * MIB), "ctxdestroy",
               "ctx", "0", "alloc", str(300 * MIB), "fill", str(16 * MIB))
    held.ready()
    assert sim_used(env) <= CAP, sim_used(env) / MIB
    (r,) = held.finish()
    assert rcs(r, "asyncs") == ["0"] and rcs(r, "alloc") == ["2"], r


ASYNC_MEMBERS = {
    # device 1's default pool, from a device-0 context
    "default-pool-of-another-device": ["ctx", "0", "pooldev", "1", str(1024 * MIB)],
    # a pool made on device 1
    "created-pool-on-another-device": ["ctx", "0", "poolnew", "1", "poolalloc", str(1024 * MIB)],
    # cuMemAllocAsync on a stream of a device-1 context while device 0's is current
    "stream-of-another-device": ["ctx", "1", "stream", "ctx", "0", "asyncs", str(1024 * MIB)],
}


@pytest.mark.parametrize("member", sorted(ASYNC_MEMBERS))
def test_async_is_charged_to_the_pools_device(driver: H.Driver, work: Path, held: Held, member: str) -> None:
    env = capped_env(driver, work, CUDA_DEVICE_MEMORY_LIMIT_0="4g", CUDA_DEVICE_MEMORY_LIMIT_1="512m")
    held.start(env, "init", *ASYNC_MEMBERS[member], "fill", str(64 * MIB))
    held.ready()
    assert sim_used(env, 1) <= CAP, f"{member}: {sim_used(env, 1) / MIB} MiB on GPU 1 under 512"
    r = held.finish()[0]
    (cmd,) = {"pooldev", "poolalloc", "asyncs"} & set(ASYNC_MEMBERS[member])
    assert rcs(r, cmd) == ["2"], (member, r)


def test_pool_lifecycle_stays_exact(driver: H.Driver, work: Path) -> None:
    """Frees, trim and destroy of a pool give back exactly what the driver did."""
    env = capped_env(driver, work)
    room = str(CAP - 64 * MIB)
    cp = H.probe(env, "init", "ctx", "0", "poolnew", "0", "poolalloc", room, "poolalloc", "1", "freeasync",
                 "pooltrim", "poolalloc", room, "pooldestroy", "alloc", "1", "freeasync", "alloc", room)
    r = H.parse(cp.stdout)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert rcs(r, "poolalloc") == ["0", "2", "0"] and rcs(r, "alloc") == ["2", "0"], r


POOL_KEEPS = {
    # a pool of its own that keeps everything freed
    "created-pool": ["poolnew", "0", "poolthr", "-1", "poolalloc", str(300 * MIB), "freeasync"],
    # the device's default pool, through cuMemAllocAsync
    "default-pool": ["defpoolthr", "-1", "async", str(300 * MIB), "freeasync"],
    # on another context's stream, then that allocation freed on the NULL stream
    "default-pool-via-stream": ["defpoolthr", "-1", "stream", "asyncs", str(300 * MIB), "freeasync"],
}


@pytest.mark.parametrize("member", sorted(POOL_KEEPS))
def test_memory_a_pool_keeps_stays_charged(driver: H.Driver, work: Path, held: Held, member: str) -> None:
    """A pool with a release threshold keeps freed memory on the GPU (and serves
    its next allocations from it): a free credits only what the pool gave back."""
    env = capped_env(driver, work)
    held.start(env, "init", "ctx", "0", *POOL_KEEPS[member], "alloc", str(300 * MIB), "fill", str(16 * MIB))
    held.ready()
    assert sim_used(env) <= CAP, f"{member}: {sim_used(env) / MIB} MiB under 512"
    (r,) = held.finish()
    assert rcs(r, "alloc") == ["2"], r


def test_pool_reuse_trim_and_destroy_give_back_exactly(driver: H.Driver, work: Path) -> None:
    env = capped_env(driver, work)
    room = str(CAP - 64 * MIB)
    cp = H.probe(env, "init", "ctx", "0", "poolnew", "0", "poolthr", "-1",
                 "poolalloc", room, "freeasync", "poolalloc", room, "freeasync",  # reuse: no second charge
                 "alloc", "1",  # the pool still holds the room
                 "pooltrim", "alloc", room, "free",  # trimmed: back
                 "poolalloc", room, "freeasync", "pooldestroy", "alloc", room)  # destroyed: back
    r = H.parse(cp.stdout)
    assert cp.returncode == 0, cp.stdout + cp.stderr
    assert rcs(r, "poolalloc") == ["0", "0", "0"] and rcs(r, "alloc") == ["2", "0", "0"], r


# ---- more devices than the table -----------------------------------------------------------

def _many_device_driver(root: Path, gpus: int, mig: int, profile: str = "1g.10gb") -> H.Driver:
    topo = make_topology(gpus=gpus, memory_mib=81920, mig={i: [profile] * mig for i in range(gpus)})
    build_driver(topo, str(root), str(root / "lib"), str(root / "bin"))
    minors = [g.minor for g in topo.gpus]
    H.make_devdir(root / "dev", minors)
    return H.Driver(root, [g.uuid for g in topo.gpus], 81920 * MIB)


@pytest.mark.parametrize("gpus, mig, profile, dev", [
    (3, 7, "1g.10gb", 20), (3, 7, "1g.10gb", 16), (9, 2, "3g.40gb", 17)])
def test_every_device_is_capped(tmp_path: Path, work: Path, held: Held, gpus: int, mig: int, profile: str,
                                dev: int) -> None:
    H.build()
    drv = _many_device_driver(tmp_path / "sim", gpus, mig, profile)
    env = capped_env(drv, work)
    cp = H.probe(env, "init", "count")
    assert H.parse(cp.stdout)["count"][0] == ["0", str(gpus * mig)], cp.stdout + cp.stderr
    gpu = dev // mig
    held.start(env, "init", "ctx", str(dev), "alloc", str(600 * MIB), "fill", str(64 * MIB),
               "vmm", str(CHUNK), "vmmmap", "vmmrelease", "pooldev", str(dev), str(CHUNK))
    held.ready()
    assert sim_used(env, gpu) <= CAP, f"device {dev}: {sim_used(env, gpu) / MIB} MiB under 512"
    (r,) = held.finish()
    assert rcs(r, "alloc") == ["2"], r


def test_devices_beyond_the_table_fail_closed(tmp_path: Path, work: Path) -> None:
    """10 GPUs x 7 MIG devices = 70 CUDA devices, 6 more than libvgpu keeps:
    those refuse contexts and allocations, the others work."""
    H.build()
    drv = _many_device_driver(tmp_path / "sim", 10, 7)
    env = capped_env(drv, work)
    r = H.parse(H.probe(env, "init", "count", "ctx", "66", "alloc", str(MIB)).stdout)
    assert r["count"][0] == ["0", "70"] and rcs(r, "ctx") == ["2"], r
    assert sim_used(env, 9) == 0
    r = H.parse(H.probe(env, "init", "ctx", "63", "alloc", str(MIB)).stdout)
    assert rcs(r, "ctx") == ["0"] and rcs(r, "alloc") == ["0"], r


# ---- SM share: no floor outlives its handle ------------------------------------------------

@pytest.mark.exclusive  # an SM share over wall time
@pytest.mark.slow
def test_graph_floor_is_not_inherited_by_a_new_exec(tmp_path: Path) -> None:
    """Learn a 1-node exec's floor, destroy it, instantiate a 50-node exec (the
    simulated driver hands out the same handle): the share of the bigger one is
    still ~25 %, measured on the simulated GPU's busy counter."""
    H.build()
    drv = H.make_driver(tmp_path / "sim", gpus=1, memory_mib=4096)
    env = drv.env(tmp_path / "state", NVSIM_KERNEL_US="1000", CUDA_DEVICE_SM_LIMIT="25",
                  CUDA_DEVICE_MEMORY_SHARED_CACHE=str(tmp_path / "cache"), LD_PRELOAD=str(H.LIB))
    p = subprocess.Popen([str(H.PROBE), "init", "ctx", "0", "graph", "1", "graphlaunchfor", "1.5", "regraph", "50",
                          "graphlaunchfor", "5"], env=env, text=True, stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        graphs = []
        for line in p.stdout:
            if line.startswith(("graph ", "regraph ")):
                graphs.append(line.split())
                if len(graphs) == 2:
                    break
        assert [g[1] for g in graphs] == ["0", "0"], graphs
        assert graphs[0][2] == graphs[1][2], graphs  # the same handle value: the case being tested
        busy = lambda: read_state(tmp_path / "state").gpus[0].busy_ns  # noqa: E731
        time.sleep(1.0)  # a measurement window, not synchronisation
        b0, t0 = busy(), time.monotonic_ns()
        time.sleep(3.0)  # an inherited floor lets the 50-node exec near 100 %, far above 35
        b1, t1 = busy(), time.monotonic_ns()
        share = 100 * (b1 - b0) / (t1 - t0)
    finally:
        p.kill()
        p.wait()
    assert share <= 35, f"{share:.1f} % of the GPU under a 25 % limit"
