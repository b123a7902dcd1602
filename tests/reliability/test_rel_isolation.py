"""Isolation that others' inputs must not undo, and operator tools that must not destroy
what they touch, through the real
nvctk-runtime + runc, the real `nvctk` commands and the real device-plugin code:

- forged `nvctk.io/edits` records against a profile carrying nvctk's own rules
  (rules out, a narrowed rule widened, the profile dropped; no MAC or a wrong one), in
  a no-GPU, a GPU and a capped container: busybox `unshare -U` must stay refused;
- CDI mode and legacy mode with a host directory bound (rw, ro) at every place the
  driver's files, nodes and links go: start or clean refusal, the decoy unchanged;
- another vendor's CDI device (binding the decoy read-write) named by the env, an
  annotation or a device mount: refused, the decoy unchanged;
- `nvctk labels --output` and `nvctk cdi generate --output` aimed at a character
  device, a FIFO, a socket, a directory and a symlink; `nvctk vgpu gc` among
  look-alike directories: nothing of the operator's replaced or removed;
- `run` on specs runc refuses, after nvctk prepared a vGPU container: no state left.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from nvctk.sim.host import SimHost
from nvctk.spec import apply as spec_edits
from nvctk.spec import seccomp as nvseccomp
from support import reliability as relkit

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (runc, device nodes)")]

LIB = "/usr/lib/x86_64-linux-gnu"
NVCTK = relkit.NVCTK


def _profile(syscalls: list[Any]) -> dict[str, Any]:
    return {"defaultAction": "SCMP_ACT_ALLOW", "architectures":
            list(nvseccomp._SECCOMP_ARCHES.get(os.uname().machine, ())), "syscalls": syscalls}


def _forgeries() -> dict[str, tuple[list[Any], dict[str, Any]]]:
    ours = nvseccomp.userns_rules()
    rule = {"names": ["unshare"], "action": "SCMP_ACT_ALLOW"}
    narrowed = nvseccomp._narrowed(rule, "", os.uname().machine) or []
    return {
        "our rules out": (ours, {"created": False, "syscalls": ours, "replaced": []}),
        "unshare rule out": (ours, {"created": False, "syscalls": ours[:1], "replaced": []}),
        "narrowed rule widened": ([*narrowed, *ours], {"created": False, "syscalls": [],
                                                      "replaced": [[0, rule, narrowed]]}),
        "profile dropped": (ours, {"created": True, "syscalls": ours, "replaced": []}),
    }


def test_forged_edit_records(sim_host: SimHost, rootfs: Any, tmp_path: Path) -> None:
    base = str(rootfs())
    attempts = escapes = 0
    outcomes: dict[str, int] = {}
    with relkit.lab(tmp_path, sim_host.config_path) as la:
        for syscalls, rec in _forgeries().values():
            for gpu in (["NVIDIA_VISIBLE_DEVICES=void"], ["NVIDIA_VISIBLE_DEVICES=0"],
                        ["NVIDIA_VISIBLE_DEVICES=0", "CUDA_DEVICE_MEMORY_LIMIT=512m"]):
                for mac in (None, "0" * 64):
                    record = {"devices": [], "rules": [], "env": [], "seccomp": rec,
                              **({"mac": mac} if mac else {})}

                    def edit(spec: dict[str, Any], syscalls: list[Any] = syscalls,
                             record: dict[str, Any] = record) -> None:
                        spec["linux"]["seccomp"] = _profile(json.loads(json.dumps(syscalls)))
                        spec["annotations"] = {spec_edits.EDITS_ANNOTATION: json.dumps(record)}

                    b = la.bundle(None, gpu, ["/bin/sh", "-c", "unshare -U true; echo rc=$?"],
                                  base=base, edit=edit)
                    cid = la.new_id()
                    r = la.run(b, cid)
                    attempts += 1
                    assert relkit.clean_failure(r.stderr), r.stderr[-3000:]
                    assert r.returncode == 0, r.stderr[-3000:]
                    if "rc=0" in r.stdout:
                        escapes += 1
                    outcomes[r.stdout.strip()[-40:]] = outcomes.get(r.stdout.strip()[-40:], 0) + 1
                    la.delete(cid)
    relkit.record("hostile", "forged nvctk.io/edits records against a profile's own "
                  "user-namespace rules", attempts=attempts, escapes=escapes,
                  forgeries=len(_forgeries()), refusals=outcomes)
    assert escapes == 0, outcomes


def _cdi_dir(sim_host: SimHost, tmp_path: Path, decoy: Path) -> Path:
    d = tmp_path / "cdi-specs"
    d.mkdir()
    r = subprocess.run([NVCTK, "cdi", "generate", "--output", str(d / "nvidia.yaml")],
                       env={**os.environ, "NVCTK_CONFIG": sim_host.config_path},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    (d / "net.json").write_text(json.dumps({
        "cdiVersion": "0.5.0", "kind": "example.com/net", "devices": [{
            "name": "eth", "containerEdits": {"mounts": [
                {"hostPath": str(decoy), "containerPath": "/host", "options": ["rbind", "rw"]}]}}]}))
    return d


BIND_AT = [LIB, "/lib/x86_64-linux-gnu", "/usr", "/usr/bin", "/usr/share", "/usr/share/vulkan", "/etc", "/run", "/dev",
           "/lib/firmware"]


def test_cdi_and_legacy_with_host_dirs_bound(sim_host: SimHost, rootfs: Any,
                                             tmp_path: Path) -> None:
    from support.reliability import Checked

    base = str(rootfs())
    decoy = relkit.make_decoy(tmp_path / "decoy")
    cdi = _cdi_dir(sim_host, tmp_path, decoy)
    results: dict[str, Any] = {}
    for mode in ("cdi", "legacy"):
        (tmp_path / f"lab-{mode}").mkdir()
        with relkit.lab(tmp_path / f"lab-{mode}", sim_host.config_path, **{
                "mode": f'mode = "{mode}"', "cdi-spec-dirs": f'cdi-spec-dirs = ["{cdi}"]'}) as la:
            ck = Checked(la, decoy, sim_host.root)
            for dest in BIND_AT:
                for opt in ("rw", "ro"):
                    def edit(spec: dict[str, Any], dest: str = dest, opt: str = opt) -> None:
                        spec["mounts"].append({"destination": dest, "type": "bind",
                                               "source": str(decoy), "options": ["rbind", opt]})

                    b = la.bundle(None, ["NVIDIA_VISIBLE_DEVICES=0",
                                         "NVIDIA_DRIVER_CAPABILITIES=all"],
                                  ["/bin/sh", "-c", "true"], base=base, edit=edit)
                    ck.start(b)
            results[mode] = ck
    attempts = sum(c.attempts for c in results.values())
    relkit.record("hostile", "host dirs bound where CDI and legacy mode put driver files, "
                  "nodes and links", attempts=attempts,
                  started=sum(c.started for c in results.values()),
                  refused=sum(c.refused for c in results.values()), escapes=0,
                  refusals={k: v for c in results.values() for k, v in c.reasons.items()})


def test_foreign_cdi_vendor(sim_host: SimHost, rootfs: Any, tmp_path: Path) -> None:
    from support.reliability import Checked

    base = str(rootfs())
    decoy = relkit.make_decoy(tmp_path / "decoy")
    cdi = _cdi_dir(sim_host, tmp_path, decoy)
    touch = ["/bin/sh", "-c", "touch /host/escaped; true"]
    (tmp_path / "l").mkdir()
    with relkit.lab(tmp_path / "l", sim_host.config_path, **{
            "cdi-spec-dirs": f'cdi-spec-dirs = ["{cdi}"]',
            "accept-volume-mount-devices": "accept-volume-mount-devices = true"}) as la:
        ck = Checked(la, decoy, sim_host.root)
        cases: list[tuple[list[str], Any]] = [
            (["NVIDIA_VISIBLE_DEVICES=example.com/net=eth"], None),
            (["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0,example.com/net=eth"], None),
            (["NVIDIA_VISIBLE_DEVICES=EXAMPLE.COM/net=eth"], None),
            ([], lambda s: s.update(annotations={"cdi.k8s.io/x": "example.com/net=eth"})),
            ([], lambda s: s["mounts"].append({
                "destination": "/var/run/nvidia-container-devices/example.com/net=eth",
                "type": "bind", "source": "/dev/null", "options": ["bind"]})),
        ]
        for env, edit in cases:
            b = la.bundle(None, env, touch, base=base, edit=edit)
            ck.start(b)
        assert ck.started == 0, ck.reasons
    relkit.record("hostile", "another vendor's CDI device (a read-write host mount) from the "
                  "env, annotations, device mounts", attempts=ck.attempts, started=ck.started,
                  refused=ck.refused, escapes=0, refusals=ck.reasons)


def _plant(path: Path, kind: str) -> None:
    if kind == "chardev":
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "dir":
        relkit.make_decoy(path)
    elif kind == "symlink":
        path.symlink_to(relkit.make_decoy(path.with_name(path.name + ".target")))
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()


def _look(path: Path) -> tuple[Any, ...]:
    st = os.lstat(path)
    return (st.st_mode, st.st_ino, st.st_rdev,
            relkit.tree_digest(path) if stat.S_ISDIR(st.st_mode) else None)


def test_operator_tools(sim_host: SimHost, tmp_path: Path) -> None:
    env = {**os.environ, **sim_host.env, "NVCTK_CONFIG": sim_host.config_path}
    attempts = losses = 0
    for command in (["labels", "--output"], ["cdi", "generate", "--output"]):
        for kind in ("chardev", "fifo", "socket", "dir", "symlink"):
            out = tmp_path / f"{command[0]}-{kind}"
            _plant(out, kind)
            before = _look(out)
            r = subprocess.run([NVCTK, *command, str(out)], env=env, capture_output=True,
                               text=True, timeout=120)
            attempts += 1
            assert "Traceback" not in r.stderr, r.stderr
            assert r.returncode == 1 and "not a regular file" in r.stderr, r.stderr
            losses += _look(out) != before
    # gc among look-alikes: an operator's dirs named like nvctk's state dirs
    state = Path(json.loads(next(
        line.partition("=")[2] for line in Path(sim_host.config_path).read_text().splitlines()
        if line.startswith("state-dir"))))
    state.mkdir(parents=True, exist_ok=True)
    made = []
    dead = json.dumps({"runtime_root": "/nonexistent", "id": "gone", "pid": 999999, "start": 1})
    for i, owner in enumerate((None, dead, "{junk")):
        d = state / f"{'e' * 15}{i}-lookalike"
        relkit.make_decoy(d)
        if owner is not None:
            (d / "owner").write_text(owner)
        old = time.time() - 3600
        os.utime(d, (old, old))
        made.append((d, relkit.tree_digest(d)))
    try:
        r = subprocess.run([NVCTK, "vgpu", "gc", "--grace", "0"], env=env, capture_output=True,
                           text=True, timeout=120)
        attempts += len(made)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        losses += sum(not d.is_dir() or relkit.tree_digest(d) != digest for d, digest in made)
    finally:
        import shutil

        for d, _ in made:
            shutil.rmtree(d, ignore_errors=True)
    relkit.record("hostile", "operator tools aimed at devices, FIFOs, sockets, dirs, links, "
                  "look-alike state dirs", attempts=attempts, escapes=losses)
    assert losses == 0


def test_failed_runs_leave_no_state(sim_host: SimHost, rootfs: Any, tmp_path: Path) -> None:
    base = str(rootfs())
    edits = {
        "relative cwd": lambda s: s["process"].update(cwd="relative/dir"),
        "hostname without uts": lambda s: (s.update(hostname="box"), s["linux"].update(
            namespaces=[n for n in s["linux"]["namespaces"] if n["type"] != "uts"])),
        "non-object mount": lambda s: s["mounts"].append("/tmp"),
        "missing program": lambda s: s["process"].update(args=["/no/such/program"]),
    }
    leaks = 0
    with relkit.lab(tmp_path, sim_host.config_path) as la:
        for edit in edits.values():
            b = la.bundle(None, ["NVIDIA_VISIBLE_DEVICES=0", "CUDA_DEVICE_MEMORY_LIMIT=512m"],
                          base=base, edit=edit)
            cid = la.new_id()
            r = la.run(b, cid)
            assert r.returncode != 0 and relkit.clean_failure(r.stderr), r.stderr[-3000:]
            la.delete(cid)  # what a user would do; the state must be gone before it anyway
            leaks += len(la.state_entries())
            assert relkit.mounts_under(la.state_dir) == []
    relkit.record("hostile", "runc run refusing a prepared vGPU container's spec",
                  attempts=len(edits), leaks=leaks)
    assert leaks == 0
