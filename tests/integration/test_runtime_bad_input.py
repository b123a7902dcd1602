"""nvctk-runtime against bad input: a broken or blocking config, odd specs, reused bundles.

Every input gets a defined result or one clear message naming the culprit, in
runc's --log; nothing that asks for no GPU is stopped or slowed by what nvctk
cannot read; nothing nvctk reads at start can block it. Property tests feed
arbitrary text to every parser of container input; the end-to-end tests drive
the real `nvctk-runtime` (a recording fake runc, and the real runc where the
promise is about runc).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import support.runtime as _runtime
from nvctk.base import config as nvconfig
from nvctk.base import fileio
from nvctk.base import log as nvlog
from nvctk.base.errors import ConfigError, NvctkError, RequestError, SpecError, UnknownDeviceError
from nvctk.edits import DeviceNode, Hook
from nvctk.edits_file import EDITS_FILE
from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo
from nvctk.host.select import resolve_device
from nvctk.oci import runc_argv
from nvctk.oci import spec as oci
from nvctk.request import requirements
from nvctk.request.parse import request_from_spec
from nvctk.runtime import create, passthrough
from nvctk.sim.host import SimHost
from nvctk.spec import apply as spec_edits
from nvctk.spec.record import read_record
from nvctk.vgpu import limits as vgpu
from support.records import undo_as_create
from support.runtime import (
    NVD,
    RUNTIME,
    Env,
    assert_clean_failure,
    assert_passed_through,
    bundle_maker,
    create_argv,
    path_with_fake_runc,
    runc_log_errors,
    snapshot,
)

env = _runtime.env  # fixtures

DEFAULT_RUNTIMES = nvconfig.Config().runtimes
HUGE = "1" * 5000  # past int()'s 4300-digit limit
ARABIC_ZERO = "\u0660"
SUPERSCRIPT_TWO = "\u00b2"


@pytest.fixture
def bundle(tmp_path: Path, rootfs: Callable[..., str]) -> Callable[..., Path]:
    return bundle_maker(tmp_path, rootfs, ["sh", "-c", "echo container-ran"])


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


# --- specs runc runs go through when no GPU is asked for --------------------------


def _deep(spec: dict[str, Any]) -> None:
    spec["x-deep"] = "DEEP"


def _write_deep(b: Path) -> None:
    text = (b / "config.json").read_text()
    (b / "config.json").write_text(text.replace('"DEEP"', "[" * 3000 + "]" * 3000))


def _write_bad_utf8(b: Path) -> None:
    text = (b / "config.json").read_bytes()
    (b / "config.json").write_bytes(text.replace(b"BADBYTES", b"a\xff\xfeb"))


def _bad_annotation(spec: dict[str, Any]) -> None:
    spec["annotations"] = {"org.example.bytes": "BADBYTES"}


@pytest.mark.parametrize("kind", ["deep", "utf8"])
def test_unreadable_non_gpu_spec_goes_to_runc_untouched(
        env: Env, bundle: Callable[..., Path], kind: str) -> None:
    b = bundle({}, edit=_deep if kind == "deep" else _bad_annotation)
    (_write_deep if kind == "deep" else _write_bad_utf8)(b)
    assert_passed_through(env, b)


@pytest.mark.parametrize(("kind", "needle"), [
    ("deep", "nested too deeply"), ("utf8", "not UTF-8 (invalid byte at offset")])
def test_unreadable_gpu_spec_fails_clearly(env: Env, bundle: Callable[..., Path], kind: str,
                                           needle: str) -> None:
    b = bundle({NVD: "0"}, edit=_deep if kind == "deep" else _bad_annotation)
    (_write_deep if kind == "deep" else _write_bad_utf8)(b)
    before = snapshot(b / "config.json")
    r = env.run(*create_argv(env, b))
    assert_clean_failure(env, r, needle)
    assert snapshot(b / "config.json") == before


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("root", [], "root must be a JSON object"),
    ("mounts", {}, "mounts must be a JSON list"),
])
def test_gpu_spec_of_the_wrong_shape_names_the_field(env: Env, bundle: Callable[..., Path],
                                                     field: str, value: Any,
                                                     needle: str) -> None:
    """Valid JSON with a field of the wrong type: the message says so (nvctk did read
    it), not that nvctk could not tell without reading it."""
    b = bundle({NVD: "0"}, edit=lambda spec: spec.__setitem__(field, value))
    before = snapshot(b / "config.json")
    r = env.run(*create_argv(env, b))
    assert_clean_failure(env, r, needle)
    assert "cannot tell without reading" not in r.stderr + "".join(runc_log_errors(env))
    assert snapshot(b / "config.json") == before


def test_cuda_version_of_bytes_that_are_not_utf8(env: Env, bundle: Callable[..., Path]) -> None:
    """A legacy image whose CUDA_VERSION is not UTF-8: the message says the spec is not
    UTF-8 (not that the version '\ufffd\ufffd' is malformed)."""
    b = bundle({"CUDA_VERSION": "BADBYTES"})
    _write_bad_utf8(b)
    before = snapshot(b / "config.json")
    r = env.run(*create_argv(env, b))
    assert_clean_failure(env, r, "not UTF-8")
    assert "\ufffd" not in r.stderr
    assert snapshot(b / "config.json") == before


def test_gpu_marker_sees_through_json_escapes() -> None:
    assert oci.gpu_marker(b'{"env":["NVIDIA\\u005fVISIBLE_DEVICES=0"]') == "NVIDIA_VISIBLE_DEVICES"
    assert oci.gpu_marker(b'{"env":["CUDA_VERSION=12.4"], [[[') == "CUDA_VERSION"
    assert oci.gpu_marker(b'{"mounts":[{"destination":"/var/run/nvidia-container-devices/0"'
                          ) == "nvidia-container-devices"
    assert oci.gpu_marker(b'{"env":["PATH=/bin\\u00e9"], "x": [[[[') is None


# --- the real runc: non-GPU oddities run, GPU errors land in its --log ------------------------


@pytest.fixture
def real_runc(tmp_path: Path, sim_host: SimHost) -> Iterator[Callable[..., subprocess.CompletedProcess[str]]]:
    if shutil.which("runc") is None:
        pytest.skip("needs runc")
    root = tmp_path / "runc-root"
    ids: list[str] = []

    def run(b: Path, cid: str, config: str | None = None, timeout: float = 120
            ) -> subprocess.CompletedProcess[str]:
        ids.append(cid)
        return subprocess.run(
            [RUNTIME, "--root", str(root), "--log", str(b / "runc-log.json"), "--log-format",
             "json", "run", "--bundle", str(b), cid],
            env={**os.environ, "NVCTK_CONFIG": config or sim_host.config_path},
            capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)

    yield run
    for cid in ids:
        subprocess.run(["runc", "--root", str(root), "delete", "--force", cid],
                       capture_output=True, timeout=60)


def test_real_runc_gpu_container_with_fifo_log_file(
        tmp_path: Path, sim_host: SimHost, bundle: Callable[..., Path],
        real_runc: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    """Neither the runtime nor the prestart hook waits for a reader of a FIFO log-file."""
    fifo = tmp_path / "log.fifo"
    os.mkfifo(fifo)
    text = re.sub(r"(?m)^(log-file|hook-timeout) = .*\n", "", Path(sim_host.config_path).read_text())
    config = tmp_path / "fifo-log.toml"
    config.write_text(text + f'log-file = "{fifo}"\nhook-timeout = 30\n')
    b = bundle({NVD: "0"})
    # a wait for the FIFO's reader would run into the timeout (TimeoutExpired)
    r = real_runc(b, "nvctk-hostile-fifo-log", str(config), timeout=20)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "container-ran"


@pytest.mark.parametrize("kind", ["deep", "utf8"])
def test_real_runc_runs_unreadable_non_gpu_specs(
        bundle: Callable[..., Path], real_runc: Callable[..., subprocess.CompletedProcess[str]],
        kind: str) -> None:
    b = bundle({}, edit=_deep if kind == "deep" else _bad_annotation)
    (_write_deep if kind == "deep" else _write_bad_utf8)(b)
    before = (b / "config.json").read_bytes()
    r = real_runc(b, f"nvctk-hostile-{kind}")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "container-ran"
    assert (b / "config.json").read_bytes() == before


def test_real_runc_gets_the_error_in_its_log(
        bundle: Callable[..., Path], real_runc: Callable[..., subprocess.CompletedProcess[str]]
        ) -> None:
    b = bundle({NVD: SUPERSCRIPT_TWO})
    r = real_runc(b, "nvctk-hostile-sup2")
    assert r.returncode == 1 and r.stdout == ""
    msgs = [json.loads(x) for x in (b / "runc-log.json").read_text().splitlines()]
    assert msgs[-1]["level"] == "error"
    assert msgs[-1]["msg"] == (f"nvctk: unknown device '{SUPERSCRIPT_TWO}' in {NVD} (this host "
                               "has GPUs " + msgs[-1]["msg"].split("has GPUs ", 1)[1])


# --- clear errors, never a traceback ----------------------------------------------


def _annotate(value: str) -> Callable[[dict[str, Any]], None]:
    def edit(spec: dict[str, Any]) -> None:
        spec["annotations"] = {"org.example.k": value}
    return edit


def _root_nul(spec: dict[str, Any]) -> None:
    spec["root"]["path"] = "rootfs\u0000x"


HOSTILE: list[tuple[str, dict[str, str], Callable[[dict[str, Any]], None] | None, str]] = [
    ("superscript", {NVD: SUPERSCRIPT_TWO}, None, f"unknown device '{SUPERSCRIPT_TWO}'"),
    ("arabic-zero", {NVD: ARABIC_ZERO}, None, f"unknown device '{ARABIC_ZERO}'"),
    ("arabic-bus", {NVD: "00000000:" + ARABIC_ZERO + "1:00.0"}, None, "unknown device"),
    ("huge-index", {NVD: HUGE}, None, "unknown device '1111"),
    ("mig-arabic", {NVD: "0:" + ARABIC_ZERO}, None, f"unknown device '0:{ARABIC_ZERO}'"),
    ("mig-huge", {NVD: HUGE + ":" + HUGE}, None, "unknown device '1111"),
    ("require-huge", {NVD: "0", "NVIDIA_REQUIRE_CUDA": "cuda>=" + HUGE},
     None, "unmet requirement 'cuda>=1111"),
    ("require-huge-met", {NVD: "0", "NVIDIA_REQUIRE_CUDA": "cuda<" + HUGE + " cuda>99"},
     None, "OK"),
    ("cuda-version-huge", {"CUDA_VERSION": HUGE}, None, "unmet requirement 'cuda>=1111"),
    ("cuda-version-sup", {"CUDA_VERSION": SUPERSCRIPT_TWO}, None,
     f"CUDA_VERSION='{SUPERSCRIPT_TWO}' is not a version"),
    ("env-surrogate", {NVD: "0", "FOO": "a\ud800b"}, None,
     "(FOO) holds a lone UTF-16 surrogate escape"),
    ("nvd-surrogate", {NVD: "0,\udfff"}, None,
     f"({NVD}) holds a lone UTF-16 surrogate escape"),
    ("annotation-surrogate", {NVD: "0"}, _annotate("\ud800"),
     "annotations['org.example.k'] holds a lone UTF-16 surrogate escape"),
    ("root-nul", {NVD: "0"}, _root_nul, "root.path holds a NUL character"),
    ("mem-huge", {NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT": HUGE}, None,
     "CUDA_DEVICE_MEMORY_LIMIT='1111"),
    ("mem-index-huge", {NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT_" + HUGE: "1g"}, None,
     "not CUDA_DEVICE_MEMORY_LIMIT or CUDA_DEVICE_MEMORY_LIMIT_<index>"),
    ("sm-arabic", {NVD: "0", "CUDA_DEVICE_SM_LIMIT": "5" + ARABIC_ZERO}, None,
     "not a percentage 0-100"),
    ("caps-control", {NVD: "0", "NVIDIA_DRIVER_CAPABILITIES": "compute,\x01\x7f"}, None,
     "unknown driver capability '\\x01\\x7f'"),
]


@pytest.mark.parametrize(("envvars", "edit", "needle"), [h[1:] for h in HOSTILE],
                         ids=[h[0] for h in HOSTILE])
def test_hostile_gpu_input_gets_one_clear_line(
        env: Env, bundle: Callable[..., Path], envvars: dict[str, str],
        edit: Callable[[dict[str, Any]], None] | None, needle: str) -> None:
    b = bundle(envvars, edit=edit)
    before = snapshot(b / "config.json")
    argv = create_argv(env, b)
    r = env.run(*argv)
    if needle == "OK":
        assert r.returncode == 0, r.stderr
        assert env.recorded() == argv
        return
    assert_clean_failure(env, r, needle)
    assert snapshot(b / "config.json") == before
    assert not (b / EDITS_FILE).exists()
    assert max(len(m) for m in runc_log_errors(env)) < 1000  # cut, not 5000 digits


def test_create_main_maps_any_bug_to_one_line(env: Env, bundle: Callable[..., Path],
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    b = bundle({})
    monkeypatch.setenv("NVCTK_CONFIG", str(env.config))

    def boom(*args: object, **kwargs: object) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(create, "prepare_bundle", boom)
    args = runc_argv.parse(create_argv(env, b))
    assert create.create_main(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("nvctk-runtime: internal error: KeyError: 'boom'") and err[-1] == "\n"
    assert runc_log_errors(env)[-1].startswith("nvctk: internal error: KeyError")
    own_log = Path(env.sim.root, "nvctk.log").read_text()
    assert "Traceback" in own_log and "boom" in own_log
    assert env.recorded() is None

    from nvctk.cli import runtime as launcher

    def crash(_args: object) -> int:
        raise RuntimeError("crash")

    monkeypatch.setattr(create, "create_main", crash)
    assert launcher.main(create_argv(env, b)) == 1
    assert "internal error: RuntimeError: crash" in runc_log_errors(env)[-1]


# --- a reused bundle ----------------------------------------------------------------


def _set_env(b: Path, name: str, value: str | None) -> None:
    spec = json.loads((b / "config.json").read_text())
    envs = [e for e in spec["process"]["env"] if not e.startswith(name + "=")]
    if value is not None:
        envs.append(f"{name}={value}")
    spec["process"]["env"] = envs
    (b / "config.json").write_text(json.dumps(spec))


def _nvidia_paths(spec: dict[str, Any]) -> list[str]:
    return [d["path"] for d in spec["linux"].get("devices") or []]


def test_reused_bundle_gets_only_the_current_request(env: Env, bundle: Callable[..., Path]
                                                     ) -> None:
    b = bundle({NVD: "0,1", "CUDA_DEVICE_MEMORY_LIMIT": "1g"})
    original = json.loads((b / "config.json").read_text())
    argv = create_argv(env, b)
    assert env.run(*argv).returncode == 0
    spec = json.loads((b / "config.json").read_text())
    assert "/dev/nvidia0" in _nvidia_paths(spec) and "/dev/nvidia1" in _nvidia_paths(spec)
    assert [h["args"][1] for h in spec["hooks"]["poststop"]] == ["poststop"]
    numbers = {d["path"]: (d["major"], d["minor"]) for d in spec["linux"]["devices"]}

    _set_env(b, NVD, "1")  # another GPU, no longer a vGPU limit
    _set_env(b, "CUDA_DEVICE_MEMORY_LIMIT", None)
    r = env.run(*create_argv(env, b, "c2"))
    assert r.returncode == 0, r.stderr
    spec = json.loads((b / "config.json").read_text())
    assert "/dev/nvidia0" not in _nvidia_paths(spec) and "/dev/nvidia1" in _nvidia_paths(spec)
    allowed = {(r["major"], r["minor"]) for r in spec["linux"]["resources"]["devices"]
               if r.get("allow")}
    assert numbers["/dev/nvidia0"] not in allowed and numbers["/dev/nvidia1"] in allowed
    assert [h["args"][:2] for h in spec["hooks"]["prestart"]] == [["nvctk-hook", "prestart"]]
    assert spec["hooks"].get("poststop") == []
    assert not any(e.startswith("CUDA_DEVICE_MEMORY_SHARED_CACHE=") for e in spec["process"]["env"])

    _set_env(b, NVD, "void")
    r = env.run(*create_argv(env, b, "c3"))
    assert r.returncode == 0, r.stderr
    spec = json.loads((b / "config.json").read_text())
    assert not (b / EDITS_FILE).exists()
    assert spec_edits.EDITS_ANNOTATION not in (spec.get("annotations") or {})
    assert spec["hooks"] == {"prestart": [], "poststop": []}
    assert _nvidia_paths(spec) == _nvidia_paths(original)
    assert spec["linux"]["resources"] == original["linux"]["resources"]
    # and once clean, a no-GPU create does not touch the file again
    before = snapshot(b / "config.json")
    assert env.run(*create_argv(env, b, "c4")).returncode == 0
    assert snapshot(b / "config.json") == before


def test_a_user_rule_that_equals_ours_stays(env: Env, bundle: Callable[..., Path]) -> None:
    own = {"allow": True, "type": "c", "major": 195, "minor": 255, "access": "rwm"}

    def edit(spec: dict[str, Any]) -> None:
        spec["linux"]["resources"]["devices"].append(own)

    b = bundle({NVD: "0"}, edit=edit)
    assert env.run(*create_argv(env, b)).returncode == 0
    _set_env(b, NVD, "void")
    assert env.run(*create_argv(env, b)).returncode == 0
    spec = json.loads((b / "config.json").read_text())
    assert own in spec["linux"]["resources"]["devices"]


def test_a_user_device_that_equals_ours_stays(env: Env, bundle: Callable[..., Path]) -> None:
    """A linux.devices entry the user had before the first GPU create, identical to the
    one nvctk would add, is the user's: a later create without GPU leaves it."""
    first = bundle({NVD: "0"}, name="first")
    assert env.run(*create_argv(env, first)).returncode == 0
    ours = [d for d in json.loads((first / "config.json").read_text())["linux"]["devices"]
            if d["path"] == "/dev/nvidiactl"]
    assert len(ours) == 1

    def edit(spec: dict[str, Any]) -> None:
        spec["linux"].setdefault("devices", []).append(dict(ours[0]))

    b = bundle({NVD: "0"}, edit=edit)
    assert env.run(*create_argv(env, b)).returncode == 0
    _set_env(b, NVD, "void")
    assert env.run(*create_argv(env, b)).returncode == 0
    devices = json.loads((b / "config.json").read_text())["linux"]["devices"]
    assert [d for d in devices if d["path"].startswith("/dev/nvidia")] == ours


def test_edit_record_can_only_take_nvidia_access_away() -> None:
    deny = {"allow": False, "access": "rwm"}
    spec: dict[str, Any] = {
        "process": {"env": ["LD_PRELOAD=/x.so", "CUDA_DEVICE_X=1"]},
        "linux": {"devices": [{"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}],
                  "resources": {"devices": [deny]}},
        "annotations": {spec_edits.EDITS_ANNOTATION: json.dumps({
            "devices": [["/dev/fuse", "c", 10, 229]], "rules": [[None, None, None]],
            "env": ["LD_PRELOAD=/x.so", "CUDA_DEVICE_X=1"]})},
    }
    undo_as_create(spec, "/", None)
    assert spec["linux"]["devices"][0]["path"] == "/dev/fuse"
    assert spec["linux"]["resources"]["devices"] == [deny]
    # a record without nvctk's MAC takes no variable out (only what nvctk
    # provably added goes, but for NVIDIA nodes and rules, whose removal only takes access)
    assert spec["process"]["env"] == ["LD_PRELOAD=/x.so", "CUDA_DEVICE_X=1"]


def test_real_runc_runs_a_vgpu_bundle_reused_as_void(
        bundle: Callable[..., Path], real_runc: Callable[..., subprocess.CompletedProcess[str]]
        ) -> None:
    b = bundle({NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT": "1g"})
    r = real_runc(b, "nvctk-hostile-vgpu")
    assert r.returncode == 0, r.stderr
    assert (b / EDITS_FILE).exists()
    _set_env(b, NVD, "void")
    spec = json.loads((b / "config.json").read_text())
    spec["process"]["args"] = ["sh", "-c", "ls /dev | grep -c nvidia; cat /etc/ld.so.preload"]
    (b / "config.json").write_text(json.dumps(spec))
    r = real_runc(b, "nvctk-hostile-void")
    assert r.returncode == 1 or r.returncode == 0, r.stderr  # cat fails: no preload file
    assert r.stdout.split()[0] == "0", r.stdout  # no NVIDIA device nodes
    assert "libvgpu" not in r.stdout
    assert not (b / EDITS_FILE).exists()


@pytest.mark.parametrize("unparsable", [False, True], ids=["not-utf8", "unparsable"])
def test_real_runc_runs_a_vgpu_bundle_reused_unreadable_without_gpu(
        bundle: Callable[..., Path], real_runc: Callable[..., subprocess.CompletedProcess[str]],
        unparsable: bool) -> None:
    """Hostile retest: the vGPU create's hooks stay in a spec nvctk cannot read
    (it will not rewrite it); its plan goes, and the hooks, reading the spec as runc
    does (U+FFFD) or not at all, find no plan: the no-GPU container runs."""
    b = bundle({NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT": "1g"})
    r = real_runc(b, "nvctk-hostile-vgpu2")
    assert r.returncode == 0, r.stderr
    assert (b / EDITS_FILE).exists()
    spec = json.loads((b / "config.json").read_text())
    spec["process"]["env"] = [e for e in spec["process"]["env"]
                              if not e.startswith((f"{NVD}=", "CUDA_DEVICE_MEMORY_LIMIT="))]
    # (its linux.devices entries stay: nvctk does not rewrite bytes it cannot read)
    spec["process"]["args"] = ["sh", "-c", "echo no-gpu-ran; echo \"preload:$(cat /etc/ld.so.preload "
                               "2>/dev/null)\""]
    spec["annotations"] = {**spec.get("annotations", {}), "x": "MARK"}
    data = json.dumps(spec).encode().replace(b"MARK", b"\xff")
    if unparsable:  # nested deeper than Python's JSON parser goes; Go's reads it
        data = data[:-1] + b', "y": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    (b / "config.json").write_bytes(data)
    r = real_runc(b, "nvctk-hostile-void2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["no-gpu-ran", "preload:"], r.stdout + r.stderr  # no libvgpu
    assert not (b / EDITS_FILE).exists()
    assert (b / "config.json").read_bytes() == data  # handed on as it was


# --- errors that mislead ------------------------------------------------------------


def _userns(spec: dict[str, Any]) -> None:
    spec["linux"]["namespaces"].append({"type": "user"})
    spec["linux"]["uidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]
    spec["linux"]["gidMappings"] = [{"containerID": 0, "hostID": 100000, "size": 65536}]


def test_gpu_container_with_user_namespace_is_refused(env: Env,
                                                      bundle: Callable[..., Path]) -> None:
    g = bundle({NVD: "0"}, edit=_userns)
    before = snapshot(g / "config.json")
    r = env.run(*create_argv(env, g))
    assert_clean_failure(env, r, "user namespaces are not supported by nvctk's GPU containers")
    assert snapshot(g / "config.json") == before
    b = bundle({}, name="plain", edit=_userns)  # no GPU: not nvctk's business
    argv = create_argv(env, b)
    assert env.run(*argv).returncode == 0 and env.recorded() == argv


def _hooks_object(spec: dict[str, Any]) -> None:
    spec["hooks"] = {"prestart": {"path": "/usr/bin/mine", "args": ["mine"]}}


def _devices_object(spec: dict[str, Any]) -> None:
    spec["linux"]["devices"] = {"path": "/dev/fuse"}


def _rules_object(spec: dict[str, Any]) -> None:
    spec["linux"]["resources"]["devices"] = {"allow": False, "access": "rwm"}


def _resources_list(spec: dict[str, Any]) -> None:
    spec["linux"]["resources"] = []


@pytest.mark.parametrize(("edit", "needle"), [
    (_hooks_object, "hooks.prestart must be an array, not an object"),
    (_devices_object, "linux.devices must be an array, not an object"),
    (_rules_object, "linux.resources.devices must be an array, not an object"),
    (_resources_list, "linux.resources must be an object, not an array"),
])
def test_wrong_field_types_are_not_repaired(env: Env, bundle: Callable[..., Path],
                                            edit: Callable[[dict[str, Any]], None],
                                            needle: str) -> None:
    g = bundle({NVD: "0"}, edit=edit)
    before = snapshot(g / "config.json")
    assert_clean_failure(env, env.run(*create_argv(env, g)), needle)
    assert snapshot(g / "config.json") == before
    b = bundle({}, name="plain", edit=edit)  # no GPU: runc judges it, untouched
    before = snapshot(b / "config.json")
    argv = create_argv(env, b)
    assert env.run(*argv).returncode == 0 and env.recorded() == argv
    assert snapshot(b / "config.json") == before


def test_oci_edits_refuse_wrong_types() -> None:
    node = DeviceNode("/dev/nvidia0", "/dev/nvidia0", 195, 0)
    with pytest.raises(SpecError, match=re.escape("linux.devices must be an array")):
        spec_edits.add_devices({"linux": {"devices": {}}}, [node])
    hook = Hook("prestart", "/h", ("nvctk-hook", "prestart"), (), 5).entry()
    with pytest.raises(SpecError, match=re.escape("hooks.prestart must be an array")):
        spec_edits.set_hook({"hooks": {"prestart": {"path": "/x"}}}, hook)
    with pytest.raises(SpecError, match="hooks must be an object"):
        spec_edits.set_hook({"hooks": []}, hook)
    with pytest.raises(SpecError, match=re.escape("process.env must be an array")):
        spec_edits.set_env({"process": {"env": "A=1"}}, {"B": "2"})
    spec: dict[str, Any] = {"linux": {"devices": None}, "hooks": {"prestart": None}}
    spec_edits.add_devices(spec, [node])  # null is absent, as Go reads it
    spec_edits.set_hook(spec, hook)
    assert spec["linux"]["devices"][0]["path"] == "/dev/nvidia0"


def test_state_dir_problems_name_the_state_dir(env: Env, bundle: Callable[..., Path]) -> None:
    blocker = env.tmp / "state-file"
    blocker.write_text("not a directory")
    text = re.sub(r"(?m)^state-dir = .*\n", "", env.config.read_text())
    env.config.write_text(text + f'state-dir = "{blocker}"\n')
    b = bundle({NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT": "1g"})
    r = env.run(*create_argv(env, b))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"state dir {blocker}" in r.stderr or f"state-dir {blocker}" in r.stderr, r.stderr
    assert not r.stderr.startswith(f"nvctk-runtime: bundle {b}"), r.stderr


def test_os_error_message_names_the_part() -> None:
    cfg = nvconfig.Config(state_dir="/run/nvctk")
    assert create.os_error_message(OSError(28, "No space left on device", "/run/nvctk/c/limits"),
                                 "/b", cfg) == ("vGPU state dir /run/nvctk: No space left on "
                                                "device: /run/nvctk/c/limits")
    assert create.os_error_message(OSError(13, "Permission denied", "/b/config.json"), "/b",
                                 cfg) == "bundle /b: Permission denied: /b/config.json"
    assert create.os_error_message(OSError(2, "No such file", "/etc/x"), "/b", cfg) == \
        "/etc/x: No such file"


def test_atomic_write_names_the_file_on_write_errors(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, data: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(oci.os, "write", full)
    target = tmp_path / "f"
    with pytest.raises(OSError) as exc:
        fileio.atomic_write(str(target), b"x")
    assert exc.value.filename == str(target) and exc.value.errno == 28
    assert os.listdir(tmp_path) == []


# --- property tests: every parser of container input --------------------------------------

# any text: every plane, controls, lone surrogates, other scripts' digits
anytext = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)
numbers = st.one_of(st.integers(0, 10**6).map(str), st.just(HUGE), st.just(ARABIC_ZERO),
                    st.just(SUPERSCRIPT_TWO), st.text("0123456789" + ARABIC_ZERO + "²:.-,",
                                                      max_size=12))
values = st.one_of(anytext, numbers, st.sampled_from(["all", "none", "void", "0", "1", "0:0",
                                                      "GPU-", "MIG-", "cuda>=12", ""]))
NAMES = [NVD, "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_REQUIRE_CUDA", "NVIDIA_REQUIRE_X",
         "CUDA_VERSION", "NVIDIA_DISABLE_REQUIRE", "NVIDIA_MIG_CONFIG_DEVICES",
         "NVIDIA_MIG_MONITOR_DEVICES", "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT_0",
         "CUDA_DEVICE_SM_LIMIT", "CUDA_DEVICE_SM_LIMIT_1", "NVCTK_VGPU_CONTEXT_RESERVE",
         "CUDA_DEVICE_MEMORY_SHARED_CACHE"]
envs = st.dictionaries(st.one_of(st.sampled_from(NAMES), anytext), values, max_size=6)

HOST = HostInfo("550.54.15", "12.4", (
    GpuInfo(0, "GPU-a", "H100", 0, "00000000:1B:00.0", 81920, "9.0", "nvidia", True,
            (MigInfo(0, "MIG-b", 1, 0, "3g.40gb", 40000),)),
    GpuInfo(1, "GPU-c", "H100", 1, "00000000:1C:00.0", 81920, "9.0", "nvidia", False),
))


@settings(max_examples=300, deadline=None)
@given(envs)
def test_request_parsing_never_crashes(environ: dict[str, str]) -> None:
    spec = {"process": {"env": [f"{k}={v}" for k, v in environ.items()]}}
    try:
        req = request_from_spec(spec, nvconfig.Config())
    except NvctkError as e:
        assert str(e) and len(str(e)) < 1000
        return
    if req is None:
        return
    for ident in req.devices:
        try:
            resolve_device(ident, HOST, NVD)
        except UnknownDeviceError as e:
            assert len(str(e)) < 1000
    try:
        requirements.check(req.requirements, [requirements.HostFacts("12.4", "550.54.15",
                                                                     "9.0", "nvidia", "GPU 0")])
    except NvctkError as e:
        assert len(str(e)) < 2000
    try:
        vgpu.limits_from_env(req.env, 2)
    except RequestError as e:
        assert len(str(e)) < 1000


@settings(max_examples=300, deadline=None)
@given(st.one_of(anytext, numbers, numbers.map(lambda n: f"{n}:{n}"),
                 numbers.map(lambda n: f"0000:{n}:00.0")))
def test_device_ids_are_ascii_only(ident: str) -> None:
    try:
        sel = resolve_device(ident, HOST, NVD)
    except UnknownDeviceError:
        return
    # only ASCII spellings of what the host has select anything
    assert ident.isascii(), ident
    assert sel.gpu in HOST.gpus


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.one_of(
    st.sampled_from(["CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT"]).flatmap(
        lambda p: st.one_of(st.just(p), numbers.map(lambda n: f"{p}_{n}"),
                            anytext.map(lambda t: p + t))),
    st.sampled_from(["CUDA_DEVICE_MEMORY_SHARED_CACHE", "NVCTK_VGPU_CONTEXT_RESERVE"])),
    st.one_of(values, numbers.map(lambda n: n + "g"), numbers.map(lambda n: "1." + n + "m")),
    max_size=4), st.integers(1, 8))
def test_vgpu_limits_never_crash(environ: dict[str, str], gpus: int) -> None:
    try:
        limits = vgpu.limits_from_env(environ, gpus)
    except RequestError as e:
        assert len(str(e)) < 1000
        return
    assert all(0 <= m < 1 << 63 for m in limits.memory)
    assert all(0 <= p <= 100 for p in limits.sm)


def test_other_scripts_digits_select_nothing() -> None:
    for ident in (ARABIC_ZERO, SUPERSCRIPT_TWO, "0:" + ARABIC_ZERO, ARABIC_ZERO + ":0",
                  "00000000:1" + "\u0661" + ":00.0", HUGE, "0:" + HUGE, "\uff10"):
        with pytest.raises(UnknownDeviceError):
            resolve_device(ident, HOST, NVD)
    assert resolve_device("0:0", HOST, NVD).mig is not None
    assert resolve_device("0000:1c:00.0", HOST, NVD).gpu.index == 1


@settings(max_examples=300, deadline=None)
@given(st.one_of(anytext, numbers.map(lambda n: f"cuda>={n}"),
                 st.tuples(st.sampled_from(["cuda", "driver", "arch", "brand", "x"]),
                           st.sampled_from(["<", "<=", "=", "==", "!=", ">", ">="]),
                           numbers).map("".join)))
def test_requirements_never_crash(expr: str) -> None:
    facts = [requirements.HostFacts("12.4", "550.54.15", "9.0", "nvidia", "GPU 0")]
    try:
        requirements.check([expr], facts)
    except NvctkError as e:
        assert len(str(e)) < 2000


def test_versions_compare_past_ints_digit_limit() -> None:
    assert requirements.compare_versions(HUGE, "12.4") == 1
    assert requirements.compare_versions("12.4", HUGE + ".0") == -1
    assert requirements.compare_versions("0012.4.0", "12.4") == 0
    assert requirements.compare_versions("12.10", "12.9") == 1


@settings(max_examples=300, deadline=None)
@given(st.one_of(anytext, st.binary(max_size=60), st.builds(
    lambda pid, b, ann: json.dumps({"id": "c", "pid": pid, "bundle": b, "annotations": ann}),
    st.one_of(st.integers(), st.just(10**4000), anytext), anytext,
    st.dictionaries(anytext, st.one_of(anytext, st.integers(), st.lists(st.integers()))))))
def test_hook_state_never_crashes(text: str | bytes) -> None:
    try:
        state = oci.load_state(text)
    except SpecError as e:
        assert len(str(e)) < 1000
        return
    assert 0 <= state.pid < 1 << 31 and "\0" not in state.bundle
    assert all(isinstance(v, str) for v in state.annotations.values())


def test_hook_state_nested_too_deep() -> None:
    with pytest.raises(SpecError, match="nested too deeply"):
        oci.load_state('{"id":"c","bundle":"/b","x":' + "[" * 5000 + "]" * 5000 + "}")


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=80), anytext, st.builds(
    lambda e, a: json.dumps({"process": {"env": e}, "annotations": a, "root": {"path": "r"}}),
    st.lists(st.one_of(anytext, st.integers())), st.dictionaries(anytext, anytext))))
def test_spec_parsing_never_crashes(data: str | bytes) -> None:
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    try:
        spec = oci.parse_spec(raw)
    except SpecError:
        oci.gpu_marker(raw)
        return
    try:
        oci.check_rewritable(spec, raw)
        oci.dump_spec(spec)
    except SpecError as e:
        assert "surrogate" in str(e)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(sorted(nvconfig._NAMES)) | anytext,
                       st.one_of(anytext, st.integers(), st.just(10**4000), st.booleans(),
                                 st.lists(anytext, max_size=3)), max_size=4))
def test_config_parsing_never_crashes(table: dict[str, Any]) -> None:
    lines = []
    for k, v in table.items():
        if isinstance(v, str):
            v = json.dumps(v)  # a TOML basic string (JSON escapes are TOML's)
        elif isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, list):
            v = "[" + ", ".join(json.dumps(x) for x in v) + "]"
        lines.append(f"{json.dumps(k)} = {v}")
    try:
        nvconfig.parse("\n".join(lines) + "\n", "x.toml")
    except ConfigError as e:
        assert str(e).startswith("x.toml") and len(str(e)) < 1000


@pytest.fixture
def gpu_bundle_dir(tmp_path: Path, sim_host: SimHost) -> Iterator[Path]:
    b = tmp_path / "pb"
    (b / "rootfs" / "etc").mkdir(parents=True)
    yield b


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(environ=envs)
def test_prepare_bundle_never_crashes(environ: dict[str, str], gpu_bundle_dir: Path,
                                      sim_host: SimHost) -> None:
    """The whole create path in-process, on the simulated host: a plan, or NvctkError."""
    cfg = nvconfig.load(sim_host.config_path)
    b = gpu_bundle_dir
    spec = {"ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"args": ["true"], "env": [f"{k}={v}" for k, v in environ.items()]},
            "linux": {"namespaces": [{"type": "mount"}]}}
    (b / "config.json").write_text(json.dumps(spec))
    try:
        create.prepare_bundle(str(b), cfg, container_id="pb", runtime_root=str(b / "runc"),
                            argv0=RUNTIME)
    except NvctkError as e:
        assert len(str(e)) < 2000


# --- a malformed nvctk.io/edits record (hostile retest) -----------------------------------

BAD_RECORDS = [
    '{"devices": [[[1], "c", 1, 2]]}',  # was: internal error: TypeError: unhashable type: 'list'
    '{"devices": [[{"a": 1}, "c", 1, 2]]}',
    '{"rules": [[[1], 1, 2]]}',
    '{"rules": [["c", {}, 2]]}',
    '{"env": [["CUDA_DEVICE_X=1"]]}',
    '{"devices": 5}',
    '{"other": []}',
    "[1]",
    "{",
]


@pytest.mark.parametrize("record", [*BAD_RECORDS, 7], ids=range(len(BAD_RECORDS) + 1))
def test_malformed_edits_record(env: Env, bundle: Callable[..., Path], record: Any) -> None:
    """No GPU: the spec goes to runc byte for byte (a number there was silently
    removed, and runc would refuse that spec); a GPU create: one SpecError naming
    the annotation. Never an internal error."""
    def edit(spec: dict[str, Any]) -> None:
        spec["annotations"] = {spec_edits.EDITS_ANNOTATION: record}

    b = bundle({}, edit=edit)
    before = snapshot(b / "config.json")
    argv = create_argv(env, b)
    r = env.run(*argv)
    assert r.returncode == 0 and "internal error" not in r.stderr, r.stderr
    assert env.recorded() == argv
    assert snapshot(b / "config.json") == before
    env.record.unlink()
    g = bundle({NVD: "0"}, name="gpu", edit=edit)
    assert_clean_failure(env, env.run(*create_argv(env, g)),
                         f"config.json: annotations['{spec_edits.EDITS_ANNOTATION}']")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | anytext,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(anytext, inner, max_size=5),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    json_values,
    json_values.map(json.dumps),
    st.dictionaries(st.sampled_from(["devices", "rules", "env", "seccomp", "x"]),
                    st.lists(st.one_of(json_values, st.lists(json_values, min_size=3, max_size=4)),
                             max_size=4) | json_values).map(json.dumps)))
def test_any_edits_record_is_never_an_internal_error(record: Any) -> None:
    spec = {"annotations": {spec_edits.EDITS_ANNOTATION: record},
            "linux": {"devices": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}],
                      "resources": {"devices": [{"allow": True, "type": "c", "major": 195,
                                                 "minor": 0, "access": "rwm"}]}},
            "process": {"env": ["CUDA_DEVICE_X=1"]}}
    read = read_record(spec)
    assert read is not None
    if not read.malformed:
        undo_as_create(spec, "/", None)
    else:
        assert read.problem is not None
        assert spec_edits.EDITS_ANNOTATION in read.problem and len(read.problem) < 400
        with pytest.raises(SpecError, match=re.escape(spec_edits.EDITS_ANNOTATION)):
            spec_edits.check_record(read)
    spec_edits.remove_our_edits(spec, read)  # the second line: never raises either


# --- container ids and runc roots that are not UTF-8 ---------------------


def _key_dirs(env: Env) -> list[str]:
    top = nvconfig.load(str(env.config)).state_dir
    return [n for n in os.listdir(top) if os.path.isdir(os.path.join(top, n))] \
        if os.path.isdir(top) else []


@pytest.mark.parametrize("cid", ["a\udcff", ".", "..", "a b", "a/b", "é"],
                         ids=["not-utf8", "dot", "dotdot", "space", "slash", "non-ascii"])
def test_gpu_create_refuses_an_id_runc_refuses(env: Env, bundle: Callable[..., Path],
                                               cid: str) -> None:
    b = bundle({NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT": "512m"})
    r = env.run(*create_argv(env, b, cid))
    shown_id = os.fsencode(cid).decode("ascii", "backslashreplace")
    assert_clean_failure(env, r, f"invalid container id '{shown_id}'")
    assert _key_dirs(env) == []  # no state made for it
    assert not (b / EDITS_FILE).exists()


def test_no_gpu_create_leaves_the_id_to_runc(env: Env, bundle: Callable[..., Path]) -> None:
    b = bundle({})
    argv = create_argv(env, b, "a\udcff")
    r = env.run(*argv)
    assert r.returncode == 0, r.stderr
    assert env.record.read_bytes().splitlines()[-1] == b"a\xff"  # runc got it as it was


def test_runc_root_that_is_not_utf8(env: Env, bundle: Callable[..., Path]) -> None:
    from nvctk.vgpu import state as vgpu_state

    assert vgpu_state.state_key("/tmp/x\udcffroot", "c1") != vgpu_state.state_key("/tmp/x", "c1")
    root = str(env.tmp / "x\udcffroot")
    b = bundle({NVD: "0"})  # a GPU without a vGPU limit: the root is not written anywhere
    argv = create_argv(env, b)
    argv[1] = root
    r = env.run(*argv)
    assert r.returncode == 0, r.stderr
    env.record.unlink()
    shutil.rmtree(b)
    b = bundle({NVD: "0", "CUDA_DEVICE_MEMORY_LIMIT": "512m"})
    argv = create_argv(env, b)
    argv[1] = root
    r = env.run(*argv)
    assert_clean_failure(env, r, "runc's --root '" + os.fsencode(root).decode(
        "ascii", "backslashreplace") + "' is not UTF-8")
    assert _key_dirs(env) == []


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
