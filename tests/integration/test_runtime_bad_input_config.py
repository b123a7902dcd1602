"""nvctk-runtime against bad input it reads at start: a broken, blocking or pathological
config, log files and driver files that are FIFOs or devices, an ldconfig that is a script.

Nothing that asks for no GPU is stopped or slowed by what nvctk cannot read, and nothing
nvctk reads at start can block it. The same suite's other parts:
test_runtime_bad_input_specs.py (odd specs, clear errors), test_runtime_bad_input_bundles.py
(reused bundles, misleading errors, ids), test_runtime_bad_input_parsers.py (property tests
of every parser of container input).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

import support.runtime as _runtime
from nvctk.base import config as nvconfig
from nvctk.base import fileio
from nvctk.base import log as nvlog
from nvctk.base.errors import ConfigError
from nvctk.edits_file import EDITS_FILE
from nvctk.runtime import create, passthrough
from nvctk.sim.host import SimHost
from support.bad_input import HUGE
from support.runtime import (
    NVD,
    RUNTIME,
    Env,
    assert_clean_failure,
    create_argv,
    path_with_fake_runc,
    snapshot,
)

env = _runtime.env  # fixtures

DEFAULT_RUNTIMES = nvconfig.Config().runtimes


# --- a broken config never stops or slows what asks for no GPU ------------------


@pytest.fixture
def path_runc(env: Env) -> dict[str, str]:
    """An environment whose PATH has a recording "runc": where a broken config makes
    nvctk fall back to its default runtimes, the fake one still runs."""
    return path_with_fake_runc(env)


def run_rt(argv: list[str], environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([RUNTIME, *argv], env=environ, capture_output=True, text=True,
                          timeout=20)


def test_config_not_utf8(env: Env, bundle: Callable[..., Path], path_runc: dict[str, str],
                         run_nvctk: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    env.config.write_bytes(env.config.read_bytes() + b"# \xff\xfe not UTF-8\n")
    b = bundle({})
    argv = create_argv(env, b)
    r = run_rt(argv, path_runc)
    assert r.returncode == 0, r.stderr
    assert env.recorded() == argv  # the runtimes line of the broken file was still read
    env.record.unlink()
    state = ["--root", str(env.tmp / "r"), "state", "x"]
    r = run_rt(state, path_runc)
    assert r.returncode == 0 and r.stderr == "" and env.recorded() == state
    env.record.unlink()
    g = bundle({NVD: "0"}, name="gpu")
    before = snapshot(g / "config.json")
    r = run_rt(create_argv(env, g), path_runc)
    assert_clean_failure(env, r, f"{env.config}: not UTF-8 (invalid byte at offset")
    assert snapshot(g / "config.json") == before
    for args in (["config", "show"], ["info"]):
        r = run_nvctk(*args, config=str(env.config))
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.startswith(f"nvctk: {env.config}: not UTF-8"), r.stderr


def test_config_fifo_blocks_nothing(env: Env, bundle: Callable[..., Path],
                                    path_runc: dict[str, str],
                                    run_nvctk: Callable[..., subprocess.CompletedProcess[str]]
                                    ) -> None:
    env.config.unlink()
    os.mkfifo(env.config)
    state = ["--root", str(env.tmp / "r"), "state", "x"]
    for argv in (state, ["--root", str(env.tmp / "r"), "list"],
                 ["--root", str(env.tmp / "r"), "kill", "x", "KILL"]):
        r = run_rt(argv, path_runc)  # timeout=20 would raise on a hang
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert env.recorded() == argv
    b = bundle({})
    argv = create_argv(env, b)
    r = run_rt(argv, path_runc)
    assert r.returncode == 0, r.stderr
    assert env.recorded() == argv
    env.record.unlink()
    g = bundle({NVD: "0"}, name="gpu")
    r = run_rt(create_argv(env, g), path_runc)
    assert_clean_failure(env, r, f"{env.config}: cannot read: not a regular file")
    r = run_nvctk("config", "show", config=str(env.config))
    assert r.returncode == 1 and "not a regular file" in r.stderr


def test_log_file_fifo_blocks_no_gpu_create(env: Env, bundle: Callable[..., Path]) -> None:
    fifo = env.tmp / "log.fifo"
    os.mkfifo(fifo)
    text = re.sub(r'(?m)^log-file = .*$', f'log-file = "{fifo}"', env.config.read_text())
    env.config.write_text(text + ("" if "log-file" in text else f'log-file = "{fifo}"\n'))
    b = bundle({NVD: "0"})
    argv = create_argv(env, b)
    r = env.run(*argv)  # env.run's timeout=60 raises on a hang
    assert r.returncode == 0, r.stderr
    assert env.recorded() == argv
    assert (b / EDITS_FILE).exists()


@pytest.mark.parametrize(("line", "needle"), [
    ("hook-timeout = 1000000000000", "hook-timeout must be an integer from 1 to 86400"),
    ("hook-timeout = " + HUGE, "malformed TOML: Exceeds the limit (4300 digits)"),
    ('ldconfig = "sbin/ldconfig"', "ldconfig must be an absolute path"),
    ('state-dir = "run/nvctk"', "state-dir must be an absolute path"),
    ('log-file = "nvctk.log"', "log-file must be an absolute path or empty"),
    ('hook-path = "/usr/bin/nvctk\\u0000hook"', "hook-path must not contain a NUL"),
    ("runtimes = []", "runtimes must name at least one runtime"),
    ('extra-mounts = [{host-path = "/a", container-path = "/b", read-only = "false"}]',
     "read-only must be true or false"),
    ("x = " + "[" * 3000 + "]" * 3000, "malformed TOML"),
])
def test_config_values_are_validated(env: Env, bundle: Callable[..., Path],
                                     path_runc: dict[str, str], line: str, needle: str) -> None:
    key = line.split(" ", 1)[0]
    text = re.sub(rf"(?m)^{re.escape(key)} = .*\n", "", env.config.read_text())
    env.config.write_text(text + line + "\n")
    with pytest.raises(ConfigError, match=re.escape(needle)) as exc:
        nvconfig.load(str(env.config))
    assert str(env.config) in str(exc.value) and len(str(exc.value)) < 400
    b = bundle({})
    argv = create_argv(env, b)
    r = run_rt(argv, path_runc)  # no GPU: runs whatever the config holds
    assert r.returncode == 0, r.stderr
    env.record.unlink()
    g = bundle({NVD: "0"}, name="gpu")
    assert_clean_failure(env, run_rt(create_argv(env, g), path_runc), needle)


# each took tomllib seconds (quadratic in a key's dotted parts), on every passthrough
# and on every no-GPU create, before config._bounds
PATHOLOGICAL = [
    ('s = """x"""\n' + ".".join(["a"] * 30000) + " = 1\n", "line 2 is longer than 8192 bytes"),
    (".".join(["a"] * 6000) + " = 1\n", "line 1 is longer than 8192 bytes"),
    ("[" + ".".join(["a"] * 3000) + "]\n", "more than 1024 '.' characters"),
    ('s = """x"""\n' + '"a".' * 300 + "b = 1\n", "unknown key"),
    ("x = {" + ".".join(["a"] * 4000) + " = 1}\n", "more than 1024 '.' characters"),
    ("# " + "x" * 70000 + "\n", "larger than 65536 bytes (a real nvctk config is under 4 KiB)"),
    ('runtimes = ["crun"]\nruntimes = ["runc"]\n', "malformed TOML: Cannot overwrite a value (at line 2"),
    ("a.b\n" * 2000, "more than 1024 '.' characters"),
    ("x = [" + '"",' * 2000 + "]\n", "unknown key"),
]


@pytest.mark.parametrize(("text", "needle"), PATHOLOGICAL, ids=range(len(PATHOLOGICAL)))
def test_pathological_config_slows_nothing_that_asks_for_no_gpu(
        env: Env, bundle: Callable[..., Path], path_runc: dict[str, str], text: str,
        needle: str) -> None:
    """Refused by linear checks before the TOML parse: passthrough and no-GPU
    creates run the default runtimes at once (with a warning), a GPU create fails
    naming the file and the line."""
    env.config.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(needle)) as exc:
        nvconfig.load(str(env.config))
    assert str(exc.value).startswith(f"{env.config}: ")
    assert passthrough.runtimes({"NVCTK_CONFIG": str(env.config)})[0] == DEFAULT_RUNTIMES
    root = str(env.tmp / "r")
    b = bundle({})
    for argv in (["--root", root, "state", "x"], ["--root", root, "list"],
                 ["--root", root, "kill", "x", "KILL"], create_argv(env, b)):
        # the linear check above refused the file before any parse (it took tomllib
        # seconds to minutes); the runtime's cost per start is bench/'s
        r = run_rt(argv, path_runc)
        assert r.returncode == 0, r.stderr
        assert env.recorded() == argv
        env.record.unlink()
    g = bundle({NVD: "0"}, name="gpu")
    assert_clean_failure(env, run_rt(create_argv(env, g), path_runc), needle)


def test_read_regular_file_refuses_fifo_and_devices(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for p in (str(fifo), "/dev/zero", str(tmp_path)):
        with pytest.raises(fileio.NotRegularFile):
            fileio.read_regular_file(p)
    big = tmp_path / "big"
    big.write_bytes(b"#" * 100)
    with pytest.raises(OSError, match="larger than 10 bytes"):
        fileio.read_regular_file(str(big), 10)
    runtimes, warning = passthrough.runtimes({"NVCTK_CONFIG": str(fifo)})
    assert runtimes == DEFAULT_RUNTIMES and warning and "not a regular file" in warning
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'runtimes = ["/opt/\xffrunc"]\n# \xfe\n')
    runtimes, warning = passthrough.runtimes({"NVCTK_CONFIG": str(bad)})
    assert runtimes == DEFAULT_RUNTIMES and warning and "not UTF-8" in warning
    bad.write_text("runtimes = []\n")  # invalid: the defaults, with config.parse's word
    runtimes, warning = passthrough.runtimes({"NVCTK_CONFIG": str(bad)})
    assert runtimes == DEFAULT_RUNTIMES and warning and "at least one" in warning


def test_logs_never_block_and_own_log_is_regular_only(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    logger = nvlog.Logger(str(fifo), "debug")
    logger.error("no reader: ENXIO, not a wait")  # would hang with a blocking open
    assert logger.fd == -1
    assert not nvlog.write_runc_log(str(fifo), "no reader")
    # The test's own reader holds the FIFO open read-write (Linux: never blocks): a reader
    # stays while the logs write, and no writer's close ends it with an early EOF. (A reader
    # thread saw EOF as soon as write_runc_log closed, and left: the next O_WRONLY open
    # then failed with ENXIO, and "never into a FIFO" was tested with no reader at all.)
    rfd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    try:
        # runc's --log may be a FIFO an engine reads: written, without blocking
        assert nvlog.write_runc_log(str(fifo), "to the reader")
        logger.error("never into a FIFO")  # nvctk's own log: regular files only
        assert logger.fd == -1
        got = os.read(rfd, 1 << 16)
    finally:
        os.close(rfd)
    assert b"to the reader" in got and b"never" not in got


# --- nothing read at start may block --------------------------------------


def test_ldconfig_fifo_fails_at_once_naming_the_setting(
        sim_host: SimHost, rootfs: Callable[..., str], tmp_path: Path) -> None:
    from support.canary.harness import fake_container, make_bundle, make_plan, run_hook

    root = rootfs()
    os.makedirs(os.path.join(root, "proc/driver/nvidia"))
    b = make_bundle(str(tmp_path / "bundle"), root, make_plan(sim_host))
    fifo = tmp_path / "ldconfig-fifo"
    os.mkfifo(fifo)
    plan_path = os.path.join(b.path, EDITS_FILE)
    d = json.loads(Path(plan_path).read_text())
    d["ldconfig"] = str(fifo)
    Path(plan_path).write_text(json.dumps(d))
    with fake_container() as pid:
        r = run_hook(b, pid, timeout=20)  # blocked in open() until its 60 s timeout before
    assert r.returncode != 0
    assert f"{fifo} (nvctk's ldconfig setting): not a regular file" in r.stderr, r.stderr


@pytest.mark.parametrize("beside", [True, False], ids=["ldconfig.real-beside", "alone"])
def test_ldconfig_script_is_followed_to_ldconfig_real(
        sim_host: SimHost, rootfs: Callable[..., str], tmp_path: Path, beside: bool) -> None:
    """Ubuntu's /sbin/ldconfig is a shell script around /sbin/ldconfig.real (seen on a GPU
    host: every GPU start failed with 'not a 64-bit ELF file'); the binary beside a script
    is the one run. A script with nothing beside it is still refused, naming the setting."""
    from support.canary.harness import fake_container, make_bundle, make_plan, run_hook

    root = rootfs()
    b = make_bundle(str(tmp_path / "bundle"), root, make_plan(sim_host))
    script = tmp_path / "sbin" / "ldconfig"
    script.parent.mkdir()
    script.write_text('#!/bin/sh\nexec /sbin/ldconfig.real "$@"\n')
    script.chmod(0o755)
    if beside:
        shutil.copy2("/sbin/ldconfig", str(script) + ".real")
    plan_path = os.path.join(b.path, EDITS_FILE)
    d = json.loads(Path(plan_path).read_text())
    d["ldconfig"] = str(script)
    Path(plan_path).write_text(json.dumps(d))
    cache = Path(root, "etc/ld.so.cache")
    cache.unlink(missing_ok=True)
    with fake_container() as pid:
        r = run_hook(b, pid, timeout=20)
    if beside:
        assert r.returncode == 0, r.stderr
        assert cache.is_file()  # ldconfig.real wrote the container's cache
    else:
        assert r.returncode != 0
        assert f"{script} (nvctk's ldconfig setting): not a 64-bit ELF file" in r.stderr, r.stderr


@pytest.mark.parametrize("rel", ["proc/driver/nvidia/version", "etc/ld.so.cache"])
def test_driver_file_fifo_hangs_no_gpu_create(env: Env, bundle: Callable[..., Path],
                                             tmp_path: Path, rel: str) -> None:
    """A FIFO at a driver file nvctk reads: a GPU create goes on or fails, never waits."""
    from nvctk.sim import host as simhost
    from nvctk.sim.topology import make_topology

    sim = simhost.init(str(tmp_path / "fifo-host"), make_topology(gpus=1))  # nothing cached
    os.unlink(Path(sim.root, rel))
    os.mkfifo(Path(sim.root, rel))
    cfg = tmp_path / "fifo-config.toml"
    cfg.write_text(re.sub(r"(?m)^runtimes = .*$", f'runtimes = ["{env.fake}"]',
                          Path(sim.config_path).read_text()))
    b = bundle({NVD: "0"})
    r = env.run(*create_argv(env, b), config=str(cfg), timeout=20)  # a wait: TimeoutExpired
    assert "Traceback" not in r.stderr and create.INTERNAL_ERROR not in r.stderr, r.stderr
    if r.returncode != 0:
        assert rel.split("/")[-1] in r.stderr and "not a regular file" in r.stderr, r.stderr


# --- messages that say what is wrong --------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_vgpu_library_not_a_regular_file(env: Env, bundle: Callable[..., Path], tmp_path: Path,
                                         kind: str) -> None:
    lib = tmp_path / "lib-fifo"
    if kind == "fifo":
        os.mkfifo(lib)
    target = str(lib) if kind == "fifo" else "/dev/zero"
    cfg = tmp_path / "vl-config.toml"
    cfg.write_text(re.sub(r'(?m)^vgpu-library = .*$', f'vgpu-library = "{target}"',
                          env.config.read_text()))
    b = bundle({NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT": "512m"})
    r = env.run(*create_argv(env, b), config=str(cfg))
    assert_clean_failure(env, r, f"vgpu-library {target}: not a regular file")
