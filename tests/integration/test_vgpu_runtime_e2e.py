"""vGPU end-to-end tests (issue C §3), through nvctk-runtime + real runc (slow): the cap
seen by nvidia-smi and cuMemGetInfo, CUDA_ERROR_OUT_OF_MEMORY at the cap, processes of one
container sharing it, env escapes that get nothing, and neighbours on one simulated GPU.
(Installation: test_vgpu_runtime_install.py.)
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import support.vgpu as _vgpu
from nvctk.base import config as nvconfig
from nvctk.edits_file import EDITS_FILE
from nvctk.sim import host
from nvctk.vgpu import limits as vgpu
from nvctk.vgpu import state as vgpu_state
from support import wait
from support.vgpu import (
    GPU_MIB,
    MEM,
    MIB,
    RUNTIME,
    Bundles,
    Runc,
    env_of,
    lines,
    mounts_at,
    mounts_under,
    spec_of,
    stop,
    used_on_gpu1,
    wait_used,
)

base_rootfs, bundles, config, runc, sim = (  # fixtures
    _vgpu.base_rootfs, _vgpu.bundles, _vgpu.config, _vgpu.runc, _vgpu.sim)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sim device nodes, runc)")


WAIT_USED = """
# wait until the container's other processes hold more than $1 bytes
i=0
while :; do
  free=$(cuda-vectoradd --info | sed -n 's/.* free \\([0-9]*\\) total.*/\\1/p')
  [ -n "$free" ] && [ $((536870912 - free)) -gt $1 ] && break
  i=$((i+1)); [ $i -gt 200 ] && { echo "TIMEOUT waiting"; exit 9; }
  sleep 0.05
done
"""


@pytest.mark.slow
def test_capped_container_end_to_end(runc: Runc, bundles: Bundles, config: nvconfig.Config
                                     ) -> None:
    script = f"""
wait_used() {{ {WAIT_USED} }}
echo "preload: $(cat /etc/ld.so.preload | tr '\\n' ' ')"
echo "smi: $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits)"
cuda-vectoradd --info | sed 's/^/info: /'
cuda-vectoradd --alloc-mib 600 | sed 's/^/big: /'
cuda-vectoradd --alloc-mib 400 | sed 's/^/fits: /'
echo x > /run/nvctk/vgpu/limits 2>/dev/null && echo "limits: WRITABLE" || echo "limits: ro"
echo x > /etc/ld.so.preload 2>/dev/null && echo "preload-file: WRITABLE" || echo "preload-file: ro"
ls /run/nvctk/vgpu/cache >/dev/null && echo "cache: present"
# two processes share the cap: one holds 300 MiB (+ its context), the other cannot
# get another 300, but 64 MiB still fit
vgpu_probe init ctx 0 alloc {300 * MIB} sleep 20000 >/dev/null &
holder=$!
wait_used {300 * MIB}
cuda-vectoradd --alloc-mib 300 | sed 's/^/second: /'
cuda-vectoradd --alloc-mib 64 | sed 's/^/small: /'
kill $holder
"""
    b = bundles.make({MEM: "512m"}, script)
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert lines(out, "preload:") == [f"preload: {vgpu_state.CONTAINER_LIBRARY} "]
    assert lines(out, "smi:") == ["smi: 512"]
    info = lines(out, "info: device 0:")
    assert len(info) == 1 and info[0].endswith(f"total {512 * MIB}"), out
    assert lines(out, "big:") == ["big: alloc 600 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"]
    assert lines(out, "fits:") == ["fits: alloc 400 MiB: OK"]
    assert lines(out, "limits:") == ["limits: ro"]
    assert lines(out, "preload-file:") == ["preload-file: ro"]
    assert lines(out, "cache:") == ["cache: present"]
    assert "TIMEOUT" not in out
    assert lines(out, "second:") == ["second: alloc 300 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"]
    assert lines(out, "small:") == ["small: alloc 64 MiB: OK"]
    # poststop removed the accounting dir
    assert not os.path.exists(vgpu_state.state_dir_for(config, str(runc.root), runc.ids[-1]))


@pytest.mark.exclusive  # free space of a shared file system
@pytest.mark.slow
def test_accounting_dir_is_a_bounded_tmpfs(runc: Runc, bundles: Bundles,
                                           config: nvconfig.Config) -> None:
    """A container cannot fill the host's /run through its writable accounting dir."""
    script = """
dd if=/dev/zero of=/run/nvctk/vgpu/fill bs=1M count=64 2>/tmp/dd.err \
  && echo "dd: OK" || echo "dd: FAILED $(grep -o 'No space left on device' /tmp/dd.err)"
echo "fill: $(stat -c %s /run/nvctk/vgpu/fill)"
i=0; while [ $i -lt 100 ] && touch /run/nvctk/vgpu/f$i 2>/dev/null; do i=$((i+1)); done
echo "files: $i"
rm -f /run/nvctk/vgpu/fill /run/nvctk/vgpu/f*
cuda-vectoradd --alloc-mib 600 | sed 's/^/big: /'
cuda-vectoradd --alloc-mib 400 | sed 's/^/fits: /'
"""
    b = bundles.make({MEM: "512m"}, script)
    free_before = os.statvfs(config.state_dir) if os.path.isdir(config.state_dir) else None
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert lines(out, "dd:") == ["dd: FAILED No space left on device"], out
    (filled,) = lines(out, "fill:")
    assert int(filled.split()[1]) <= vgpu_state.TMPFS_SIZE
    (files,) = lines(out, "files:")
    assert int(files.split()[1]) < vgpu_state.TMPFS_INODES
    # still capped after its dir was full
    assert lines(out, "big:") == ["big: alloc 600 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"]
    assert lines(out, "fits:") == ["fits: alloc 400 MiB: OK"]
    if free_before is not None:  # the host's file system under state-dir lost nothing
        after = os.statvfs(config.state_dir)
        # (a decrease: other work on the machine may free space meanwhile)
        assert (free_before.f_bavail - after.f_bavail) * after.f_frsize < 16 * MIB
    # poststop: the tmpfs is gone from the host, and the dir with it
    d = vgpu_state.state_dir_for(config, str(runc.root), runc.ids[-1])
    assert not mounts_at(d) and not os.path.exists(d)
    assert not mounts_under(config.state_dir)


@pytest.mark.slow
def test_state_dir_under_a_shared_mount(runc: Runc, bundles: Bundles, sim: host.SimHost,
                                        config: nvconfig.Config) -> None:
    """/run is shared on systemd hosts: nothing mounted in the container (the limits file
    on the accounting dir) propagates back, and nothing stays mounted afterwards."""
    top = config.state_dir
    os.makedirs(top, 0o700, exist_ok=True)
    subprocess.run(["mount", "--bind", top, top], check=True)
    try:
        subprocess.run(["mount", "--make-shared", top], check=True)
        assert mounts_at(top)[-1].shared
        b = bundles.make({MEM: "512m"}, "echo started; sleep 600")
        cid, p = runc.start(b)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "started"
        try:
            d = vgpu_state.state_dir_for(config, str(runc.root), cid)
            under = mounts_under(top)
            assert [(i.mount_point, i.fstype) for i in under] == [(d, "tmpfs")], under
            assert not under[0].shared
        finally:
            stop(runc, cid, p)
        assert not mounts_under(top) and not os.path.exists(d)
    finally:
        subprocess.run(["umount", "-l", top], check=True)


@pytest.mark.slow
def test_escapes_get_no_more_memory(runc: Runc, bundles: Bundles) -> None:
    script = """
try() { out=$("$@" cuda-vectoradd --alloc-mib 600); echo "$1 ${2%%=*}: $out"; }
try env -u CUDA_DEVICE_MEMORY_LIMIT
try env CUDA_DEVICE_MEMORY_LIMIT=0
try env CUDA_DEVICE_MEMORY_LIMIT=4g
try env CUDA_DEVICE_MEMORY_LIMIT_0=4g
try env CUDA_DEVICE_MEMORY_SHARED_CACHE=/tmp/elsewhere
try env -u CUDA_DEVICE_MEMORY_SHARED_CACHE
try env LD_PRELOAD=
try env NVCTK_VGPU_LIMITS_FILE=/tmp/nolimits
: > /tmp/nolimits
rm -f /etc/ld.so.preload 2>/dev/null && echo "rm preload: DONE" || echo "rm preload: refused"
umount /etc/ld.so.preload 2>/dev/null && echo "umount: DONE" || echo "umount: refused"
try env
"""
    b = bundles.make({MEM: "512m"}, script)
    r = runc.run(b)
    assert r.returncode == 0, r.stdout + r.stderr
    tries = [x for x in r.stdout.splitlines() if x.startswith("env ")]
    assert len(tries) == 9, r.stdout
    for line in tries:
        assert line.endswith("alloc 600 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"), r.stdout
    assert "rm preload: refused" in r.stdout and "umount: refused" in r.stdout


@pytest.mark.slow
def test_uncapped_container_has_no_interposer(runc: Runc, bundles: Bundles) -> None:
    script = """
[ -e /etc/ld.so.preload ] && echo "preload: PRESENT" || echo "preload: none"
[ -e /run/nvctk ] && echo "run-nvctk: PRESENT" || echo "run-nvctk: none"
echo "smi: $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits)"
cuda-vectoradd --info | sed 's/^/info: /'
cuda-vectoradd --alloc-mib 3000 | sed 's/^/big: /'
"""
    b = bundles.make({}, script)
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert lines(out, "preload:") == ["preload: none"]
    assert lines(out, "run-nvctk:") == ["run-nvctk: none"]
    assert lines(out, "smi:") == [f"smi: {GPU_MIB}"]
    assert lines(out, "info: device 0:")[0].endswith(f"total {GPU_MIB * MIB}"), out
    assert lines(out, "big:") == ["big: alloc 3000 MiB: OK"]
    assert vgpu.CACHE_VAR not in env_of(spec_of(b))
    assert not (b / "rootfs/etc/ld.so.preload").exists()


def _hold(runc: Runc, bundles: Bundles, sim: host.SimHost, env: dict[str, str], mib: int
          ) -> tuple[str, subprocess.Popen[str]]:
    """A container on GPU 1 holding 2 x `mib` MiB (or what it can get) until killed."""
    b = bundles.make(env, f"vgpu_probe init ctx 0 alloc {mib * MIB} alloc {mib * MIB} "
                     "sleep 60000", gpu="1")
    return runc.start(b)


@pytest.mark.slow
def test_neighbours_on_one_gpu(runc: Runc, bundles: Bundles, sim: host.SimHost) -> None:
    victim = bundles.make({}, "cuda-vectoradd --alloc-mib 1500", gpu="1")
    base = used_on_gpu1(sim)

    # without caps the greedy one starves its neighbour
    cid, p = _hold(runc, bundles, sim, {}, GPU_MIB // 2 - 256)
    try:
        wait_used(sim, base + (GPU_MIB - 512) * MIB, p)
        r = runc.run(victim)
        assert r.returncode == 2 and "FAILED CUDA_ERROR_OUT_OF_MEMORY" in r.stdout, r.stdout
    finally:
        stop(runc, cid, p)

    # capped at 1 GiB it cannot take more than its cap, and the neighbour gets its memory
    cid, p = _hold(runc, bundles, sim, {MEM: "1g"}, 600)  # the second 600 MiB is refused
    try:
        assert p.stdout is not None
        # the probe answers each alloc: the first granted, the second refused at the cap
        out = wait.line(p.stdout, "alloc ", 60) + wait.line(p.stdout, "alloc ", 60)
        assert [x for x in out if x.startswith("alloc ")] == ["alloc 0", "alloc 2"], out
        assert base + 600 * MIB <= used_on_gpu1(sim) <= base + 1024 * MIB
        r = runc.run(victim)
        assert r.returncode == 0 and "alloc 1500 MiB: OK" in r.stdout, r.stdout
    finally:
        stop(runc, cid, p)
    capped = bundles.make({MEM: "1g"}, "cuda-vectoradd --alloc-mib 900; "
                          "cuda-vectoradd --alloc-mib 1100", gpu="1")
    r = runc.run(capped)
    assert r.stdout.splitlines() == ["alloc 900 MiB: OK",
                                     "alloc 1100 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"]


def test_state_dir_removed_when_the_runtime_cannot_start(bundles: Bundles, sim: host.SimHost,
                                                         config: nvconfig.Config,
                                                         tmp_path: Path) -> None:
    broken = tmp_path / "broken-runc"
    broken.write_text("#!/nonexistent/interpreter\n")
    broken.chmod(0o755)
    cfg = tmp_path / "config.toml"
    text = Path(sim.config_path).read_text()
    cfg.write_text(text.replace('runtimes = ["runc", "crun"]', f'runtimes = ["{broken}"]'))
    b = bundles.make({MEM: "1g"})
    root = str(tmp_path / "runc-root")
    r = subprocess.run([RUNTIME, "--root", root, "create", "--bundle", str(b), "gone"],
                       env={**os.environ, "NVCTK_CONFIG": str(cfg)}, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "cannot exec" in r.stderr, r.stderr
    assert (b / EDITS_FILE).exists()  # the create got as far as the exec
    d = vgpu_state.state_dir_for(config, root, "gone")
    assert not os.path.exists(d) and not mounts_at(d)
