"""nvctk-runtime on a real NVIDIA driver (bench/gpu/real_driver.sh runs it on a GPU machine;
it runs on the simulated host too: `--driver-root SIM`).

Builds a busybox+glibc rootfs (nvctk.sim.rootfs), then runs containers through
nvctk-runtime and real runc, as a user would, and records what each printed:
  gpu        NVIDIA_VISIBLE_DEVICES=0: nvidia-smi -L, the device nodes, cuprobe info
  vgpu       the same with CUDA_DEVICE_MEMORY_LIMIT=1g: nvidia-smi's memory, cuprobe alloc
  cdi        nvctk's own CDI spec (`nvctk cdi generate`), NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0
  nogpu      no GPU asked: nvctk must not touch it
and, after them, what was left: mounts under the bundles, nvctk state dirs, processes.
Also times container starts (`run ... true`) through nvctk-runtime and plain runc.
Prints a JSON summary; exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from nvctk.sim.demo import make_bundle
from nvctk.sim.rootfs import build_rootfs


def sh(argv: list[str], env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, str]:
    try:
        p = subprocess.run(argv, env={**os.environ, **(env or {})}, capture_output=True,
                           text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout}s"
    return p.returncode, (p.stdout + p.stderr).strip()


def write_config(path: str, opts: argparse.Namespace, mode: str, cdi_dir: str) -> None:
    with open(path, "w") as f:
        f.write(
            f'driver-root = "{opts.driver_root}"\n'
            f'runtimes = ["{opts.runc}"]\n'
            f'hook-path = "{os.path.join(opts.bin, "nvctk-hook")}"\n'
            f'ldconfig = "{opts.ldconfig}"\n'
            f'log-file = "{opts.log}"\n'
            'log-level = "debug"\n'
            f'vgpu-library = "{opts.libvgpu}"\n'
            f'mode = "{mode}"\n'
            f'cdi-spec-dirs = ["{cdi_dir}"]\n'
            + opts.extra_config.replace("\\n", "\n")
        )


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True, help="dir with nvctk, nvctk-runtime, nvctk-hook")
    ap.add_argument("--runc", required=True)
    ap.add_argument("--probe", required=True, help="cuprobe, built for this host")
    ap.add_argument("--libvgpu", required=True)
    ap.add_argument("--driver-root", default="/")
    ap.add_argument("--ldconfig", default="/sbin/ldconfig")
    ap.add_argument("--log", default="/tmp/nvctk-real.log")
    ap.add_argument("--extra-config", default="")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    opts = ap.parse_args()
    for k in ("bin", "runc", "probe", "libvgpu"):
        setattr(opts, k, os.path.abspath(getattr(opts, k)))
    return opts


# what each case's container runs: (mode's config, env, args)
CASES = {
    "gpu": ("legacy", ["NVIDIA_VISIBLE_DEVICES=0"],
            ["sh", "-c", "nvidia-smi -L; ls /dev | grep nvidia | tr '\\n' ' '; echo; cuprobe info"]),
    "vgpu": ("legacy", ["NVIDIA_VISIBLE_DEVICES=0", "CUDA_DEVICE_MEMORY_LIMIT=1g"],
             ["sh", "-c", "nvidia-smi --query-gpu=index,memory.total,memory.used --format=csv; "
              "cuprobe alloc 256 8"]),
    "cdi": ("cdi", ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"],
            ["sh", "-c", "nvidia-smi -L; cuprobe info"]),
    "nogpu": ("legacy", [], ["sh", "-c", "ls /dev | tr '\\n' ' '"]),
}


def main() -> int:
    opts = parse_args()
    tmp = tempfile.mkdtemp(prefix="nvctk-real-")
    rootfs = build_rootfs(os.path.join(tmp, "rootfs"))
    shutil.copy2(opts.probe, os.path.join(rootfs, "usr/local/bin/cuprobe"))
    cdi_dir = os.path.join(tmp, "cdi")
    os.makedirs(cdi_dir)
    configs = {mode: os.path.join(tmp, f"{mode}.toml") for mode in ("legacy", "cdi")}
    for mode, path in configs.items():
        write_config(path, opts, mode, cdi_dir)
    legacy = configs["legacy"]
    nvctk, runtime = os.path.join(opts.bin, "nvctk"), os.path.join(opts.bin, "nvctk-runtime")
    root = os.path.join(tmp, "runc-root")
    out: dict[str, object] = {}

    out["info"] = sh([nvctk, "info"], {"NVCTK_CONFIG": legacy})[1]
    rc, text = sh([nvctk, "cdi", "generate", "--output", os.path.join(cdi_dir, "nvidia.yaml")],
                  {"NVCTK_CONFIG": legacy})
    out["cdi_generate"] = {"rc": rc, "out": text[-2000:]}
    for n, (name, (mode, env, args)) in enumerate(CASES.items()):
        b = make_bundle(os.path.join(tmp, f"b-{name}"), rootfs, env, args, opts.runc)
        rc, text = sh([runtime, "--root", root, "run", "--bundle", b, f"real-{n}"],
                      {"NVCTK_CONFIG": configs[mode]})
        out[name] = {"rc": rc, "out": text[-3000:]}
    failures = case_failures(*(str(out[k]["out"]) for k in CASES))  # type: ignore[index]

    def starts(argv_of: Callable[[str, str], list[str]], env: list[str]) -> list[float]:
        times = []
        for i in range(opts.reps):
            b = make_bundle(os.path.join(tmp, f"t-{len(os.listdir(tmp))}"), rootfs, env, ["true"], opts.runc)
            t0 = time.perf_counter()
            sh(argv_of(b, f"t{i}-{os.path.basename(b)}"), {"NVCTK_CONFIG": legacy})
            times.append((time.perf_counter() - t0) * 1000)
        return times

    plain = starts(lambda b, i: [opts.runc, "--root", root, "run", "--bundle", b, i], [])
    via = starts(lambda b, i: [runtime, "--root", root, "run", "--bundle", b, i],
                 ["NVIDIA_VISIBLE_DEVICES=0"])
    out["start_ms_median"] = {"runc_no_gpu": statistics.median(plain),
                              "nvctk_runtime_gpu0": statistics.median(via)}

    left = sh(["sh", "-c", f"grep -c '{tmp}' /proc/self/mountinfo || true"])[1]
    out["mounts_left"] = left
    if left.strip() not in ("0", ""):
        failures.append(f"{left} mounts left under {tmp}")
    out["runc_list"] = sh([opts.runc, "--root", root, "list"])[1]
    out["log_tail"] = sh(["tail", "-n", "15", opts.log])[1]
    out["failures"] = failures
    for k, v in out.items():
        print(f"== {k}:\n{v}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(out, f, indent=1)
    shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failures else 0


def case_failures(gpu: str, vgpu: str, cdi_out: str, nogpu: str) -> list[str]:
    """What the cases' containers printed that they should not have (CASES' order)."""
    failures = []
    if "GPU 0:" not in gpu or "devices: 1" not in gpu:
        failures.append("gpu: nvidia-smi -L or cuprobe did not see exactly one GPU")
    if "1024 MiB" not in vgpu or "allocated:" not in vgpu or "x 256 MiB = 1024 MiB" in vgpu:
        failures.append("vgpu: the 1 GiB cap was not what the container saw and held")
    if "GPU 0:" not in cdi_out or "devices: 1" not in cdi_out:
        failures.append("cdi: the container did not see its GPU")
    if "nvidia" in nogpu:
        failures.append("nogpu: a container that asked for no GPU got NVIDIA device nodes")
    return failures


if __name__ == "__main__":
    sys.exit(main())
