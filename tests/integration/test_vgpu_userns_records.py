"""vGPU escape through a new user namespace: removal takes only what nvctk provably added
to this spec; a forged record, or a genuine one replayed onto another container or a
bundle made anew, takes none of its rules out nor opens user namespaces. The attack and
why: tests/support/userns.py, test_vgpu_userns_e2e.py.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import support.userns as _userns
import support.vgpu as tv
from nvctk.base import config as nvconfig
from nvctk.spec import apply as spec_edits
from nvctk.spec import seccomp as nvseccomp
from support.userns import (
    ARCHES,
    WAYS,
    X86_64,
    _prep,
    _set,
    allow_all,
    make,
    refused_output,
    spec_of,
)
from support.vgpu import MEM, NVD, Bundles, Runc

attack = _userns.attack  # fixture

# support.vgpu's fixtures: a simulated host, capped bundles, nvctk-runtime + runc
sim, config, base_rootfs, bundles, runc = tv.sim, tv.config, tv.base_rootfs, tv.bundles, tv.runc

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sim, runc)")


# --- a forged record: removal takes only what nvctk provably added ---

def _narrowed_unshare() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An allow rule for unshare, and what nvctk narrows it to."""
    rule = {"names": ["unshare"], "action": "SCMP_ACT_ALLOW"}
    new = nvseccomp._narrowed(rule, "", os.uname().machine)
    assert new is not None
    return rule, new


def _forgeries() -> dict[str, tuple[list[Any], dict[str, Any]]]:
    """Forged records against a profile that carries its own rules: (the spec's
    syscalls, the record's seccomp part). Each, if honoured, lets a new user namespace
    through: nvctk's rules taken out, a narrowed rule widened back, the profile dropped."""
    ours = nvseccomp.userns_rules()
    rule, narrowed = _narrowed_unshare()
    return {
        "our-rules-out": (copy.deepcopy(ours), {"created": False, "syscalls": ours, "replaced": []}),
        "one-rule-out": (copy.deepcopy(ours), {"created": False, "syscalls": ours[:1],
                                               "replaced": []}),
        "narrowed-widened": ([*copy.deepcopy(narrowed), *copy.deepcopy(ours)],
                             {"created": False, "syscalls": [],
                              "replaced": [[0, rule, narrowed]]}),
        "profile-dropped": (copy.deepcopy(ours), {"created": True, "syscalls": ours,
                                                  "replaced": []}),
    }


FORGERIES = list(_forgeries())


def _forge(b: Path, name: str, mac: str | None = None) -> dict[str, Any]:
    syscalls, rec = _forgeries()[name]
    spec = spec_of(b)
    spec["linux"]["seccomp"] = {"defaultAction": "SCMP_ACT_ALLOW", "architectures":
                                list(nvseccomp._SECCOMP_ARCHES.get(os.uname().machine, ())),
                                "syscalls": syscalls}
    record: dict[str, Any] = {"devices": [], "rules": [], "env": [], "seccomp": rec}
    if mac is not None:
        record["mac"] = mac
    spec.setdefault("annotations", {})[spec_edits.EDITS_ANNOTATION] = json.dumps(record)
    (b / "config.json").write_text(json.dumps(spec, indent="\t"))
    return spec["linux"]["seccomp"]


@pytest.mark.parametrize("gpu", ["void", "0-no-limit", "0-capped"])
@pytest.mark.parametrize("name", FORGERIES)
@pytest.mark.parametrize("mac", [None, "0" * 64])
def test_a_forged_record_takes_no_seccomp_rule_out(
        name: str, gpu: str, mac: str | None, bundles: Bundles, attack: Path,
        config: nvconfig.Config, tmp_path: Path) -> None:
    """Before: nvctk deleted the rules a spec carried itself when its annotation listed
    them, in a no-GPU container too; unshare(CLONE_NEWUSER) then succeeded."""
    env = {NVD: "void"} if gpu == "void" else {MEM: "512m"} if gpu == "0-capped" else {}
    b = make(bundles, attack, env)
    if gpu == "0-capped":
        _prep(b, config, tmp_path)  # the key exists: a wrong MAC is checked, not just absent
    own = _forge(b, name, mac)
    _prep(b, config, tmp_path)
    spec = spec_of(b)
    kept = spec["linux"]["seccomp"]["syscalls"]
    for rule in own["syscalls"]:
        assert rule in kept, (name, rule, kept)
    assert "SCMP_ACT_ALLOW" not in [r["action"] for r in kept if "unshare" in r["names"]
                                    and not r.get("args")]


def test_our_own_record_still_takes_our_rules_out(bundles: Bundles, attack: Path,
                                                  config: nvconfig.Config, tmp_path: Path) -> None:
    """The record nvctk wrote (MAC'd with the state dir's key) is honoured in full."""
    rule, narrowed = _narrowed_unshare()
    own = {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [rule]}
    b = make(bundles, attack, {MEM: "512m"}, seccomp=copy.deepcopy(own))
    _prep(b, config, tmp_path)
    capped = spec_of(b)
    assert capped["linux"]["seccomp"]["syscalls"][:len(narrowed)] == narrowed
    assert "mac" in json.loads(capped["annotations"][spec_edits.EDITS_ANNOTATION])
    _set(b, **{NVD: "void", MEM: None})
    _prep(b, config, tmp_path)
    assert spec_of(b)["linux"]["seccomp"] == own


@pytest.mark.slow
@pytest.mark.parametrize("gpu", ["void", "0"])
@pytest.mark.parametrize("name", ["our-rules-out", "narrowed-widened"])
def test_a_forged_record_does_not_open_user_namespaces(name: str, gpu: str, runc: Runc,
                                                       bundles: Bundles, attack: Path) -> None:
    """End to end: a container (no GPU, or a GPU without a limit) whose own profile
    carries nvctk's rules, with a forged record of them: before, nvctk took the rules
    out and unshare(CLONE_NEWUSER) succeeded."""
    script = "\n".join(f"out=$(userns_attack {w} /bin/true); echo \"{w}: $out (rc $?)\""
                       for w in WAYS) + "\n"
    b = make(bundles, attack, {NVD: gpu}, script=script)
    _forge(b, name)
    r = runc.run(b)
    out = r.stdout
    assert r.returncode == 0, out + r.stderr
    assert [x for x in out.splitlines() if x.split(":")[0] in WAYS] == refused_output(), out


# --- a genuine record replayed: nvctk removes only what it proves it added to this spec ---
#
# Before: a record nvctk wrote for one container (MAC over the record alone), copied into
# another container's annotations (Docker's --annotation; CRI-O hands a Pod's annotations
# to every container of it), was honoured in full there: rules equal to nvctk's that the
# other container's own profile carried were taken out, and user namespaces opened.

def _genuine_record(bundles: Bundles, attack: Path, config: nvconfig.Config,
                    tmp_path: Path) -> tuple[Path, str]:
    """A capped container without a profile of its own: (its bundle, the record nvctk
    wrote for it, which names a profile it made and all of nvctk's rules)."""
    a = make(bundles, attack, {MEM: "512m"})
    _prep(a, config, tmp_path, cid="a")
    record = spec_of(a)["annotations"][spec_edits.EDITS_ANNOTATION]
    assert json.loads(record)["seccomp"]["syscalls"] == nvseccomp.userns_rules()
    return a, record


def _own_profile(overlap: str) -> dict[str, Any]:
    """A container's own profile: its own rule, and nvctk's rules (all, or one of them)."""
    mine = {"names": ["ptrace"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}
    ours = nvseccomp.userns_rules()
    return {**allow_all(), "syscalls": [mine, *(ours if overlap == "full" else ours[:1])]}


def _replay(b: Path, record: str, how: str) -> None:
    """The record into b's spec as the engine would put it there."""
    spec = spec_of(b)
    annotations = spec.setdefault("annotations", {})
    if how == "crio-pod-annotation":
        # CRI-O: the Pod's annotations, among CRI-O's own, on every container of the Pod
        annotations.update({"io.kubernetes.cri-o.ContainerType": "container",
                            "io.kubernetes.pod.namespace": "default",
                            "io.kubernetes.cri-o.Annotations": json.dumps(
                                {spec_edits.EDITS_ANNOTATION: record})})
    annotations[spec_edits.EDITS_ANNOTATION] = record  # docker run --annotation: just this
    (b / "config.json").write_text(json.dumps(spec, indent="\t"))


def _assert_own_rules_stay(own: dict[str, Any], spec: dict[str, Any]) -> None:
    kept = [nvseccomp.rule_key(r) for r in spec["linux"]["seccomp"]["syscalls"]]
    for rule in own["syscalls"]:
        assert nvseccomp.rule_key(rule) in kept, (rule, kept)
        kept.remove(nvseccomp.rule_key(rule))


@pytest.mark.parametrize("gpu", ["void", "0-no-limit", "0-capped"])
@pytest.mark.parametrize("overlap", ["full", "partial"])
@pytest.mark.parametrize("how", ["docker-annotation", "crio-pod-annotation"])
def test_a_record_from_another_container_takes_none_of_its_rules_out(
        how: str, overlap: str, gpu: str, bundles: Bundles, attack: Path,
        config: nvconfig.Config, tmp_path: Path) -> None:
    _, record = _genuine_record(bundles, attack, config, tmp_path)
    env = {NVD: "void"} if gpu == "void" else {MEM: "512m"} if gpu == "0-capped" else {}
    own = _own_profile(overlap)
    b = make(bundles, attack, env, seccomp=copy.deepcopy(own))
    _replay(b, record, how)
    _prep(b, config, tmp_path, cid="b")
    spec = spec_of(b)
    _assert_own_rules_stay(own, spec)
    if gpu == "void":
        assert spec["linux"]["seccomp"] == own
    if gpu == "0-capped":
        # the rules the profile carried are its own: nvctk's new record does not claim them
        # (or a later create without the cap would take them out)
        added = json.loads(spec["annotations"][spec_edits.EDITS_ANNOTATION])["seccomp"]["syscalls"]
        assert [nvseccomp.rule_key(r) for r in added] == \
            [nvseccomp.rule_key(r) for r in nvseccomp.userns_rules()
             if r not in own["syscalls"]]


@pytest.mark.parametrize("gpu", ["void", "0-no-limit"])
def test_a_record_for_a_bundle_made_anew_at_the_same_path_takes_nothing_out(
        gpu: str, bundles: Bundles, attack: Path, config: nvconfig.Config,
        tmp_path: Path) -> None:
    """A container made again under an id an earlier one had (ctr, a reused bundle
    path) with that container's record: the path is the same, the bundle is not."""
    a, record = _genuine_record(bundles, attack, config, tmp_path)
    own = _own_profile("full")
    b = make(bundles, attack, {NVD: "void"} if gpu == "void" else {},
             seccomp=copy.deepcopy(own))
    shutil.rmtree(a)
    shutil.copytree(b, a, symlinks=True)
    _replay(a, record, "docker-annotation")
    _prep(a, config, tmp_path, cid="a")
    _assert_own_rules_stay(own, spec_of(a))


def test_a_record_whose_additions_the_spec_no_longer_carries_takes_nothing_out(
        bundles: Bundles, attack: Path, config: nvconfig.Config, tmp_path: Path) -> None:
    """The record's own bundle, its config.json written anew (an engine or a user) with a
    profile of its own that holds only some of nvctk's rules, the record kept: those
    rules are the profile's, not the ones nvctk added."""
    a, _ = _genuine_record(bundles, attack, config, tmp_path)
    own = _own_profile("partial")
    spec = spec_of(a)
    spec["linux"]["seccomp"] = copy.deepcopy(own)
    spec["process"]["env"] = [e for e in spec["process"]["env"] if not e.startswith(MEM)]
    spec["process"]["env"].append(f"{NVD}=void")
    (a / "config.json").write_text(json.dumps(spec, indent="\t"))
    _prep(a, config, tmp_path, cid="a")
    assert spec_of(a)["linux"]["seccomp"] == own


@pytest.mark.slow
@pytest.mark.parametrize("gpu", ["void", "0"])
def test_a_replayed_record_does_not_open_user_namespaces(
        gpu: str, runc: Runc, bundles: Bundles, attack: Path, config: nvconfig.Config,
        tmp_path: Path) -> None:
    """End to end: the container's own profile refuses new user namespaces with rules
    equal to nvctk's; another container's genuine record is set on it (docker run
    --annotation): before, nvctk took the rules out and unshare(CLONE_NEWUSER) worked."""
    _, record = _genuine_record(bundles, attack, config, tmp_path)
    script = "\n".join(f"out=$(userns_attack {w} /bin/true); echo \"{w}: $out (rc $?)\""
                       for w in WAYS) + "\n"
    b = make(bundles, attack, {NVD: gpu}, script=script,
             seccomp={**allow_all(), "architectures": ARCHES if X86_64 else [],
                      "syscalls": nvseccomp.userns_rules()})
    _replay(b, record, "docker-annotation")
    r = runc.run(b)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [x for x in r.stdout.splitlines() if x.split(":")[0] in WAYS] == refused_output(), \
        r.stdout
