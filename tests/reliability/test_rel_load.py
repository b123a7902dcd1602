"""Issue 13 §3: many GPU containers created at once through nvctk-runtime + runc on a
simulated 8-GPU host, repeated: all start, each sees exactly the /dev/nvidia* nodes it
asked for, its bundle's config.json parses, and after deletion no mount, vGPU state or
runc process is left. Throughput (containers/s) against plain runc in the same run,
same concurrency, same rootfs copies.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from support import reliability as relkit
from support import wait

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc, device nodes)")]

GPUS = 8
SCRIPT = "ls /dev | grep '^nvidia[0-9]' | sort -V | tr '\\n' ' '"


def _wanted(i: int) -> tuple[str, list[str]]:
    """Container i's NVIDIA_VISIBLE_DEVICES and the nodes it must see: one GPU, two, or
    all eight, in turn."""
    if i % 5 == 4:
        return "all", [f"nvidia{g}" for g in range(GPUS)]
    if i % 5 == 3:
        a, b = i % GPUS, (i + 3) % GPUS
        return f"{a},{b}", sorted([f"nvidia{a}", f"nvidia{b}"], key=lambda x: int(x[6:]))
    return str(i % GPUS), [f"nvidia{i % GPUS}"]


def _wave(la: relkit.Lab, bundles: list[Path], workers: int, plain: bool
          ) -> tuple[float, list[subprocess.CompletedProcess[str]]]:
    def one(b: Path) -> subprocess.CompletedProcess[str]:
        cid = la.new_id("plain" if plain else "gpu")
        if not plain:
            return la.run(b, cid, timeout=300)
        return subprocess.run(["runc", "--root", la.root, "run", "--bundle", str(b), cid],
                              capture_output=True, text=True, timeout=300,
                              stdin=subprocess.DEVNULL)

    t0 = time.monotonic()
    with ThreadPoolExecutor(workers) as ex:
        results = list(ex.map(one, bundles))
    return time.monotonic() - t0, results


def test_concurrent_gpu_containers(make_sim: Any, rootfs: Any, tmp_path: Path) -> None:
    count, repeats = relkit.n(10, 50), relkit.n(1, 3)
    sim = make_sim(gpus=GPUS, memory_mib=8192)
    base = str(rootfs())
    host_mounts = relkit.mounts_from(tmp_path, sim.root)
    gpu_s = plain_s = 0.0
    started = 0
    with relkit.lab(tmp_path, sim.config_path, **{"log-level": 'log-level = "info"'}) as la:
        for _ in range(repeats):
            gpu_b, plain_b = [], []
            for i in range(count):
                nvd, _ = _wanted(i)
                env = [f"NVIDIA_VISIBLE_DEVICES={nvd}"]
                if i % 7 == 6:  # some with a vGPU cap: their state must go too
                    env.append("CUDA_DEVICE_MEMORY_LIMIT=1g")
                gpu_b.append(la.bundle(None, env, ["/bin/sh", "-c", SCRIPT], base=base))
                plain_b.append(la.bundle(None, [], ["/bin/sh", "-c", SCRIPT], base=base))
            took, results = _wave(la, gpu_b, count, plain=False)
            gpu_s += took
            for i, (b, r) in enumerate(zip(gpu_b, results, strict=True)):
                assert r.returncode == 0, (i, r.stderr[-2000:])
                assert r.stdout.split() == _wanted(i)[1], (i, r.stdout)
                json.loads((b / "config.json").read_bytes())  # whole, never half-written
                started += 1
            took, results = _wave(la, plain_b, count, plain=True)
            plain_s += took
            assert all(r.returncode == 0 for r in results), [r.stderr for r in results][:3]
            assert all(r.stdout.split() == [] for r in results)
            for cid in la.listed():
                la.delete(cid)
            wait.until(lambda: not relkit.procs_mentioning(la.root), 30, "runc to end")
            assert la.state_entries() == []
            assert relkit.mounts_under(la.state_dir) == []
            assert relkit.mounts_under(str(tmp_path)) == []
            assert relkit.mounts_from(tmp_path, sim.root) == host_mounts
    total = count * repeats
    relkit.record("load", f"{count} GPU containers at once, nvctk-runtime + runc, "
                  f"{GPUS}-GPU sim", containers=total, started=started, wrong_devices=0,
                  leaks=0, concurrency=count, repeats=repeats,
                  gpu_per_s=round(total / gpu_s, 2), plain_runc_per_s=round(total / plain_s, 2),
                  ratio=round(plain_s / gpu_s, 3))
