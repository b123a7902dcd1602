"""The DRA kubelet plugin over gRPC: shared GPUs: an MPS claim, a share's plain CDI spec with
one vGPU ledger for the claim, 200 prepare/unprepare cycles leaking nothing. (The rest:
test_dra_grpc_prepare.py, test_dra_grpc_hostile.py, test_dra_grpc_health.py; shared:
tests/support/dranode.py.)"""

from __future__ import annotations

import os
import subprocess

import pytest

import support.dranode as _dranode
from nvctk.dra.claims import MemoryClaims
from nvctk.sim import host
from nvctk.sim.host import SimHost
from nvctk.sim.topology import make_topology
from support.dranode import Start, _mps, _resolve, claim, result
from support.procs import open_fds

pytestmark = pytest.mark.slow

start = _dranode.start  # fixtures


def test_an_mps_claim_is_an_mps_client_as_the_device_plugins(
        start: Start, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Sharing strategy MPS: the claim's spec gives its GPU and, as the device plugin's
    MPS shares, the host's MPS pipe directory with CUDA_MPS_PIPE_DIRECTORY, the share's
    smShare as the active thread percentage and its memory as the pinned memory limit (no
    vGPU ledger); without the MPS control daemon's pipe directory the claim is refused
    saying so, and nothing is written; MPS for some devices of a claim only, or uneven
    thread percentages, are refused."""
    if os.geteuid() != 0:
        pytest.skip("needs root (the simulated host has device nodes)")
    sim = host.init(str(tmp_path_factory.mktemp("drasim") / "h"), make_topology(gpus=2))
    g0, g1 = sim.topology.gpus
    share = {"shareID": "s1", "consumedCapacity": {"memory": "2Gi", "smShare": "30"}}
    src = MemoryClaims({
        ("ns", "m"): claim("m", "uid-m", [result("gpu-1", **share)], config=[_mps()]),
        ("ns", "w"): claim("w", "uid-w", [result("gpu-0")], config=[_mps()]),
        ("ns", "half"): claim("half", "uid-half", [result("gpu-0"), result("gpu-1", "b")],
                              config=[_mps("gpu")]),
        ("ns", "uneven"): claim("uneven", "uid-uneven", [
            result("gpu-0", **share), result("gpu-1", "b")], config=[_mps()]),
    })
    n = start(sim, src)
    # no MPS control daemon: refused, nothing written
    err = n.kubelet.prepare([("ns", "m", "uid-m")])["uid-m"].error
    assert "sharing strategy MPS: MPS pipe directory" in err and "nvidia-cuda-mps-control" in err
    assert n.specs() == [] and n.driver.prepared_uids() == []
    pipe = os.path.join(sim.root, "tmp/nvidia-mps")
    os.makedirs(pipe)
    got = n.kubelet.prepare([("ns", "m", "uid-m"), ("ns", "w", "uid-w"), ("ns", "half", "uid-half"),
                             ("ns", "uneven", "uid-uneven")])
    assert got["uid-m"].error == "" and got["uid-w"].error == ""
    assert "MPS for device(s) gpu-0 only" in got["uid-half"].error
    assert "uneven smShare" in got["uid-uneven"].error
    (r,) = _resolve(n, list(got["uid-m"].devices[0].cdi_device_ids))
    edits = r.spec["containerEdits"]
    assert next(d["path"] for d in r.device["containerEdits"]["deviceNodes"]) == "/dev/nvidia1"
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void", "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps",
                            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30",
                            f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT={g1.uuid}=2048M"]
    assert {"hostPath": pipe, "containerPath": "/tmp/nvidia-mps"}.items() <= edits["mounts"][-1].items()
    assert not os.path.exists(n.driver.ledger_path("uid-m")), "MPS limits it, not libvgpu"
    # a whole GPU as an MPS client: the pipe, no limits
    (w,) = _resolve(n, list(got["uid-w"].devices[0].cdi_device_ids))
    assert w.spec["containerEdits"]["env"] == ["NVIDIA_VISIBLE_DEVICES=void",
                                               "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
    assert sorted(n.driver.prepared_uids()) == ["uid-m", "uid-w"]
    assert n.kubelet.unprepare([("ns", "m", "uid-m"), ("ns", "w", "uid-w")]) == {
        "uid-m": "", "uid-w": ""}
    assert n.specs() == []
    del g0


@pytest.mark.root
def test_a_shares_spec_is_plain_cdi_with_one_ledger_for_the_claim(start: Start,
                                                                   sim_host: SimHost) -> None:
    """A 2 GiB, 25 % share of GPU 0: the claim's ledger (a tmpfs of its own, laid out as a
    container's state dir) holds its caps; the spec gives everything a container needs
    under any CDI runtime: the GPU's device node, the driver's files, libvgpu, the
    ledger's limits (read-only) and cache, /etc/ld.so.preload read-only, and the hook
    that pins /etc and /run; nothing in env but NVIDIA_VISIBLE_DEVICES=void (no grant a
    Pod could copy). Unprepare removes spec and ledger."""
    from nvctk.base import mounts as mount
    from nvctk.vgpu import ledger as ledger_layout
    from nvctk.vgpu import limits as vgpu

    src = MemoryClaims({("ns", "s"): claim("s", "uid-s", [result(
        "gpu-0", shareID="7c1e", consumedCapacity={"memory": "2Gi", "smShare": "25"})])})
    n = start(sim_host, src)
    ans = n.kubelet.prepare([("ns", "s", "uid-s")])["uid-s"]
    assert ans.error == ""
    (d,) = ans.devices
    assert (d.device_name, d.share_id) == ("gpu-0", "7c1e")
    (r,) = _resolve(n, list(d.cdi_device_ids))
    edits = r.device["containerEdits"]
    common = r.spec["containerEdits"]
    assert edits["deviceNodes"][0]["path"] == "/dev/nvidia0"  # then its DRM nodes
    assert "/dev/nvidia1" not in {x["path"] for x in edits["deviceNodes"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm"} <= {x["path"] for x in common["deviceNodes"]}
    env = dict(e.split("=", 1) for e in common["env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == "void"
    assert not any(k.startswith("NVCTK_") for k in env)
    ledger = os.path.join(n.state_dir, "dra", "uid-s")
    binds = {m["containerPath"]: (m["hostPath"], "ro" in m["options"]) for m in common["mounts"]}
    assert binds["/run/nvctk"] == (f"{ledger}/ro", True)
    assert binds["/run/nvctk/vgpu/limits"] == (f"{ledger}/ro/limits", True)
    assert binds["/run/nvctk/vgpu/cache"] == (f"{ledger}/rw/cache", False)
    assert binds["/etc/ld.so.preload"] == (f"{ledger}/ro/ld.so.preload", True)
    assert binds["/run/nvctk/libvgpu.so"][1] is True
    assert any(p.endswith("/libcuda.so.1") or "libcuda.so." in p for p in binds)
    (hook,) = edits["hooks"]
    assert hook["hookName"] == "createRuntime" and hook["args"][1:6] == [
        "cdi-edits", "--pin", "etc", "--pin", "run"]
    assert any(m.mount_point == ledger and m.fstype == "tmpfs"
               for m in mount.read_mountinfo())
    got = vgpu.read_limits_file(os.path.join(ledger, "ro", "limits"), 1)
    assert (got.memory, got.sm) == ((2 << 30,), (25,))
    assert os.path.getsize(os.path.join(ledger, "rw", "cache")) == ledger_layout.SHM_SIZE
    with open(os.path.join(ledger, "ro", "ld.so.preload")) as f:
        assert f.read() == "/run/nvctk/libvgpu.so\n"
    assert n.kubelet.unprepare([("ns", "s", "uid-s")]) == {"uid-s": ""}
    assert not os.path.exists(ledger) and n.specs() == []
    assert not any(m.mount_point == ledger for m in mount.read_mountinfo())


@pytest.mark.root
def test_200_prepare_unprepare_cycles_leak_nothing(start: Start, sim_host: SimHost) -> None:
    """A whole-GPU claim and a share (its ledger a tmpfs) prepared and unprepared 200
    times over the sockets: no file, mount, fd, thread or child process is left."""
    from nvctk.base import mounts as mount

    src = MemoryClaims({
        ("ns", "w"): claim("w", "uid-w", [result("gpu-1")]),
        ("ns", "s"): claim("s", "uid-s", [result("gpu-0", shareID="a", consumedCapacity={
            "memory": "2Gi"})])})
    n = start(sim_host, src)
    refs = [("ns", "w", "uid-w"), ("ns", "s", "uid-s")]
    # one round first: gRPC's and the key's one-time state is not a leak
    n.kubelet.prepare(refs)
    n.kubelet.unprepare(refs)
    top = os.path.dirname(n.cdi_dir)

    def mounts() -> list[str]:
        return [m.mount_point for m in mount.read_mountinfo() if m.mount_point.startswith(top)]

    fds, threads = open_fds(), len(os.listdir("/proc/self/task"))
    children = subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True,
                              text=True).stdout.split()
    for _ in range(200):
        got = n.kubelet.prepare(refs)
        assert [a.error for a in got.values()] == ["", ""]
        assert len(mounts()) == 1  # the share's ledger while prepared
        assert n.kubelet.unprepare(refs) == {"uid-w": "", "uid-s": ""}
    assert n.specs() == [] and n.driver.prepared_uids() == []
    assert os.listdir(os.path.join(n.state_dir, "dra")) == []
    assert mounts() == []
    assert open_fds() - fds == set()  # nothing opened in the cycles is still open
    # gRPC's worker pools start threads as calls come, up to their bound (8 a server)
    assert len(os.listdir("/proc/self/task")) <= threads + 2 * 8
    assert subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True,
                          text=True).stdout.split() == children
