"""What tests/integration/test_vgpu_userns_*.py share: the user-namespace attack (a C
program trying unshare, clone and clone3 with CLONE_NEWUSER), the bundles that run it,
and seccomp profiles of the spec's own (allow-all, docker-like, common-like)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from nvctk.base import config as nvconfig
from nvctk.spec import seccomp as nvseccomp
from nvctk.vgpu import state as vgpu_state
from support.vgpu import Bundles, cleanup_state, prep, spec_of

X86_64 = os.uname().machine == "x86_64"

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
