"""vGPU escape through a new user namespace, end to end (nvctk-runtime + runc).

A capped container's root without CAP_SYS_ADMIN (runc's default spec: no seccomp
profile) could create a user namespace, and with it CAP_SYS_ADMIN over a mount
namespace of its own: there it mounted over /etc (so /etc/ld.so.preload, libvgpu,
was gone) and allocated past the cap. nvctk-runtime now gives a vGPU container
seccomp rules that make a new user namespace fail (nvctk.spec.seccomp.block_user_namespaces):
unshare/clone with CLONE_NEWUSER -> EPERM, clone3 -> ENOSYS. A profile of the spec's
own keeps its rules; the ones that would let a new user namespace through are
narrowed; a later create of the bundle without vGPU takes exactly that back out.
The attack and the profiles: tests/support/userns.py; the shim's edit in-process:
test_vgpu_userns_edit.py; records forged or replayed: test_vgpu_userns_records.py.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import support.userns as _userns
import support.vgpu as tv
from nvctk.base import config as nvconfig
from nvctk.edits_file import EDITS_FILE
from nvctk.sim import host
from nvctk.spec import seccomp as nvseccomp
from nvctk.vgpu import state as vgpu_state
from support.runtime import validate_schema
from support.userns import NEWUSER, PROFILES, WAYS, make, refused_output, spec_of
from support.vgpu import MEM, Bundles, Runc, create_logged, lines, stop

attack = _userns.attack  # fixture

# support.vgpu's fixtures: a simulated host, capped bundles, nvctk-runtime + runc
sim, config, base_rootfs, bundles, runc = tv.sim, tv.config, tv.base_rootfs, tv.bundles, tv.runc

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sim, runc)")


OOM = "alloc 600 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"
UNCAPPED = "alloc 600 MiB: OK"


# --- end to end (nvctk-runtime + runc) -----------------------------------------------------

@pytest.mark.slow
def test_new_user_namespace_is_refused_in_a_capped_container(runc: Runc, bundles: Bundles,
                                                            attack: Path) -> None:
    """runc's default spec (no profile): before, each way allocated 600 MiB under 512m."""
    b = make(bundles, attack, {MEM: "512m"})
    spec = spec_of(b)
    assert "seccomp" not in spec["linux"]
    assert "CAP_SYS_ADMIN" not in spec["process"]["capabilities"]["bounding"]
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert UNCAPPED not in out, out
    assert lines(out, "thread:") == ["thread: OK"], out  # glibc falls back from clone3
    assert [x for x in out.splitlines() if x.split(":")[0] in WAYS] == refused_output(), out
    assert lines(out, "limit-env:") == [f"limit-env: {OOM}"], out
    assert lines(out, "fits:") == ["fits: alloc 400 MiB: OK"], out
    validate_schema(spec_of(b))


@pytest.mark.slow
def test_busybox_unshare_as_uid_1000_is_refused(runc: Runc, bundles: Bundles,
                                                attack: Path) -> None:
    """uid 1000 needs no CAP_SETFCAP to map itself to root in the new namespace:
    `unshare -Urm` then mounts over /etc as the image's own shell would."""
    script = ("unshare -Urm sh -c 'mount -t tmpfs none /etc && echo \"inside: $(cuda-vectoradd "
              "--alloc-mib 600)\"' 2>&1 | sed 's/^/unshare: /'\n"
              "echo \"limit-env: $(env -u CUDA_DEVICE_MEMORY_LIMIT cuda-vectoradd "
              "--alloc-mib 600)\"\n")
    b = make(bundles, attack, {MEM: "512m"}, script)
    spec = spec_of(b)
    spec["process"]["user"] = {"uid": 1000, "gid": 1000}
    (b / "config.json").write_text(json.dumps(spec))
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert "inside:" not in out, out
    assert lines(out, "unshare:") == ["unshare: unshare: unshare(0x10020000): Operation not "
                                      "permitted"], out
    assert lines(out, "limit-env:") == [f"limit-env: {OOM}"], out


@pytest.mark.slow
def test_runc_exec_gets_the_rules_too(runc: Runc, bundles: Bundles, attack: Path) -> None:
    """A process exec'd into the running container (runc exec, docker exec) runs under
    the container's profile."""
    b = make(bundles, attack, {MEM: "512m"}, "echo started; sleep 600")
    cid, p = runc.start(b)
    assert p.stdout is not None
    try:
        assert p.stdout.readline().strip() == "started"
        r = subprocess.run(["runc", "--root", str(runc.root), "exec", cid,
                            "/usr/local/bin/userns_attack", "unshare",
                            "/usr/local/bin/cuda-vectoradd", "--alloc-mib", "600"],
                           capture_output=True, text=True, timeout=60)
        assert r.stdout.splitlines() == ["unshare: Operation not permitted"], r.stdout + r.stderr
    finally:
        stop(runc, cid, p)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROFILES))
def test_a_profile_of_the_spec_keeps_its_rules_and_refuses_too(
        name: str, runc: Runc, bundles: Bundles, attack: Path) -> None:
    own = PROFILES[name]()
    b = make(bundles, attack, {MEM: "512m"}, seccomp=own)
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert UNCAPPED not in out, out
    assert lines(out, "thread:") == ["thread: OK"], out
    assert [x for x in out.splitlines() if x.split(":")[0] in WAYS] == \
        refused_output("SCMP_ARCH_X86" in own.get("architectures", ())), out
    assert lines(out, "fits:") == ["fits: alloc 400 MiB: OK"], out
    got = spec_of(b)["linux"]["seccomp"]
    validate_schema(spec_of(b))
    assert {k: v for k, v in got.items() if k != "syscalls"} == \
        {k: v for k, v in own.items() if k != "syscalls"}
    ours = [r for r in nvseccomp.userns_rules() if r not in own["syscalls"]]  # Docker's has clone3's
    assert len(ours) == (2 if name == "docker-like" else 3)
    assert got["syscalls"][-len(ours):] == ours
    theirs = got["syscalls"][:-len(ours)]
    if name != "containers-common-like":
        assert theirs == own["syscalls"]  # every rule as it was, in its order
        return
    # the unconditional allow is split: everything but clone3 still allowed, unshare and
    # clone only without CLONE_NEWUSER
    assert theirs[0] == own["syscalls"][0]
    rest = [n for n in own["syscalls"][1]["names"] if n not in ("unshare", "clone", "clone3")]
    assert theirs[1:] == [
        {"names": rest, "action": "SCMP_ACT_ALLOW", "args": []},
        {"names": ["clone", "unshare"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": NEWUSER, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]}]


@pytest.mark.slow
def test_privileged_container_is_left_alone(runc: Runc, bundles: Bundles, attack: Path) -> None:
    """CAP_SYS_ADMIN in the bounding set: no rules (it could mount over /etc without a user
    namespace). The cap is not enforced against such a container's root: the documented
    limit, shown here with the same attack, which also proves the attack works."""
    b = make(bundles, attack, {MEM: "512m"}, "userns_attack unshare /usr/local/bin/cuda-vectoradd "
             "--alloc-mib 600\n")
    spec = spec_of(b)
    for kind in ("bounding", "effective", "permitted"):
        spec["process"]["capabilities"][kind].append("CAP_SYS_ADMIN")
    (b / "config.json").write_text(json.dumps(spec))
    r = runc.run(b)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "seccomp" not in spec_of(b)["linux"]
    assert lines(r.stdout, "alloc ") == [UNCAPPED], r.stdout


@pytest.mark.slow
def test_a_profile_nvctk_cannot_judge_fails_the_create(bundles: Bundles, attack: Path,
                                                       sim: host.SimHost, config: nvconfig.Config,
                                                       tmp_path: Path) -> None:
    own = {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [
        {"names": ["unshare"], "action": "SCMP_ACT_LOG",
         "args": [{"index": 0, "value": NEWUSER | 0x20000, "op": "SCMP_CMP_EQ"}]}]}
    b = make(bundles, attack, {MEM: "512m"}, seccomp=own)
    before = (b / "config.json").read_bytes()
    r, log = create_logged(tmp_path, b, sim)
    culprit = ("config.json: linux.seccomp.syscalls[0] lets unshare through on conditions nvctk "
               "cannot combine with its rule against new user namespaces")
    assert r.returncode != 0
    assert culprit in r.stderr, r.stderr
    assert any(culprit in json.loads(x)["msg"] for x in log.read_text().splitlines())
    assert (b / "config.json").read_bytes() == before
    assert not (b / EDITS_FILE).exists()
    assert not os.path.exists(vgpu_state.state_dir_for(config, str(tmp_path / "runc-root"), "cid"))
