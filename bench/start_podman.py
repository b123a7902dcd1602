"""`podman run --device KIND=0 IMAGE true` with nvctk's CDI spec and with NCT's (same
host, same image): bench/container_start.py's podman rows."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from runtime_lifecycle import Case, pctl

from support.podman import private_podman

# podman: the CDI specs go to /var/run/cdi (podman 4.3 reads no other dir) under vendors
# of the bench's own
PODMAN_SPEC_DIR = Path("/var/run/cdi")


class Podman:
    """`podman run --rm --device KIND=0 IMAGE true` with private storage, one image
    imported from the bench's rootfs; close() removes all of it and the specs."""

    def __init__(self, exe: str, rootfs: Path) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="nvctk-bp-", dir="/tmp"))  # short: runroot
        dirs, self.env, self.base = private_podman(exe, self.work)
        self.specs: list[Path] = []
        self.image = "localhost/nvctk-bench:latest"
        tar = subprocess.run(["tar", "-C", str(rootfs), "-c", "."], capture_output=True,
                             check=True).stdout
        # the import caches blob digests under /var/lib/containers: a /var/lib of its own
        subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-ec",
                        'mount --bind "$0" /var/lib; exec "$@"', str(dirs["varlib"]),
                        *self.base, "import", "-", self.image], input=tar, env=self.env,
                       capture_output=True, check=True)

    def add_spec(self, data: bytes, name: str) -> None:
        PODMAN_SPEC_DIR.mkdir(parents=True, exist_ok=True)
        p = PODMAN_SPEC_DIR / name
        p.write_bytes(data)
        self.specs.append(p)

    def run(self, kind: str, args: list[str]) -> str:
        r = subprocess.run([*self.base, "run", "--rm", "--network", "none", "--device",
                            f"{kind}=0", self.image, *args], env=self.env,
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"podman run --device {kind}=0 exited {r.returncode}: "
                               f"{r.stderr[-2000:]}")
        return r.stdout

    def close(self) -> None:
        for p in self.specs:
            p.unlink(missing_ok=True)
        for what in (["rm", "--all", "--force"], ["rmi", "--all", "--force"]):
            subprocess.run([*self.base, *what], env=self.env, capture_output=True, timeout=120)
        mounts = []
        with open("/proc/self/mountinfo") as f:
            for line in f:
                mp = line.split()[4]
                if mp.startswith(str(self.work) + "/"):
                    mounts.append(mp)
        for mp in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", mp], capture_output=True)
        shutil.rmtree(self.work, ignore_errors=True)


def podman_cases(tmp: Path, cfg: Path, sim_root: str, nct_bin: Path | None,
                 say: Callable[[str], None], venv_bin: Path) -> tuple[list[Case], Podman | None]:
    """`podman run --device K=0 IMAGE true` with nvctk's spec and with NCT's (same
    host, same image), for the bench's podman rows; none when podman is absent."""
    exe = shutil.which("podman")
    if exe is None:
        say("podman not found: its rows are skipped")
        return [], None
    pm = Podman(exe, tmp / "rootfs")
    tag = os.urandom(4).hex()
    kinds = {"nvctk": f"b{tag}.nvctk.bench/gpu"}
    out = subprocess.run([str(venv_bin / "nvctk"), "cdi", "generate", "--vendor",
                          f"b{tag}.nvctk.bench", "--class", "gpu"],
                         env={**os.environ, "NVCTK_CONFIG": str(cfg)}, check=True,
                         capture_output=True).stdout
    pm.add_spec(out, f"nvctk-bench-{tag}.yaml")
    if nct_bin is not None:
        kinds["NCT"] = f"b{tag}.nct.bench/gpu"
        nct_out = tmp / "nct-podman.yaml"
        subprocess.run([str(nct_bin / "nvidia-ctk"), "cdi", "generate",
                        f"--driver-root={sim_root}", f"--dev-root={sim_root}",
                        f"--nvidia-cdi-hook-path={nct_bin / 'nvidia-cdi-hook'}",
                        f"--vendor=b{tag}.nct.bench", "--class=gpu", f"--output={nct_out}"],
                       check=True, capture_output=True)
        pm.add_spec(nct_out.read_bytes(), f"nct-bench-{tag}.yaml")
    cases = []
    for who, kind in kinds.items():
        listed = pm.run(kind, ["sh", "-c", "ls -d /dev/nvidia[0-9]*"]).split()
        if listed != ["/dev/nvidia0"]:
            raise RuntimeError(f"podman with {who}'s spec: expected /dev/nvidia0, got {listed}")

        def one(kind: str = kind) -> float:
            t0 = time.perf_counter()
            pm.run(kind, ["true"])
            return time.perf_counter() - t0
        cases.append(Case(f"podman run, {who}'s CDI spec, 1 GPU", one))
    return cases, pm



def report_podman(say: Callable[[str], None], cases: list[Case], n: int) -> None:
    med = {c.label: statistics.median(c.samples) * 1000 for c in cases}
    say("")
    say(f"podman run --rm --network none --device KIND=0 IMAGE true ({n} interleaved runs "
        "each; the spec in /var/run/cdi)")
    for c in cases:
        say(f"  {c.label:<42} median {med[c.label]:7.2f}  p90 "
            f"{pctl(c.samples, 0.9) * 1000:7.2f}")
    if len(cases) == 2:
        a, b = (med[c.label] for c in cases)
        say(f"  {'podman run with nvctk spec / with NCT spec':<52} {a / b:5.2f} x  (goal <= 1.00)")
