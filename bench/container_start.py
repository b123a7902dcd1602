#!/usr/bin/env python3
"""Container start cost of nvctk-runtime, measured side by side with runc.

Run as root from the repo with the venv set up (`make bench`). Everything runs
on a simulated host built in a temp dir; each figure is the median of N runs,
with the compared commands interleaved so drift on the machine hits all alike.

1. passthrough: `nvctk-runtime state X` vs `runc state X` vs a bare start of
   the interpreter the installed entry point uses (`python3 -I -S -c pass`).
   Goal: t(nvctk-runtime state) - t(runc state) <= 1.5 x t(bare start).
2. GPU container start: `nvctk-runtime run` of a 1-GPU container vs plain
   `runc run` of the same container without a GPU request. Goal <= 2.0x.
   With 8 GPUs (`all`) <= 1.2x the 1-GPU case.

Bundles and runc's state live on a tmpfs, as under containerd, Docker and CRI-O
(/run); the rootfs on disk. The report also splits the 1-GPU start into the shim,
the hook and the device nodes, and measures the floor of the design in the same
run: a Python runtime that only execs runc plus a Python hook that only reads its
state (and one that also runs the host's ldconfig).

Writes a report to stdout and, with --out, to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from nvctk.sim import host as simhost  # noqa: E402
from nvctk.sim.rootfs import build_rootfs  # noqa: E402
from nvctk.sim.topology import make_topology  # noqa: E402

VENV_BIN = Path(sys.executable).parent


def timed(argv: list[str], env: dict[str, str] | None = None, ok: bool = True) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    dt = time.perf_counter() - t0
    if ok and res.returncode != 0:
        raise RuntimeError(f"{argv}: {res.stderr.decode(errors='replace')}")
    return dt


def interleave(n: int, cases: dict[str, Callable[[], float]]) -> dict[str, float]:
    samples: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():  # warm-up: page cache, pyc files
        fn()
    for _ in range(n):
        for name, fn in cases.items():
            samples[name].append(fn())
    return {k: statistics.median(v) * 1000 for k, v in samples.items()}


def bundle(path: Path, rootfs: Path, env: list[str], args: list[str]) -> Path:
    path.mkdir(parents=True)
    subprocess.run(["runc", "spec", "--bundle", str(path)], check=True)
    spec = json.loads((path / "config.json").read_text())
    spec["root"] = {"path": str(rootfs), "readonly": False}
    spec["process"]["terminal"] = False
    spec["process"]["args"] = args
    spec["process"]["env"] = ["PATH=/usr/local/bin:/usr/bin:/bin", *env]
    (path / "config.json").write_text(json.dumps(spec))
    return path


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def _with_runtimes(config_text: str, runtime: str) -> str:
    lines = [ln for ln in config_text.splitlines() if not ln.startswith("runtimes")]
    return "\n".join([*lines, f'runtimes = ["{runtime}"]']) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=25)
    ap.add_argument("--out", type=Path)
    opts = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/container_start.py: needs root", file=sys.stderr)
        return 1
    runtime = str(VENV_BIN / "nvctk-runtime")
    runc = shutil.which("runc") or "runc"
    py = str(VENV_BIN / "python3")
    tmp = Path(tempfile.mkdtemp(prefix="nvctk-bench-"))
    # bundles and runc's state on a tmpfs, where containerd, Docker and CRI-O keep
    # them (/run); the rootfs stays on disk, as an image's overlay does
    run_dir = tmp / "run"
    run_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700", "tmpfs", str(run_dir)],
                   check=True)
    root = run_dir / "runc-root"
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    try:
        sim1 = simhost.init(str(tmp / "sim1"), make_topology(gpus=1))
        sim8 = simhost.init(str(tmp / "sim8"), make_topology(gpus=8))
        rootfs = Path(build_rootfs(str(tmp / "rootfs"), with_sample=sim1.sample))
        env1 = {**os.environ, **sim1.env}
        env8 = {**os.environ, **sim8.env}

        # 1. passthrough on a created (not started) container
        b = bundle(run_dir / "b-state", rootfs, [], ["/bin/sleep", "60"])
        subprocess.run([runc, "--root", str(root), "create", "--bundle", str(b), "st"],
                       check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        try:
            # passthrough runs are cheap and their differences small: more samples
            p = interleave(max(opts.n, 100), {
                "bare": lambda: timed([py, "-I", "-S", "-c", "pass"]),
                "runc state": lambda: timed([runc, "--root", str(root), "state", "st"]),
                "nvctk-runtime state": lambda: timed(
                    [runtime, "--root", str(root), "state", "st"], env=env1),
            })
        finally:
            subprocess.run([runc, "--root", str(root), "delete", "--force", "st"])
        overhead = p["nvctk-runtime state"] - p["runc state"]
        say(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, "
            f"kernel {platform.release()}, python {platform.python_version()}")
        say(f"medians of interleaved runs ({max(opts.n, 100)} each for passthrough, "
            f"{opts.n} for container starts); times in ms")
        say()
        say("passthrough")
        for k, v in p.items():
            say(f"  {k:<22} {v:7.2f}")
        say(f"  overhead = {overhead:.2f} ms = {overhead / p['bare']:.2f} x bare start "
            f"(goal <= 1.50)")

        # 2. container starts: run to completion (/bin/true), deleted by runc on exit
        gpu = bundle(run_dir / "b-gpu", rootfs, ["NVIDIA_VISIBLE_DEVICES=0"], ["/bin/true"])
        gpu8 = bundle(run_dir / "b-gpu8", rootfs, ["NVIDIA_VISIBLE_DEVICES=all"], ["/bin/true"])
        plain = bundle(run_dir / "b-plain", rootfs, [], ["/bin/true"])
        counter = iter(range(10**6))

        def run(rt: str, b: Path, env: dict[str, str]) -> Callable[[], float]:
            return lambda: timed([rt, "--root", str(root), "run", "--bundle", str(b),
                                  f"c{next(counter)}"], env=env)

        # where the time goes: the shim alone (its low-level runtime is /bin/true), and
        # plain runc on the spec the shim wrote, with and without nvctk's hook
        only_shim = Path(sim1.env["NVCTK_CONFIG"]).with_name("shim-only.toml")
        only_shim.write_text(_with_runtimes(Path(sim1.env["NVCTK_CONFIG"]).read_text(),
                                            "/bin/true"))
        env_shim = {**env1, "NVCTK_CONFIG": str(only_shim)}
        edited = run_dir / "b-edited"
        shutil.copytree(gpu, edited)
        subprocess.run([runtime, "create", "--bundle", str(edited), "x"], env=env_shim,
                       check=True)
        no_hook = run_dir / "b-no-hook"
        shutil.copytree(edited, no_hook)
        spec = json.loads((no_hook / "config.json").read_text())
        spec.pop("hooks")
        (no_hook / "config.json").write_text(json.dumps(spec))
        # the floor of this design: a Python runtime that only execs runc and a Python
        # prestart hook that only reads its state (then one that also runs the host's
        # ldconfig in the rootfs), started as nvctk's launchers are (#!python3 -IS)
        shebang = f"#!{py} -IS\n"
        null_shim = _script(tmp / "null-shim", shebang + "import os, sys\n"
                            f"os.execv({runc!r}, [{runc!r}, *sys.argv[1:]])\n")
        null_hook = _script(tmp / "null-hook", shebang + "import sys\nsys.stdin.buffer.read()\n")
        ldconfig_hook = _script(tmp / "ldconfig-hook", shebang + (
            "import os, sys\nsys.stdin.buffer.read()\npid = os.fork()\nif pid == 0:\n"
            "    os.close(2)\n"
            f"    os.execv('/sbin/ldconfig', ['ldconfig', '-r', {str(rootfs)!r}])\n"
            "os.waitpid(pid, 0)\n"))
        floors = {}
        for name, hook in (("null", null_hook), ("ldconfig", ldconfig_hook)):
            floors[name] = run_dir / f"b-floor-{name}"
            shutil.copytree(no_hook, floors[name])
            spec["hooks"] = {"prestart": [{"path": str(hook), "args": [str(hook)]}]}
            (floors[name] / "config.json").write_text(json.dumps(spec))

        c = interleave(opts.n, {
            "runc run (no GPU)": run(runc, plain, env1),
            "nvctk-runtime run, 1 GPU": run(runtime, gpu, env1),
            "nvctk-runtime run, 8 GPUs": run(runtime, gpu8, env8),
            "shim alone (create, 1 GPU)": lambda: timed(
                [runtime, "create", "--bundle", str(gpu), f"s{next(counter)}"], env=env_shim),
            "runc run, edited, no hook": run(runc, no_hook, env1),
            "runc run, edited, hook": run(runc, edited, env1),
            "floor": run(str(null_shim), floors["null"], env1),
            "floor + ldconfig": run(str(null_shim), floors["ldconfig"], env1),
        })
        say()
        say("container start (create + start + exit + delete)")
        for k in ("runc run (no GPU)", "nvctk-runtime run, 1 GPU", "nvctk-runtime run, 8 GPUs"):
            say(f"  {k:<28} {c[k]:7.2f}")
        r1 = c["nvctk-runtime run, 1 GPU"] / c["runc run (no GPU)"]
        r8 = c["nvctk-runtime run, 8 GPUs"] / c["nvctk-runtime run, 1 GPU"]
        say(f"  1 GPU / runc   = {r1:.2f} x (goal <= 2.00)")
        say(f"  8 GPUs / 1 GPU = {r8:.2f} x (goal <= 1.20)")
        say()
        say("where the 1-GPU start goes")
        say(f"  nvctk-runtime create alone (low-level runtime /bin/true) "
            f"{c['shim alone (create, 1 GPU)']:7.2f}")
        say(f"  runc run of the edited spec without the hook            "
            f"{c['runc run, edited, no hook']:7.2f}")
        say(f"  the same with nvctk-hook prestart                       "
            f"{c['runc run, edited, hook']:7.2f}")
        say(f"  so: shim {c['shim alone (create, 1 GPU)']:.1f}, hook "
            f"{c['runc run, edited, hook'] - c['runc run, edited, no hook']:.1f}, device "
            f"nodes {c['runc run, edited, no hook'] - c['runc run (no GPU)']:.1f}, "
            f"bare interpreter start {p['bare']:.1f} ms")
        say()
        say("the floor of the design (a Python runtime that only execs runc, a Python")
        say("prestart hook that only reads its state; same spec, devices included)")
        for k in ("floor", "floor + ldconfig"):
            label = k + (" (the hook also runs the host's ldconfig)" if k != "floor" else "")
            say(f"  {label:<56} {c[k]:7.2f} = {c[k] / c['runc run (no GPU)']:.2f} x runc")
    finally:
        # tmp itself is no mount point: `umount -R tmp` would leave run_dir mounted
        subprocess.run(["umount", "-R", str(run_dir)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    if opts.out:
        opts.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
