"""vGPU escapes through the file system.

A capped container's root, with runc's default capabilities (no CAP_SYS_ADMIN,
no CAP_DAC_OVERRIDE), tries to take nvctk's files away from the paths ld.so and
libvgpu read: writes onto the read-only binds, renames of the directories that
hold them (/etc, /run, /run/nvctk), unlinking or renaming the mount points in the
accounting dir. Every attempt fails, and a process started afterwards without
the limit in its env still gets no more than the cap. The layout:
/work/brief/vgpu_layout.md; the host side nvctk.vgpu.state, the container side
nvctk.plan.vgpu.vgpu_mounts, nvctk.hook.worker and nvctk.hook.mount.Root.pin.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

import support.vgpu as tv
from nvctk.base import config as nvconfig
from nvctk.host import ldcache
from nvctk.sim import host
from nvctk.sim.state import state_path
from nvctk.vgpu import state as vgpu_state
from support.fs import snapshot
from support.vgpu import MEM, MIB, Bundles, Runc, lines

# support.vgpu's fixtures: a simulated host, capped bundles, nvctk-runtime + runc
sim, config, base_rootfs, bundles, runc = tv.sim, tv.config, tv.base_rootfs, tv.bundles, tv.runc

pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sim, runc)"),
              pytest.mark.slow]

OOM = "alloc 600 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"

# each must fail: (name, shell command run by the container's root)
ATTACKS = [
    ("write ro/ld.so.preload", ": > /run/nvctk/ld.so.preload"),
    ("write ro/limits", ": > /run/nvctk/limits"),
    ("write the library", ": > /run/nvctk/libvgpu.so"),
    ("write limits in rw/", ": > /run/nvctk/vgpu/limits"),
    ("write /etc/ld.so.preload", ": > /etc/ld.so.preload"),
    ("append /etc/ld.so.preload", "echo /x.so >> /etc/ld.so.preload"),
    ("rm /etc/ld.so.preload", "rm -f /etc/ld.so.preload"),
    ("mv /etc", "mv /etc /etc2 && mkdir /etc"),
    ("mv /run", "mv /run /run2"),
    ("mv /run/nvctk", "mv /run/nvctk /x"),
    ("rm -r /run/nvctk", "rm -rf /run/nvctk && [ ! -e /run/nvctk ]"),
    ("mv /run/nvctk/vgpu", "mv /run/nvctk/vgpu /x"),
    ("rm limits", "rm /run/nvctk/vgpu/limits"),
    ("mv limits", "mv /run/nvctk/vgpu/limits /x"),
    ("mv cache", "mv /run/nvctk/vgpu/cache /x"),
    ("rm cache", "rm /run/nvctk/vgpu/cache"),
    ("link over the library", "ln -sf /tmp/x /run/nvctk/libvgpu.so"),
    ("new preload beside", ": > /run/nvctk/ld.so.preload2"),
    ("umount", "umount -l /run/nvctk"),
]


def _script(attacks: list[tuple[str, str]]) -> str:
    out = ["try() { if sh -c \"$2\" 2>/dev/null; then echo \"attack $1: DONE\"; "
           "else echo \"attack $1: refused\"; fi; }"]
    out += [f"try {json.dumps(name)} {json.dumps(cmd)}" for name, cmd in attacks]
    out += [
        # a file nobody reads: rw/ is writable for the accounting, harmlessly
        "( : > /run/nvctk/vgpu/ld.so.preload ) 2>/dev/null",
        "echo \"preload: $(cat /etc/ld.so.preload | tr '\\n' ' ')\"",
        "echo \"limit-env: $(env -u CUDA_DEVICE_MEMORY_LIMIT cuda-vectoradd --alloc-mib 600)\"",
        "echo \"no-env: $(env -i PATH=$PATH cuda-vectoradd --alloc-mib 600)\"",
        "echo \"fits: $(env -u CUDA_DEVICE_MEMORY_LIMIT cuda-vectoradd --alloc-mib 400)\"",
    ]
    return "\n".join(out) + "\n"


def test_file_system_attacks_get_no_more_memory(runc: Runc, bundles: Bundles) -> None:
    b = bundles.make({MEM: "512m"}, _script(ATTACKS))
    spec = json.loads((b / "config.json").read_text())
    assert "CAP_SYS_ADMIN" not in spec["process"]["capabilities"]["bounding"]
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    got = lines(out, "attack ")
    assert got == [f"attack {name}: refused" for name, _ in ATTACKS], out
    assert lines(out, "preload:") == [f"preload: {vgpu_state.CONTAINER_LIBRARY} "], out
    assert lines(out, "limit-env:") == [f"limit-env: {OOM}"], out
    assert lines(out, "no-env:") == [f"no-env: {OOM}"], out
    assert lines(out, "fits:") == ["fits: alloc 400 MiB: OK"], out


def test_as_uid_1000_too(runc: Runc, bundles: Bundles) -> None:
    b = bundles.make({MEM: "512m"}, _script(ATTACKS))
    spec = json.loads((b / "config.json").read_text())
    spec["process"]["user"] = {"uid": 1000, "gid": 1000}
    (b / "config.json").write_text(json.dumps(spec))
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert lines(out, "attack ") == [f"attack {name}: refused" for name, _ in ATTACKS], out
    assert lines(out, "limit-env:") == [f"limit-env: {OOM}"], out


@pytest.mark.parametrize("where", ["etc", "run"])
def test_a_symlinked_etc_or_run_refuses_the_start(where: str, runc: Runc, bundles: Bundles,
                                                  config: nvconfig.Config) -> None:
    """The pin of /etc or /run would land where the image's link points, and the
    container could swap the link: the start is refused, naming it."""
    b = bundles.make({MEM: "512m"}, "echo started")
    root = b / "rootfs"
    shutil.move(root / where, root / f"real-{where}")
    (root / where).symlink_to(f"real-{where}")
    r = runc.run(b)
    assert r.returncode != 0 and "started" not in r.stdout, r.stdout
    assert f"step mount: /{where}: a symbolic link in the image" in r.stderr, r.stderr
    d = vgpu_state.state_dir_for(config, str(runc.root), runc.ids[-1])
    assert not os.path.exists(d)  # poststop (or the failed create) removed the state


def test_image_symlink_at_a_vgpu_path_is_replaced(runc: Runc, bundles: Bundles) -> None:
    """/etc/ld.so.preload and /run/nvctk as links in the image: the mounts sit at the
    literal paths (a link the container could repoint never leads to them)."""
    script = ("rm -f /etc/ld.so.preload; rm -f /run/nvctk; "
              "echo \"preload: $(cat /etc/ld.so.preload | tr '\\n' ' ')\"; "
              "echo \"decoy: $(cat /decoy/ld.so.preload 2>/dev/null) $(ls /decoy-run)\"; "
              "echo \"limit-env: $(env -u CUDA_DEVICE_MEMORY_LIMIT cuda-vectoradd "
              "--alloc-mib 600)\"")
    b = bundles.make({MEM: "512m"}, script)
    root = b / "rootfs"
    (root / "decoy").mkdir()
    (root / "decoy-run").mkdir()
    (root / "decoy/ld.so.preload").write_text("")
    (root / "etc/ld.so.preload").symlink_to("/decoy/ld.so.preload")
    (root / "run/nvctk").symlink_to("/decoy-run")
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert lines(out, "preload:") == [f"preload: {vgpu_state.CONTAINER_LIBRARY} "], out
    assert lines(out, "decoy:") == ["decoy:  "], out
    assert lines(out, "limit-env:") == [f"limit-env: {OOM}"], out


def test_read_only_root_keeps_etc_and_run_read_only(runc: Runc, bundles: Bundles) -> None:
    """runc remounts only / read-only: the hook's pins of /etc and /run must be so too,
    and ldconfig (run while the rootfs is still writable) still refreshes the cache."""
    script = """
for p in /etc/x /run/x /x; do ( : > $p ) 2>/dev/null && echo "write $p: DONE" || echo "write $p: refused"; done
echo "limit-env: $(env -u CUDA_DEVICE_MEMORY_LIMIT cuda-vectoradd --alloc-mib 600)"
"""
    b = bundles.make({MEM: "512m"}, script)
    spec = json.loads((b / "config.json").read_text())
    spec["root"]["readonly"] = True
    (b / "config.json").write_text(json.dumps(spec))
    os.unlink(b / "rootfs/etc/ld.so.cache")
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert lines(out, "write ") == [f"write {p}: refused" for p in ("/etc/x", "/run/x", "/x")]
    assert lines(out, "limit-env:") == [f"limit-env: {OOM}"], out
    names = {e.name for e in ldcache.read(str(b / "rootfs"))}
    assert "libcuda.so.1" in names


def test_mps_dir_at_etc_gets_nothing(runc: Runc, bundles: Bundles, sim: host.SimHost) -> None:
    """CUDA_MPS_PIPE_DIRECTORY=/etc: the host's MPS dir is bound over the image's /etc.
    The hook must not write ld.so.preload (or ldconfig its cache) into it: a capped
    container refuses to start, naming the path; the host dir is untouched."""
    mps = Path(sim.root, "tmp/nvidia-mps")
    mps.mkdir(parents=True, exist_ok=True)
    (mps / "control").write_text("host MPS file\n")
    before = snapshot(mps)
    try:
        b = bundles.make({MEM: "512m", "CUDA_MPS_PIPE_DIRECTORY": "/etc"}, "echo started")
        r = runc.run(b)
        assert r.returncode != 0 and "started" not in r.stdout, r.stdout
        assert "step mount: /etc/ld.so.preload: not created" in r.stderr, r.stderr
        assert "not the container's own rootfs" in r.stderr
        assert snapshot(mps) == before
        # without a cap it runs; ldconfig cannot write its cache into the host's dir
        b = bundles.make({"CUDA_MPS_PIPE_DIRECTORY": "/etc"}, "echo started")
        r = runc.run(b)
        assert r.returncode == 0 and "started" in r.stdout, r.stdout + r.stderr
        assert snapshot(mps) == before
    finally:
        shutil.rmtree(mps)


def test_truncated_cache_fails_closed(runc: Runc, bundles: Bundles) -> None:
    """The cache is a mount point (cannot be unlinked) but stays writable: truncating it
    must end in a CUDA error or the cap, never a crash or more memory."""
    script = """
: > /run/nvctk/vgpu/cache
env -u CUDA_DEVICE_MEMORY_LIMIT cuda-vectoradd --alloc-mib 600; echo "rc: $?"
"""
    b = bundles.make({MEM: "512m"}, script)
    r = runc.run(b)
    assert "alloc 600 MiB: OK" not in r.stdout, r.stdout
    assert lines(r.stdout, "rc:") in (["rc: 1"], ["rc: 2"]), r.stdout + r.stderr


def test_probe_still_sees_the_layout(runc: Runc, bundles: Bundles) -> None:
    """The container's view: /run/nvctk read-only, the accounting dir writable with its
    two mount points, nothing of the host's state (owner metadata) visible."""
    script = """
ls -a /run/nvctk | tr '\\n' ' ' | sed 's/^/ro: /'; echo
ls -a /run/nvctk/vgpu | tr '\\n' ' ' | sed 's/^/rw: /'; echo
grep ' /run/nvctk' /proc/mounts | awk '{print "mnt:", $2, substr($4, 1, 2)}'
"""
    b = bundles.make({MEM: "512m"}, script)
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert lines(out, "ro:") == ["ro: . .. ld.so.preload libvgpu.so limits vgpu "], out
    assert lines(out, "rw:") == ["rw: . .. cache limits "], out
    assert lines(out, "mnt:") == ["mnt: /run/nvctk ro", "mnt: /run/nvctk/libvgpu.so ro",
                                  "mnt: /run/nvctk/vgpu rw", "mnt: /run/nvctk/vgpu/limits ro",
                                  "mnt: /run/nvctk/vgpu/cache rw"], out


def test_runc_spec_mounts_survive_the_pins(runc: Runc, bundles: Bundles, tmp_path: Path
                                           ) -> None:
    """A file bound into /etc by the runtime (Docker's /etc/hosts) before the hook's
    recursive self-bind of /etc is still there afterwards."""
    hosts = tmp_path / "hosts"
    hosts.write_text("10.1.2.3 bound-by-runtime\n")
    b = bundles.make({MEM: "512m"}, "cat /etc/hosts")
    spec = json.loads((b / "config.json").read_text())
    (b / "rootfs/etc/hosts").write_text("image's own\n")
    spec["mounts"].append({"destination": "/etc/hosts", "type": "bind",
                           "source": str(hosts), "options": ["rbind", "ro"]})
    (b / "config.json").write_text(json.dumps(spec))
    r = runc.run(b)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout == "10.1.2.3 bound-by-runtime\n"


def test_context_reserve_0_in_the_env_gets_no_more_memory(runc: Runc, bundles: Bundles,
                                                          sim: host.SimHost) -> None:
    """Issue 8 (hostile retest): NVCTK_VGPU_CONTEXT_RESERVE=0 in a process's env
    left each context's real memory uncharged, so 8 processes held 8 x 128 MiB
    under a 512 MiB cap. The limits file now always states the reserve and
    libvgpu takes it as a floor: the GPU's own count stays within the cap."""
    script = ("for i in 1 2 3 4 5 6 7 8; do env NVCTK_VGPU_CONTEXT_RESERVE=0 vgpu_probe init ctx 0 "
              "alloc 67108864 sleep 4000 > /tmp/o$i 2>&1 & done; wait; cat /tmp/o*")
    def used() -> int:  # the simulated GPU's own count (no state file before its first use)
        return tv.used_on_gpu1(sim) if os.path.exists(state_path(sim.root)) else 0

    base = used()
    b = bundles.make({MEM: "512m"}, script, gpu="1")
    cid, p = runc.start(b)
    peak = 0
    try:
        while p.poll() is None:
            peak = max(peak, used() - base)
            time.sleep(0.02)
        out = p.communicate(timeout=30)[0]
    finally:
        runc.kill(cid)
    assert p.returncode == 0, out
    # vgpu_probe prints each step's CUresult. Each context is charged its 64 MiB reserve,
    # whatever the env says: contexts and allocations together fit 8 x 64 MiB, so some
    # step is refused. Which one depends on the 8 processes' timing (on a loaded machine
    # all 8 contexts can come first and take the whole cap, every allocation refused);
    # uncharged contexts let all 16 steps through.
    ok = out.count("ctx 0\n") + out.count("alloc 0\n")
    assert ok <= 8 and out.count("alloc 0\n") <= 4 and ("ctx 2\n" in out or "alloc 2\n" in out), out
    assert 0 < peak <= 512 * MIB, f"{peak / MIB} MiB held under a 512 MiB cap\n{out}"
