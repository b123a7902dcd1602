"""nvctk-hook prestart against a simulated host and a fake container.

The "container" is `unshare -m --propagation private sleep` (see
support/canary/harness.py); the hook runs as the real executable with runc's hook
environment, and everything is checked through /proc/<pid>/{root,mountinfo}.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from nvctk.base import config as nvconfig
from nvctk.base import stamped
from nvctk.base.mounts import parse_mountinfo
from nvctk.edits import Mount
from nvctk.hook.elf import elf_interpreter
from nvctk.hook.inputs import sanitize_environ
from nvctk.host import ldcache
from nvctk.sim.host import SimHost
from support.canary.harness import (
    HOOK,
    HOOK_PATH_ENV,
    Bundle,
    cpath,
    fake_container,
    make_bundle,
    make_plan,
    mountinfo,
    run_hook,
)
from support.launchers import Launchers

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (mount namespaces)")

LIB = "/usr/lib/x86_64-linux-gnu"


@pytest.fixture
def host_table() -> Iterator[None]:
    """The test process's mount table must be the same after the test."""
    before = mountinfo()
    yield
    assert mountinfo() == before


def mounts_under(pid: int, rootfs: str) -> dict[str, str]:
    """{container path: mount options} of the mounts below rootfs in pid's namespace."""
    out = {}
    for line in mountinfo(pid).splitlines():
        info = parse_mountinfo(line)[0]
        if info.mount_point.startswith(rootfs + "/"):
            out[info.mount_point[len(rootfs):]] = line.split()[5]
    return out


@pytest.fixture
def setup(sim_host: SimHost, rootfs: Callable[..., str], tmp_path: Path
          ) -> Callable[..., tuple[Bundle, str]]:
    def make(**plan_kwargs: object) -> tuple[Bundle, str]:
        root = rootfs()
        os.makedirs(os.path.join(root, "proc/driver/nvidia"))
        Path(root, "proc/driver/nvidia/secret").write_text("host-only\n")
        plan = make_plan(sim_host, **plan_kwargs)  # type: ignore[arg-type]
        return make_bundle(str(tmp_path / "bundle"), root, plan), root

    return make


@pytest.mark.exclusive  # compares the host's whole mount table
def test_hook_mounts_links_masks_and_ldconfig(setup: Callable[..., tuple[Bundle, str]],
                                              sim_host: SimHost, host_table: None) -> None:
    bundle, root = setup()
    v = sim_host.topology.driver_version
    with fake_container() as pid:
        r = run_hook(bundle, pid)
        assert r.returncode == 0, r.stderr
        mounts = mounts_under(pid, root)
        lib = f"{LIB}/libcuda.so.{v}"
        for path in (lib, f"{LIB}/libnvidia-ml.so.{v}", "/usr/bin/nvidia-smi"):
            assert path in mounts, mounts
            assert {"ro", "nosuid", "nodev"} <= set(mounts[path].split(",")), mounts[path]
        sock = "/run/nvidia-persistenced/socket"
        assert {"rw", "nosuid", "nodev", "noexec"} <= set(mounts[sock].split(","))
        # firmware lands where the image's /lib -> usr/lib link says, inside the rootfs
        assert f"/usr/lib/firmware/nvidia/{v}/gsp_ga10x.bin" in mounts
        with pytest.raises(OSError) as e:
            open(cpath(pid, root, lib), "ab").close()
        assert e.value.errno == errno.EROFS
        assert os.readlink(cpath(pid, root, f"{LIB}/libcuda.so")) == "libcuda.so.1"
        # ldconfig ran chrooted: SONAME links and the image's cache
        assert os.readlink(cpath(pid, root, f"{LIB}/libcuda.so.1")) == f"libcuda.so.{v}"
        names = {e.name for e in ldcache.read(cpath(pid, root, "/"))}
        assert {"libcuda.so.1", "libnvidia-ml.so.1", "libc.so.6"} <= names
        # /proc/driver/nvidia: a read-only tmpfs with only the allowed entries
        proc = cpath(pid, root, "/proc/driver/nvidia")
        assert {"ro", "noexec"} <= set(mounts["/proc/driver/nvidia"].split(","))
        assert sorted(os.listdir(proc)) == ["gpus", "params", "registry", "version"]
        params = Path(proc, "params").read_text()
        assert "ModifyDeviceFiles: 0" in params and "ModifyDeviceFiles: 1" not in params
        buses = sorted(os.listdir(os.path.join(sim_host.proc_dir, "gpus")))
        assert os.listdir(os.path.join(proc, "gpus")) == buses[:1]
        assert Path(proc, "gpus", buses[0], "information").read_text() == Path(
            sim_host.proc_dir, "gpus", buses[0], "information").read_text()
        assert Path(proc, "version").read_text() == Path(sim_host.proc_dir, "version").read_text()
    # nothing was mounted in the host's namespace, nothing under the host's rootfs
    assert not os.path.exists(os.path.join(root, LIB.lstrip("/"), f"libcuda.so.{v}")) or \
        os.path.getsize(os.path.join(root, LIB.lstrip("/"), f"libcuda.so.{v}")) == 0


def test_caps_logged_per_step_at_debug(setup: Callable[..., tuple[Bundle, str]]) -> None:
    bundle, _ = setup()
    with fake_container() as pid:
        assert run_hook(bundle, pid).returncode == 0
    log = bundle.log_text()
    steps = {}
    for line in log.splitlines():
        if "caps step=" in line:
            assert " DEBUG: " in line
            rest = line.split("caps step=", 1)[1]
            name, eff = rest.split(" effective=")
            steps[name] = set(eff.split(",")) - {"-"}
    assert steps["open"] >= {"sys_admin"}
    assert steps["mount"] == {"sys_admin", "dac_override", "fowner"}
    assert steps["symlink"] == {"dac_override", "fowner"}
    assert steps["ldconfig"] == {"dac_override"}
    assert steps["done"] == set()
    assert "no_new_privs=1" in log


# run by the hook as its "ldconfig": reports what the exec'd program was given
PROBE_C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/capability.h>
extern char **environ;
int main(int argc, char **argv) {
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    int n = 0, fd;
    FILE *f;
    if (syscall(SYS_capget, &h, d) != 0) return 3;
    while (environ[n]) n++;
    printf("probe argv=%s,%s env=%d uid=%d eff=%x perm=%x inh=%x fds=", argv[0],
           argc > 1 ? argv[1] : "-", n, (int)getuid(), d[0].effective, d[0].permitted,
           d[0].inheritable);
    for (fd = 0; fd < 1024; fd++)
        if (fcntl(fd, F_GETFD) != -1) printf("%d,", fd);
    printf("\n");
    f = fopen("/probe-was-here", "w");  /* lands in the rootfs if chrooted there */
    if (f) fclose(f);
    return 0;
}
"""


def test_ldconfig_is_exec_d_alone_chrooted_with_dac_override_only(
        setup: Callable[..., tuple[Bundle, str]], tmp_path: Path) -> None:
    """The ldconfig child becomes the (static) ldconfig: nothing of the hook's survives the exec
    but stdio, the environment is empty, the only capability is CAP_DAC_OVERRIDE and
    its / is the rootfs."""
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("no gcc to build the static probe")
    (tmp_path / "probe.c").write_text(PROBE_C)
    probe = tmp_path / "probe"
    built = subprocess.run([gcc, "-static", "-O1", "-o", str(probe), str(tmp_path / "probe.c")],
                           capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"cannot link a static probe: {built.stderr[-300:]}")
    bundle, root = setup()
    plan_path = os.path.join(bundle.path, "nvctk-edits.json")
    d = json.loads(Path(plan_path).read_text())
    d["ldconfig"] = str(probe)
    Path(plan_path).write_text(json.dumps(d))
    with fake_container() as pid:
        r = run_hook(bundle, pid)
        assert r.returncode == 0, r.stderr
    lines = [ln for ln in bundle.log_text().splitlines() if "ldconfig: probe " in ln]
    assert len(lines) == 1, bundle.log_text()
    report = dict(kv.split("=", 1) for kv in lines[0].split("ldconfig: probe ", 1)[1].split())
    assert report["argv"] == f"ldconfig,{LIB}"
    assert report["env"] == "0" and report["uid"] == "0"
    dac_override = 1 << 1
    assert int(report["eff"], 16) == int(report["perm"], 16) == dac_override, report
    assert int(report["inh"], 16) == 0
    assert report["fds"] == "0,1,2,", report
    assert os.path.exists(os.path.join(root, "probe-was-here"))


# modules that cost a GPU container's start milliseconds each (typing ~20 ms, dataclasses
# ~27, json ~11, re ~8, tomllib ~28, subprocess ~25, ...) and that the hook has no need of
SLOW_MODULES = frozenset({
    "dataclasses", "typing", "re", "json", "tomllib", "tomli", "enum", "inspect", "subprocess",
    "tempfile", "pynvml", "collections", "functools", "signal", "traceback", "contextlib",
    "shutil", "hashlib", "pathlib", "datetime", "ast",
})


def _imports(importtime: str) -> list[tuple[int, str]]:
    """(depth, module) per line of -X importtime output, in its order (children first)."""
    out = []
    for line in importtime.splitlines():
        if line.startswith("import time:") and not line.endswith("| imported package"):
            field = line.rsplit("|", 1)[1]
            name = field.lstrip(" ")
            out.append(((len(field) - len(name) - 1) // 2, name))
    return out


def _importer_chain(imports: list[tuple[int, str]], i: int) -> list[str]:
    """The module imports[i] and what imported it, up to the top: a parent follows
    its children in importtime's output, one level shallower."""
    chain = [imports[i][1]]
    depth = imports[i][0]
    for d, name in imports[i + 1:]:
        if d < depth:
            chain.append(name)
            depth = d
    return chain


@pytest.mark.exclusive  # compares the host's whole mount table
def test_hook_imports_only_cheap_modules(setup: Callable[..., tuple[Bundle, str]],
                                         sim_host: SimHost, host_table: None) -> None:
    """The whole prestart path (state, plan, mounts, mask, ldconfig) run by the real
    executable under -X importtime imports none of the slow modules, nor the config."""
    bundle, root = setup()
    v = sim_host.topology.driver_version
    state = {"ociVersion": "1.0.2", "id": "c1", "status": "creating", "bundle": bundle.path}
    env = {"PATH": HOOK_PATH_ENV.split("=", 1)[1], "NVCTK_CONFIG": bundle.config,
           nvconfig.CACHE_VAR: os.environ[nvconfig.CACHE_VAR]}
    # settled, as a node's config is: the runtime's create has parsed and cached it
    with pytest.MonkeyPatch.context() as m:
        m.setattr(stamped, "RACY_NS", -(10**12))
        nvconfig.load(bundle.config)
    hook = Launchers(Path(bundle.path).parent / "launchers", ("-X", "importtime")).bin
    with fake_container() as pid:
        r = subprocess.run([str(hook / "nvctk-hook"), "prestart"],
                           input=json.dumps({**state, "pid": pid}), env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"{LIB}/libcuda.so.{v}" in mounts_under(pid, root)  # it did the work
    assert "ldconfig refreshed" in bundle.log_text()
    imports = _imports(r.stderr)
    names = {n for _, n in imports}
    assert "nvctk.hook.prestart" in names and "nvctk.hook.mount" in names, r.stderr[-3000:]
    # the log's file and level come in the plan: the hook reads no config
    assert "nvctk.base.config" not in names, r.stderr[-3000:]
    slow = [" <- ".join(_importer_chain(imports, i)) for i, (_, n) in enumerate(imports)
            if n.partition(".")[0] in SLOW_MODULES]
    assert not slow, "slow imports on the hook's path (module <- importer ...):\n" + \
        "\n".join(slow)


@pytest.mark.exclusive  # compares the host's whole mount table
@pytest.mark.parametrize(("lib", "cap"), [("libcuda", "compute"), ("libnvidia-ml", "utility")])
def test_missing_required_library_fails_naming_it(setup: Callable[..., tuple[Bundle, str]],
                                                  sim_host: SimHost, host_table: None,
                                                  lib: str, cap: str) -> None:
    bundle, root = setup()
    plan_path = os.path.join(bundle.path, "nvctk-edits.json")
    d = json.loads(Path(plan_path).read_text())
    for m in d["mounts"]:
        if os.path.basename(m["host_path"]).startswith(f"{lib}.so"):
            m["host_path"] = "/nonexistent/driver/" + os.path.basename(m["host_path"])
    Path(plan_path).write_text(json.dumps(d))
    with fake_container() as pid:
        r = run_hook(bundle, pid)
        assert r.returncode == 1
        assert r.stderr.startswith(f"nvctk-hook: prestart: step open: /nonexistent/driver/{lib}.so."), \
            r.stderr
        assert cap in r.stderr
        assert mounts_under(pid, root) == {}


def test_missing_optional_file_is_skipped(setup: Callable[..., tuple[Bundle, str]],
                                          tmp_path: Path) -> None:
    extra = Mount("/nonexistent/libnvidia-opencl.so.1", f"{LIB}/libnvidia-opencl.so.1")
    bundle, root = setup(extra=[extra])
    with fake_container() as pid:
        r = run_hook(bundle, pid)
        assert r.returncode == 0, r.stderr
        assert f"{LIB}/libnvidia-opencl.so.1" not in mounts_under(pid, root)
    assert "skip /usr/lib/x86_64-linux-gnu/libnvidia-opencl.so.1" in bundle.log_text()


@pytest.mark.exclusive  # compares the host's whole mount table
def test_failure_undoes_mounts(setup: Callable[..., tuple[Bundle, str]],
                               sim_host: SimHost, host_table: None) -> None:
    # the last mount's destination is a directory in the image: step mount fails there
    v = sim_host.topology.driver_version
    bad = Mount(os.path.join(sim_host.bin_dir, "nvidia-smi"), "/opt/blocked")
    bundle, root = setup(extra=[bad])
    os.makedirs(os.path.join(root, "opt/blocked"))
    with fake_container() as pid:
        r = run_hook(bundle, pid)
        assert r.returncode == 1
        assert r.stderr.startswith("nvctk-hook: prestart: step mount: /opt/blocked: ")
        assert mounts_under(pid, root) == {}
        assert not os.path.ismount(cpath(pid, root, f"{LIB}/libcuda.so.{v}"))
    assert "undid the mounts" in bundle.log_text()


def test_state_root_from_crun_and_relative_root(setup: Callable[..., tuple[Bundle, str]]
                                                ) -> None:
    bundle, root = setup()
    spec_path = os.path.join(bundle.path, "config.json")
    spec = json.loads(Path(spec_path).read_text())
    spec["root"]["path"] = "/nonexistent-rootfs"  # crun's state.root wins
    Path(spec_path).write_text(json.dumps(spec))
    with fake_container() as pid:
        r = run_hook(bundle, pid, state_extra={"root": root})
        assert r.returncode == 0, r.stderr
        assert mounts_under(pid, root)


@pytest.mark.exclusive  # compares the host's whole mount table
def test_refuses_the_host_mount_namespace(setup: Callable[..., tuple[Bundle, str]],
                                          host_table: None) -> None:
    bundle, _ = setup()
    r = run_hook(bundle, os.getpid())
    assert r.returncode == 1
    assert "shares the host's mount namespace" in r.stderr


def test_bad_state_is_a_clear_error(tmp_path: Path) -> None:
    r = subprocess.run([HOOK, "prestart"], input="{not json", capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", "NVCTK_CONFIG": str(tmp_path / "none")})
    assert r.returncode == 1
    assert r.stderr.startswith("nvctk-hook: prestart: hook state on stdin")


def test_poststop_bad_state_and_usage() -> None:
    # poststop itself is tested in test_vgpu_runtime_install.py
    r = subprocess.run([HOOK, "poststop"], input="{}", capture_output=True, text=True)
    assert r.returncode == 1 and r.stderr.startswith("nvctk-hook: poststop: hook state"), r.stderr
    r = subprocess.run([HOOK, "bogus"], capture_output=True, text=True)
    assert r.returncode == 2 and "unknown command" in r.stderr


def test_sanitize_environ() -> None:
    env = {"LD_PRELOAD": "/x.so", "LD_LIBRARY_PATH": "/y", "PYTHONPATH": "/z", "PATH": "/bin"}
    assert sorted(sanitize_environ(env)) == ["LD_LIBRARY_PATH", "LD_PRELOAD",
                                                     "PYTHONPATH"]
    assert env == {"PATH": "/bin"}


def test_elf_interpreter() -> None:
    ld = shutil.which("ldconfig", path="/sbin:/usr/sbin") or "/sbin/ldconfig"
    fd = os.open(ld, os.O_RDONLY)
    try:
        assert elf_interpreter(fd) is None  # Debian's ldconfig is static
    finally:
        os.close(fd)
    fd = os.open("/bin/ls", os.O_RDONLY)
    try:
        assert (elf_interpreter(fd) or "").startswith("/lib")
    finally:
        os.close(fd)


@pytest.mark.exclusive  # compares the host's whole mount table
def test_without_a_saved_plan_the_hook_decides_nothing(
        sim_host: SimHost, rootfs: Callable[..., str], tmp_path: Path, host_table: None) -> None:
    """A spec that names the hook but has no nvctk-edits.json (edited by hand, or a
    bundle reused for a no-GPU container): the hook never plans by itself; it mounts
    nothing and says so in nvctk's log."""
    root = rootfs()
    bundle = make_bundle(str(tmp_path / "bundle"), root, None, driver_root=sim_host.root,
                         spec_extra={"process": {"args": ["sh"], "cwd": "/", "env": [
                             "NVIDIA_VISIBLE_DEVICES=1"]}})
    with fake_container() as pid:
        r = run_hook(bundle, pid)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert mounts_under(pid, root) == {}
    assert (f"no nvctk-edits.json in {bundle.path}: nvctk-runtime made no plan for this "
            "container") in bundle.log_text()


@pytest.mark.parametrize("argv", [["prestart"], ["poststop"], ["cdi-edits", "--folder", "/lib"],
                                  ["create-symlinks", "--link", "a::/b"],
                                  ["update-ldcache", "--folder", "/lib"]])
def test_the_state_on_stdin_is_read_within_a_bound(argv: list[str]) -> None:
    """An endless stdin (/dev/zero) is refused past MAX_HOOK_STATE, a clear error, never read
    whole (it used to grow the hook to gigabytes in seconds)."""
    from nvctk.base.fileio import MAX_HOOK_STATE

    with open("/dev/zero", "rb") as zero:
        r = subprocess.run([HOOK, *argv], stdin=zero, capture_output=True, text=True,
                           timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"hook state on stdin: larger than {MAX_HOOK_STATE} bytes" in r.stderr, r.stderr
