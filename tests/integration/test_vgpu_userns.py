"""vGPU escape through a new user namespace.

A capped container's root without CAP_SYS_ADMIN (runc's default spec: no seccomp
profile) could create a user namespace, and with it CAP_SYS_ADMIN over a mount
namespace of its own: there it mounted over /etc (so /etc/ld.so.preload, libvgpu,
was gone) and allocated past the cap. nvctk-runtime now gives a vGPU container
seccomp rules that make a new user namespace fail (nvctk.spec.seccomp.block_user_namespaces):
unshare/clone with CLONE_NEWUSER -> EPERM, clone3 -> ENOSYS. A profile of the spec's
own keeps its rules; the ones that would let a new user namespace through are
narrowed; a later create of the bundle without vGPU takes exactly that back out.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

import support.vgpu as tv
from nvctk.base import config as nvconfig
from nvctk.base.errors import SpecError
from nvctk.edits_file import EDITS_FILE
from nvctk.sim import host
from nvctk.spec import apply as spec_edits
from nvctk.spec import seccomp as nvseccomp
from nvctk.spec.record import AppliedRecord
from nvctk.vgpu import state as vgpu_state
from support.records import undo_as_create
from support.runtime import validate_schema
from support.vgpu import (
    MEM,
    NVD,
    Bundles,
    Runc,
    cleanup_state,
    create_logged,
    lines,
    prep,
    stop,
)

# support.vgpu's fixtures: a simulated host, capped bundles, nvctk-runtime + runc
sim, config, base_rootfs, bundles, runc = tv.sim, tv.config, tv.base_rootfs, tv.bundles, tv.runc

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (sim, runc)")

X86_64 = os.uname().machine == "x86_64"
OOM = "alloc 600 MiB: FAILED CUDA_ERROR_OUT_OF_MEMORY (2)"
UNCAPPED = "alloc 600 MiB: OK"
NEWUSER = nvseccomp.CLONE_NEWUSER
ARCHES = ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"]

# The attack, static (no libvgpu in it): a new user namespace (and mount namespace) by
# unshare, clone, clone3 or, on x86-64, unshare through the i386 ABI; there tmpfs over
# /etc, then exec the program given. "thread" checks that glibc's pthread_create (clone3,
# then clone on ENOSYS) still works.
ATTACK_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#ifndef SYS_clone3
#define SYS_clone3 435
#endif
struct clone_args_v0 { uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack,
                       stack_size, tls; };
static void *nothing(void *arg) { return arg; }
static int hide_and_exec(char **argv) {
    if (mount("none", "/etc", "tmpfs", 0, NULL) != 0) {
        printf("mount: %s\n", strerror(errno));
        return 4;
    }
    fflush(stdout);
    execv(argv[0], argv);
    printf("exec: %s\n", strerror(errno));
    return 5;
}
static int parent_wait(const char *how, long pid) {
    if (pid < 0) { printf("%s: %s\n", how, strerror(errno)); return 3; }
    if (pid == 0) return -1;
    int status = 0;
    waitpid((pid_t)pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
int main(int argc, char **argv) {
    if (argc < 2) return 2;
    const char *how = argv[1];
    if (!strcmp(how, "thread")) {
        pthread_t t;
        int e = pthread_create(&t, NULL, nothing, NULL);
        if (e == 0) pthread_join(t, NULL);
        printf("thread: %s\n", e ? strerror(e) : "OK");
        return e ? 1 : 0;
    }
    if (argc < 3) return 2;
    long flags = CLONE_NEWUSER | CLONE_NEWNS;
    int rc;
    fflush(stdout);
    if (!strcmp(how, "unshare")) {
        if (unshare((int)flags) != 0) { printf("unshare: %s\n", strerror(errno)); return 3; }
        return hide_and_exec(argv + 2);
#ifdef __x86_64__
    } else if (!strcmp(how, "int80")) {
        long ret;
        __asm__ volatile("int $0x80" : "=a"(ret) : "a"(310L), "b"(flags) : "memory");
        if (ret < 0) { printf("int80: %s\n", strerror((int)-ret)); return 3; }
        return hide_and_exec(argv + 2);
#endif
    } else if (!strcmp(how, "clone")) {
        rc = parent_wait(how, syscall(SYS_clone, flags | SIGCHLD, 0, 0, 0, 0));
    } else if (!strcmp(how, "clone3")) {
        struct clone_args_v0 a;
        memset(&a, 0, sizeof a);
        a.flags = (uint64_t)flags;
        a.exit_signal = SIGCHLD;
        rc = parent_wait(how, syscall(SYS_clone3, &a, sizeof a));
    } else {
        return 2;
    }
    return rc >= 0 ? rc : hide_and_exec(argv + 2);
}
"""

WAYS = ["unshare", "clone", "clone3", *(["int80"] if X86_64 else [])]
REFUSED = {"unshare": "unshare: Operation not permitted", "clone": "clone: Operation not permitted",
           "clone3": "clone3: Function not implemented", "int80": "int80: Operation not permitted"}


@pytest.fixture(scope="module")
def attack(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    d = tmp_path_factory.mktemp("userns")
    (d / "attack.c").write_text(ATTACK_C)
    subprocess.run(["gcc", "-O2", "-static", "-pthread", "-o", str(d / "userns_attack"),
                    str(d / "attack.c")], check=True, capture_output=True)
    return d / "userns_attack"


SCRIPT = "\n".join([
    "userns_attack thread",
    *(f"out=$(userns_attack {w} /usr/local/bin/cuda-vectoradd --alloc-mib 600); "
      f"echo \"{w}: $out (rc $?)\"" for w in WAYS),
    "echo \"limit-env: $(env -u CUDA_DEVICE_MEMORY_LIMIT cuda-vectoradd --alloc-mib 600)\"",
    "echo \"fits: $(cuda-vectoradd --alloc-mib 400)\"",
]) + "\n"


def make(bundles: Bundles, attack: Path, env: dict[str, str], script: str = SCRIPT,
         seccomp: dict[str, Any] | None = None, gpu: str = "0") -> Path:
    b = bundles.make(env, script, gpu=gpu)
    shutil.copy(attack, b / "rootfs/usr/local/bin/userns_attack")
    if seccomp is not None:
        spec = json.loads((b / "config.json").read_text())
        spec["linux"]["seccomp"] = seccomp
        (b / "config.json").write_text(json.dumps(spec, indent="\t"))
    return b


def spec_of(b: Path) -> dict[str, Any]:
    return json.loads((b / "config.json").read_text())


def refused_output(x86_listed: bool = True) -> list[str]:
    """What each way prints when refused; through int 0x80 with a profile that lists no
    x86 ABI, runc's filter kills the process (SIGSYS) instead."""
    return [f"{w}:  (rc {128 + 31})" if w == "int80" and not x86_listed else
            f"{w}: {REFUSED[w]} (rc 3)" for w in WAYS]


# --- profiles of the spec's own ------------------------------------------------------------

def _syscall_names() -> list[str]:
    header = Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
    if not header.exists():
        pytest.skip(f"needs {header} (linux-libc-dev) for an allow-list profile")
    return sorted(set(re.findall(r"#define __NR_(\w+) ", header.read_text())))


def allow_all() -> dict[str, Any]:
    return {"defaultAction": "SCMP_ACT_ALLOW",
            "syscalls": [{"names": ["ptrace"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}]}


def docker_like() -> dict[str, Any]:
    """Docker's default profile for a container without CAP_SYS_ADMIN, in shape: an
    allow-list without unshare, clone only without namespace flags, clone3 ENOSYS."""
    names = [n for n in _syscall_names() if n not in ("clone", "clone3", "unshare")]
    return {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 1, "architectures": ARCHES,
            "syscalls": [
                {"names": names, "action": "SCMP_ACT_ALLOW"},
                {"names": ["clone"], "action": "SCMP_ACT_ALLOW",
                 "args": [{"index": 0, "value": 2114060288, "valueTwo": 0,
                           "op": "SCMP_CMP_MASKED_EQ"}]},
                {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38}]}


def common_like() -> dict[str, Any]:
    """containers/common's default (Podman, CRI-O): unshare, clone and clone3 allowed
    unconditionally, which libseccomp lets win over any conditional rule of nvctk's."""
    return {"defaultAction": "SCMP_ACT_ERRNO", "defaultErrnoRet": 38, "architectures": ARCHES,
            "syscalls": [{"names": ["vmsplice"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
                         {"names": _syscall_names(), "action": "SCMP_ACT_ALLOW", "args": []}]}


PROFILES = {"allow-all": allow_all, "docker-like": docker_like, "containers-common-like": common_like}


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


# --- the shim's edit, in-process ----------------------------------------------------------

def _prep(b: Path, config: nvconfig.Config, tmp_path: Path, cid: str = "u") -> None:
    root = str(tmp_path / "rr")
    try:
        prep(b, config, cid, root)
    finally:
        cleanup_state(config, vgpu_state.state_dir_for(config, root, cid))


def _set(b: Path, **env: str | None) -> None:
    spec = spec_of(b)
    kept = [e for e in spec["process"]["env"] if e.partition("=")[0] not in env]
    spec["process"]["env"] = kept + [f"{k}={v}" for k, v in env.items() if v is not None]
    (b / "config.json").write_text(json.dumps(spec, indent="\t"))


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
