"""nvctk-runtime against odd specs: unreadable or wrongly shaped ones go to runc untouched
when they ask for no GPU and fail with one clear line when they do; the real runc where the
promise is about runc (its --log gets the error); any bug in create is one line, never a
traceback. (The rest of the bad-input suite: test_runtime_bad_input_config.py.)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import support.runtime as _runtime
from nvctk.edits_file import EDITS_FILE
from nvctk.oci import runc_argv
from nvctk.oci import spec as oci
from nvctk.runtime import create
from nvctk.sim.host import SimHost
from support.bad_input import ARABIC_ZERO, HUGE, SUPERSCRIPT_TWO
from support.runtime import (
    NVD,
    Env,
    assert_clean_failure,
    assert_passed_through,
    create_argv,
    runc_log_errors,
    snapshot,
)

env = _runtime.env  # fixtures


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
