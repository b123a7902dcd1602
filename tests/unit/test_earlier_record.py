"""nvctk.runtime.earlier.judge: how much of a spec's nvctk.io/edits record a create may
take out (pure: the key and the bundle's identity given). A record is honoured in full
only for the bundle it was written for and while the spec carries what it names;
otherwise only NVIDIA device access goes."""

from __future__ import annotations

import copy
from typing import Any

from nvctk.runtime.earlier import judge
from nvctk.spec import seccomp
from nvctk.spec.apply import record_edits
from nvctk.spec.record import EDITS_ANNOTATION, AppliedRecord, Seal, read_record

KEY = b"k" * 32
NODE = ["/dev/nvidia0", "c", 195, 0]
RULES = seccomp.userns_rules("x86_64")


def _spec(added: AppliedRecord, bundle: str, cdi: bool = False) -> dict[str, Any]:
    """A spec carrying what `added` names, and nvctk's record of it for `bundle`."""
    spec: dict[str, Any] = {
        "process": {"env": ["PATH=/bin", *added.env]},
        "linux": {"devices": [{"path": p, "type": t, "major": a, "minor": b}
                              for p, t, a, b in added.devices],
                  "resources": {"devices": [{"allow": True, "type": t, "major": a, "minor": b,
                                             "access": "rwm"} for t, a, b in added.rules]},
                  "seccomp": {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": copy.deepcopy(RULES)}},
    }
    record_edits(spec, added, Seal(KEY, bundle))
    return spec


def _vgpu() -> AppliedRecord:
    return AppliedRecord([NODE], [["c", 195, 0]], ["CUDA_DEVICE_MEMORY_LIMIT_0=512m"],
                         {"created": False, "syscalls": RULES, "replaced": []})


def _judged(spec: dict[str, Any], bundle: str, key: bytes | None = KEY) -> Any:
    record = read_record(spec)
    assert record is not None and not record.malformed
    return judge(record, spec, key, bundle)


def test_the_record_of_this_bundle_is_honoured_in_full() -> None:
    got = _judged(_spec(_vgpu(), "/b/1"), "/b/1")
    assert got.trusted and got.problem is None
    assert got.fields["seccomp"]["syscalls"] == RULES and got.fields["env"] == _vgpu().env


def test_another_bundles_record_takes_only_nvidia_access() -> None:
    got = _judged(_spec(_vgpu(), "/b/1"), "/b/2")
    assert not got.trusted and "not nvctk's for this bundle" in got.problem
    assert got.fields == {"devices": [NODE], "rules": [["c", 195, 0]]}


def test_a_record_naming_what_the_spec_no_longer_carries_takes_only_nvidia_access() -> None:
    for drop in ("env", "seccomp"):
        spec = _spec(_vgpu(), "/b/1")
        if drop == "env":
            spec["process"]["env"] = ["PATH=/bin"]
        else:
            spec["linux"]["seccomp"]["syscalls"] = RULES[:1]  # the profile's own, in part
        got = _judged(spec, "/b/1")
        assert not got.trusted and "no longer carries" in got.problem, drop
        assert "seccomp" not in got.fields and "env" not in got.fields


def test_a_cdi_record_of_another_bundle_takes_nothing() -> None:
    added = AppliedRecord(env=["SECRET=1"], cdi=True)
    got = _judged(_spec(added, "/b/1"), "/b/2")
    assert got.fields == {} and "nothing of it is taken out" in got.problem


def test_without_the_key_a_sealed_record_takes_only_nvidia_access() -> None:
    got = _judged(_spec(_vgpu(), "/b/1"), "/b/1", key=None)
    assert "cannot check" in got.problem and set(got.fields) == {"devices", "rules"}


def test_an_unsealed_plain_gpu_record_is_acted_on_without_a_word() -> None:
    spec = _spec(AppliedRecord([NODE], [["c", 195, 0]]), "/b/1")
    assert "mac" not in spec["annotations"][EDITS_ANNOTATION]
    got = _judged(spec, "/b/9", key=None)
    assert got.problem is None and got.fields == {"devices": [NODE], "rules": [["c", 195, 0]]}


# a runtime's default profile, as containerd and Docker resolve it for a container without
# CAP_SYS_ADMIN: clone without namespace flags (0x7E020000), unshare and clone3 refused
_RUNTIME_DEFAULT = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
    {"names": ["read", "write"], "action": "SCMP_ACT_ALLOW"},
    {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
     "args": [{"index": 0, "value": 0x7E020000, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}]},
    {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}]}


def _with(profile: dict[str, Any], *rules: dict[str, Any]) -> dict[str, Any]:
    return {**profile, "syscalls": [*profile["syscalls"], *rules]}


def test_which_profiles_let_a_new_user_namespace_through() -> None:
    """seccomp.userns_way: the way out of a DRA share's cap a profile leaves (the claim's
    hook refuses a start where it is not None)."""
    way = seccomp.userns_way
    assert way(None) == "unshare"  # no profile
    assert way({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": []}) == "unshare"
    assert way({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": seccomp.userns_rules()}) is None
    assert way(_RUNTIME_DEFAULT) is None
    # an allowed unshare (podman's default profile), clone without a condition, clone3
    assert way(_with(_RUNTIME_DEFAULT, {"names": ["unshare"], "action": "SCMP_ACT_ALLOW"})) \
        == "unshare"
    assert way(_with(_RUNTIME_DEFAULT, {"names": ["clone"], "action": "SCMP_ACT_ALLOW"})) == "clone"
    allowed3 = {**_RUNTIME_DEFAULT, "syscalls": [*_RUNTIME_DEFAULT["syscalls"][:2],
                                                 {"names": ["clone3"], "action": "SCMP_ACT_ALLOW"}]}
    assert way(allowed3) == "clone3"
    # a rule it cannot judge (a comparison on another argument only) lets it through
    assert way(_with(_RUNTIME_DEFAULT, {"names": ["unshare"], "action": "SCMP_ACT_ALLOW", "args": [
        {"index": 1, "value": 0, "valueTwo": 0, "op": "SCMP_CMP_EQ"}]})) == "unshare"
    assert way({"defaultAction": "SCMP_ACT_ALLOW", "syscalls": "x"}) == "unshare"
