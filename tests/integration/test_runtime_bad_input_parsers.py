"""Property tests: every parser of container input (the request's env, device ids, vGPU
limits, requirements, hook state, specs, the config, the whole create path in-process, the
nvctk.io/edits record) takes arbitrary text and returns a value or an NvctkError, never a
crash. (The rest of the bad-input suite: test_runtime_bad_input_config.py.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import support.runtime as _runtime
from nvctk.base import config as nvconfig
from nvctk.base.errors import ConfigError, NvctkError, RequestError, SpecError, UnknownDeviceError
from nvctk.host.inventory import GpuInfo, HostInfo, MigInfo
from nvctk.host.select import resolve_device
from nvctk.oci import spec as oci
from nvctk.request import requirements
from nvctk.request.parse import request_from_spec
from nvctk.runtime import create
from nvctk.sim.host import SimHost
from nvctk.spec import apply as spec_edits
from nvctk.spec.record import read_record
from nvctk.vgpu import limits as vgpu
from support.bad_input import ARABIC_ZERO, HUGE, SUPERSCRIPT_TWO, anytext, envs, numbers, values
from support.records import undo_as_create
from support.runtime import NVD, RUNTIME, Env, assert_clean_failure, create_argv, snapshot

env = _runtime.env  # fixtures

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
