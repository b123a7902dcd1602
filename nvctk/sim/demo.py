"""`python -m nvctk.sim.demo` (`make demo`): build a 2-GPU simulated host in a temp
dir, show `nvctk info` for it, then run GPU containers on it through
`nvctk-runtime` and real runc, as a user would, and clean everything up.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from nvctk.runtime import passthrough
from nvctk.sim import host
from nvctk.sim.rootfs import build_rootfs
from nvctk.sim.topology import make_topology


def _nvctk() -> list[str]:
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    exe = shutil.which("nvctk", path=path)
    return [exe] if exe else [sys.executable, "-m", "nvctk.cli.main"]


def step(title: str) -> None:
    print(f"\n=== {title}", flush=True)


def run(argv: list[str], env: dict[str, str] | None = None) -> int:
    print("$ " + " ".join(argv), flush=True)
    return subprocess.run(argv, env={**os.environ, **(env or {})}).returncode


def show_info(sim: host.SimHost) -> int:
    step("nvctk info on the simulated host")
    return run([*_nvctk(), "info"], env=sim.env)


def show_nvidia_smi(sim: host.SimHost) -> int:
    step("the simulated driver's nvidia-smi (host side: its libnvidia-ml via LD_LIBRARY_PATH)")
    return run([os.path.join(sim.bin_dir, "nvidia-smi"), "-L"], env={"LD_LIBRARY_PATH": sim.lib_dir})


def _runtime() -> str:
    return os.path.join(os.path.dirname(sys.executable), "nvctk-runtime")


def make_bundle(path: str, rootfs: str, env: list[str], args: list[str], runc: str = "runc") -> str:
    """A bundle at path from `runc spec`: the rootfs, no terminal, the process's args and
    env (PATH first). bench/gpu/real_driver.py uses it too."""
    os.makedirs(path)
    subprocess.run([runc, "spec", "--bundle", path], check=True)
    with open(os.path.join(path, "config.json")) as f:
        spec = json.load(f)
    spec["root"] = {"path": rootfs, "readonly": False}
    spec["process"]["terminal"] = False
    spec["process"]["args"] = args
    spec["process"]["env"] = ["PATH=/usr/local/bin:/usr/bin:/bin", *env]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(spec, f, indent=1)
    return path


def run_gpu_containers(sim: host.SimHost, tmp: str) -> int:
    rootfs = build_rootfs(os.path.join(tmp, "rootfs"), with_sample=sim.sample)
    root = os.path.join(tmp, "runc-root")
    gpu1 = sim.topology.gpus[1]
    cases = [
        (f"a container asking for GPU 1 by UUID ({gpu1.uuid})",
         [f"NVIDIA_VISIBLE_DEVICES={gpu1.uuid}"],
         ["sh", "-c", "nvidia-smi -L; ls /dev | grep nvidia | tr '\\n' ' '; echo"]),
        ("the CUDA sample in a container with all GPUs",
         ["NVIDIA_VISIBLE_DEVICES=all"], ["cuda-vectoradd"]),
        ("GPU sharing: a container capped at 512 MiB by libvgpu (a 600 MiB allocation fails)",
         ["NVIDIA_VISIBLE_DEVICES=0", "CUDA_DEVICE_MEMORY_LIMIT=512m"],
         ["sh", "-c", "nvidia-smi --query-gpu=index,memory.total,memory.used --format=csv; "
          "cuda-vectoradd --alloc-mib 600; cuda-vectoradd --alloc-mib 256"]),
        ("an unknown device: nvctk refuses before runc starts anything",
         ["NVIDIA_VISIBLE_DEVICES=GPU-00000000-dead-beef-0000-000000000000"], ["true"]),
    ]
    rc = 0
    for n, (title, env, args) in enumerate(cases):
        step(title)
        bundle = make_bundle(os.path.join(tmp, f"bundle{n}"), rootfs, env, args)
        argv = [_runtime(), "--root", root, "run", "--bundle", bundle, f"nvctk-demo-{n}"]
        res = run(argv, env=sim.env)
        expected_failure = n == len(cases) - 1
        if (res != 0) != expected_failure:
            rc = 1
    return rc


def main() -> int:
    if os.geteuid() != 0:
        print("nvctk.sim.demo: needs root (the simulated host has device nodes)", file=sys.stderr)
        return 1
    tmp = tempfile.mkdtemp(prefix="nvctk-demo-")
    # nvctk-runtime's passthrough cache in the demo's dir: removed with it
    passthrough.use_cache_dir(os.path.join(tmp, "passthrough"))
    try:
        step(f"building a simulated host with 2 GPUs in {tmp}/sim")
        sim = host.init(os.path.join(tmp, "sim"), make_topology(gpus=2))
        print(f"NVCTK_CONFIG={sim.config_path}")
        rc = show_info(sim)
        rc = rc or show_nvidia_smi(sim)
        rc = rc or run_gpu_containers(sim, tmp)
        print("\ndemo " + ("succeeded" if rc == 0 else "FAILED"))
        return rc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
