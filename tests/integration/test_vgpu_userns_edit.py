"""vGPU escape through a new user namespace: the shim's seccomp edit in-process (a spec
without a GPU or a limit is untouched, a reused bundle takes exactly our rules out, a
profile nvctk cannot edit is named, one that needs no change keeps every byte). The
attack and why: tests/support/userns.py, test_vgpu_userns_e2e.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

import support.userns as _userns
import support.vgpu as tv
from nvctk.base import config as nvconfig
from nvctk.base.errors import SpecError
from nvctk.spec import apply as spec_edits
from nvctk.spec import seccomp as nvseccomp
from nvctk.spec.record import AppliedRecord
from support.records import undo_as_create
from support.runtime import validate_schema
from support.userns import (
    ARCHES,
    NEWUSER,
    PROFILES,
    X86_64,
    _prep,
    _set,
    allow_all,
    docker_like,
    make,
    spec_of,
)
from support.vgpu import MEM, NVD, Bundles

attack = _userns.attack  # fixture

# support.vgpu's fixtures: a simulated host, capped bundles
sim, config, base_rootfs, bundles = tv.sim, tv.config, tv.base_rootfs, tv.bundles

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sim, runc)")


def test_no_gpu_container_spec_is_byte_identical(bundles: Bundles, attack: Path,
                                                 config: nvconfig.Config, tmp_path: Path) -> None:
    for gpu in ("void", None):
        b = make(bundles, attack, {MEM: "512m"}, gpu=gpu or "0")
        if gpu is None:
            _set(b, **{NVD: None})
        before = (b / "config.json").read_bytes()
        _prep(b, config, tmp_path)
        assert (b / "config.json").read_bytes() == before


@pytest.mark.parametrize("own", [None, "allow-all", "containers-common-like"])
def test_gpu_container_without_limit_gets_no_seccomp_change(
        own: str | None, bundles: Bundles, attack: Path, config: nvconfig.Config,
        tmp_path: Path) -> None:
    seccomp = PROFILES[own]() if own else None
    b = make(bundles, attack, {}, seccomp=seccomp)
    _prep(b, config, tmp_path)
    spec = spec_of(b)
    assert spec["linux"].get("seccomp") == seccomp
    assert "seccomp" not in json.loads(spec["annotations"][spec_edits.EDITS_ANNOTATION])


@pytest.mark.parametrize("own", [None, *PROFILES])
def test_reused_bundle_takes_exactly_our_rules_out(own: str | None, bundles: Bundles,
                                                   attack: Path, config: nvconfig.Config,
                                                   tmp_path: Path) -> None:
    seccomp = PROFILES[own]() if own else None
    b = make(bundles, attack, {MEM: "512m"}, seccomp=seccomp)
    original = spec_of(b)
    _prep(b, config, tmp_path)
    first = (b / "config.json").read_bytes()
    capped = spec_of(b)
    ours = [r for r in nvseccomp.userns_rules() if r not in (seccomp or {}).get("syscalls", [])]
    assert capped["linux"]["seccomp"]["syscalls"][-len(ours):] == ours
    if own is None:
        assert capped["linux"]["seccomp"] == {"defaultAction": "SCMP_ACT_ALLOW",
                                              "architectures": ARCHES if X86_64 else
                                              capped["linux"]["seccomp"]["architectures"],
                                              "syscalls": nvseccomp.userns_rules()}
    validate_schema(capped)
    _prep(b, config, tmp_path)  # a second create: the same bytes
    assert (b / "config.json").read_bytes() == first

    _set(b, **{MEM: None})  # still a GPU, no limit: our rules go, theirs stay
    _prep(b, config, tmp_path)
    assert spec_of(b)["linux"].get("seccomp") == seccomp

    _set(b, **{MEM: "256m"})
    _prep(b, config, tmp_path)
    assert spec_of(b)["linux"]["seccomp"] == capped["linux"]["seccomp"]
    _set(b, **{NVD: "void", MEM: None})  # no GPU at all
    _prep(b, config, tmp_path)
    spec = spec_of(b)
    assert spec["linux"].get("seccomp") == seccomp
    assert spec["linux"].get("seccomp") == original["linux"].get("seccomp")
    assert spec_edits.EDITS_ANNOTATION not in spec.get("annotations", {})


def test_a_rule_the_user_also_has_is_theirs(bundles: Bundles, attack: Path,
                                            config: nvconfig.Config, tmp_path: Path) -> None:
    own = allow_all()
    own["syscalls"].append(nvseccomp.userns_rules()[0])
    b = make(bundles, attack, {MEM: "512m"}, seccomp=copy.deepcopy(own))
    _prep(b, config, tmp_path)
    assert spec_of(b)["linux"]["seccomp"]["syscalls"] == own["syscalls"] + nvseccomp.userns_rules()[1:]
    _set(b, **{NVD: "void"})
    _prep(b, config, tmp_path)
    assert spec_of(b)["linux"]["seccomp"] == own


def test_edit_record_can_only_take_our_rules_out() -> None:
    """A forged record (no MAC) removes no seccomp rule at all, nvctk's included, and
    puts nothing back; a profile that holds only nvctk's rules stays too."""
    mine = {"names": ["ptrace"], "action": "SCMP_ACT_ERRNO"}
    allow = {"names": ["unshare", "getpid"], "action": "SCMP_ACT_ALLOW"}
    syscalls = [mine, *nvseccomp.userns_rules()]
    spec: dict[str, Any] = {
        "linux": {"seccomp": {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ARCHES,
                              "syscalls": copy.deepcopy(syscalls)}},
        "annotations": {spec_edits.EDITS_ANNOTATION: json.dumps({
            "devices": [], "rules": [], "env": [],
            "seccomp": {"created": True, "syscalls": [mine, *nvseccomp.userns_rules()],
                        "replaced": [[0, allow, [mine]], [1, "x", []], "junk"]}})},
    }
    undo_as_create(spec, "/", None)
    assert spec["linux"]["seccomp"]["syscalls"] == syscalls


@pytest.mark.parametrize(("seccomp", "where"), [
    ([], "linux.seccomp must be an object, not an array"),
    ({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": {}},
     "linux.seccomp.syscalls must be an array, not an object"),
    ({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_NE"}]}]},
     "linux.seccomp.syscalls[0] lets clone through on conditions nvctk cannot combine"),
    ({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [
        {"names": ["unshare"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": NEWUSER, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"},
                  {"index": 0, "value": 1, "op": "SCMP_CMP_NE"}]}]},
     "linux.seccomp.syscalls[0] lets unshare through on conditions"),
    ({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [
        {"names": ["unshare"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 1, "value": 0, "op": "SCMP_CMP_EQ"},
                  {"index": 1, "value": 5, "op": "SCMP_CMP_EQ"}]}]},
     "linux.seccomp.syscalls[0] lets unshare through on conditions"),
])
def test_a_profile_nvctk_cannot_edit_is_named(seccomp: Any, where: str) -> None:
    spec: dict[str, Any] = {"linux": {"seccomp": seccomp}}
    with pytest.raises(SpecError, match=re.escape(where)):
        nvseccomp.block_user_namespaces(spec, AppliedRecord())


def test_profiles_that_need_no_change_keep_every_byte() -> None:
    """Rules that already refuse, or let clone through only without CLONE_NEWUSER (Docker's),
    are not narrowed; a rule of the profile's own made conditional gets our condition added."""
    own = docker_like()
    own["syscalls"] += [
        {"names": ["unshare"], "action": "SCMP_ACT_KILL"},
        {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
         "args": [{"index": 0, "value": 0x11, "op": "SCMP_CMP_EQ"}]},
    ]
    spec: dict[str, Any] = {"linux": {"seccomp": copy.deepcopy(own)}}
    edits = AppliedRecord()
    nvseccomp.block_user_namespaces(spec, edits)
    added = nvseccomp.userns_rules()[:2]  # Docker's profile has clone3's rule already
    assert spec["linux"]["seccomp"]["syscalls"] == own["syscalls"] + added
    assert edits.seccomp == {"created": False, "syscalls": added, "replaced": []}
    other_arg = {"names": ["clone", "getpid"], "action": "SCMP_ACT_LOG",
                 "args": [{"index": 1, "value": 0, "op": "SCMP_CMP_EQ"}]}
    spec = {"linux": {"seccomp": {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [other_arg]}}}
    nvseccomp.block_user_namespaces(spec, AppliedRecord())
    assert spec["linux"]["seccomp"]["syscalls"][:2] == [
        {**other_arg, "names": ["getpid"]},
        {**other_arg, "names": ["clone"], "args": [
            *other_arg["args"],
            {"index": 0, "value": NEWUSER, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]}]
