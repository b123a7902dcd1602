"""Issue 13 §1: every parser that sees untrusted data, fuzzed with hypothesis.

Property, for each target: a defined result, or a clear error (an NvctkError, or the
documented ValueError of the limit grammar) whose message is short and names the input
(the file, for file parsers); never another exception, never a hang (each input has a
deadline). The number of inputs tried per target goes to the report.

Complements tests/integration/test_runtime_bad_input_parsers.py (which fuzzes the same env parsers with
300 examples each): here the file parsers (ld.so.cache, engine configs, CDI specs,
the device-plugin config) get byte-level mutations of real files, and every target
reports its count.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nvctk.base import config as nvconfig
from nvctk.base.errors import NvctkError
from nvctk.cdi import load, resolve
from nvctk.engines import common as engines_common
from nvctk.engines.changes import plan_configure, plan_remove
from nvctk.host import ldcache
from nvctk.k8s import config as dpconfig
from nvctk.oci import spec as oci
from nvctk.plan.cdi import cdi_edits
from nvctk.request import requirements
from nvctk.request.parse import request_from_spec
from nvctk.vgpu import limits as vgpu
from support import reliability as relkit

EXAMPLES = relkit.n(60, 3000)
# a parse of a few KiB taking this long is a hang for our purposes (2 shared cores)
DEADLINE = timedelta(seconds=5)
REPO = Path(__file__).resolve().parents[2]

anytext = st.text(st.characters(codec=None, exclude_categories=()), max_size=60)
numbers = st.one_of(st.integers(-10, 10**6).map(str), st.just("1" * 5000), st.just("\u0660"),
                    st.text("0123456789.:-,kmgtKMGTiIbB \t\u0660", max_size=14))
env_names = st.sampled_from([
    "NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_REQUIRE_CUDA",
    "NVIDIA_REQUIRE_ARCH", "CUDA_VERSION", "NVIDIA_DISABLE_REQUIRE", "NVIDIA_MIG_CONFIG_DEVICES",
    "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_MEMORY_LIMIT_0", "CUDA_DEVICE_MEMORY_LIMIT_7",
    "CUDA_DEVICE_SM_LIMIT", "CUDA_DEVICE_SM_LIMIT_1", "NVCTK_VGPU_CONTEXT_RESERVE",
    "CUDA_DEVICE_MEMORY_SHARED_CACHE", "CUDA_MPS_PIPE_DIRECTORY", "NVIDIA_IMEX_CHANNELS"])
values = st.one_of(anytext, numbers, st.sampled_from([
    "all", "none", "void", "0", "0,1", "0:0", "GPU-", "MIG-", "nvidia.com/gpu=0",
    "cuda>=12.0 brand=tesla", "compute,utility", "4g", "1.5GiB", "50", ""]))


def _settings() -> Any:
    # the short run is derandomized (the same inputs each time: no flaky suite); the
    # full run explores
    return settings(max_examples=EXAMPLES, deadline=DEADLINE, database=None,
                    derandomize=not relkit.FULL,
                    suppress_health_check=list(HealthCheck))


def fuzz(target: str, strategy: st.SearchStrategy[Any], prop: Callable[[Any], str]) -> None:
    """Runs prop over the strategy; prop returns "ok" or "error" (a clear one), and
    raises on anything else. Records how many inputs were tried and the split."""
    counts = {"ok": 0, "error": 0}
    slowest = [0.0]

    @_settings()
    @given(strategy)
    def run(x: Any) -> None:
        t0 = time.monotonic()
        counts[prop(x)] += 1
        slowest[0] = max(slowest[0], time.monotonic() - t0)

    run()
    relkit.record("fuzz", target, inputs=counts["ok"] + counts["error"], accepted=counts["ok"],
                  clear_errors=counts["error"], slowest_s=round(slowest[0], 4), crashes=0,
                  hangs=0)


def _clear(e: BaseException, needle: str | None = None, limit: int | None = 2000) -> str:
    """limit None: a library-level ValueError that quotes the value whole (its callers
    wrap it in a message that cuts long values)."""
    msg = str(e)
    assert msg and (limit is None or len(msg) < limit), msg[:3000]
    assert "Traceback" not in msg
    if needle is not None:
        assert needle in msg, (needle, msg[:500])
    return "error"


def _file_prop(path: Path, read: Callable[[], object], needle: str | None = None,
               limit: int | None = 2000) -> Callable[[bytes], str]:
    """A fuzz property: the bytes written to path, then read() gives "ok" or an
    NvctkError that passes _clear(needle, limit)."""
    def prop(raw: bytes) -> str:
        path.write_bytes(raw)
        try:
            read()
        except NvctkError as e:
            return _clear(e, needle, limit)
        return "ok"

    return prop


# --- container input: env, requirements, limits, the spec and the state ------------------
def test_fuzz_request_env() -> None:
    def prop(env: list[tuple[str, str]]) -> str:
        spec = {"process": {"env": [f"{k}={v}" for k, v in env]}}
        try:
            request_from_spec(spec, nvconfig.Config())
        except NvctkError as e:
            return _clear(e)
        return "ok"

    fuzz("request_from_spec (NVIDIA_*/CUDA_* env)",
         st.lists(st.tuples(st.one_of(env_names, anytext), values), max_size=8), prop)


def test_fuzz_requirements() -> None:
    facts = [requirements.HostFacts("12.4", "550.54.15", "9.0", "nvidia", "GPU 0")]
    term = st.tuples(st.sampled_from(["cuda", "driver", "arch", "brand", "x", ""]),
                     st.sampled_from(["<", "<=", "=", "==", "!=", ">", ">=", "=>", ""]),
                     numbers).map("".join)
    exprs = st.lists(st.one_of(anytext, st.lists(term, max_size=5).map(" ".join)), max_size=4)

    def prop(ex: list[str]) -> str:
        try:
            requirements.check(ex, facts)
        except NvctkError as e:
            return _clear(e, limit=4000)
        return "ok"

    fuzz("requirements.check (NVIDIA_REQUIRE_*)", exprs, prop)


def test_fuzz_limit_values() -> None:
    def prop(v: str) -> str:
        out = "ok"
        try:
            m = vgpu.parse_memory(v)
            assert 0 <= m < 1 << 63
        except ValueError as e:
            out = _clear(e, limit=None)
        try:
            s = vgpu.parse_sm(v)
            assert 0 <= s <= 100
        except ValueError as e:
            out = _clear(e, limit=None)
        return out

    fuzz("vgpu.parse_memory / parse_sm", st.one_of(anytext, numbers, values), prop)


def test_fuzz_limits_from_env() -> None:
    names = st.sampled_from(["CUDA_DEVICE_MEMORY_LIMIT", "CUDA_DEVICE_SM_LIMIT"]).flatmap(
        lambda p: st.one_of(st.just(p), numbers.map(lambda x: f"{p}_{x}"),
                            anytext.map(lambda t: p + t)))

    def prop(a: tuple[dict[str, str], int]) -> str:
        env, gpus = a
        try:
            lim = vgpu.limits_from_env(env, gpus)
        except NvctkError as e:
            return _clear(e)
        assert all(0 <= m < 1 << 63 for m in lim.memory)
        assert all(0 <= p <= 100 for p in lim.sm)
        return "ok"

    fuzz("vgpu.limits_from_env", st.tuples(
        st.dictionaries(st.one_of(names, env_names), values, max_size=5), st.integers(0, 8)), prop)


def _json_mutations(base: bytes) -> st.SearchStrategy[bytes]:
    """Byte-level mutations of a real document: flips, cuts, splices, repeats."""
    def mutate(seed: int, k: int) -> bytes:
        rng = random.Random(seed)
        data = bytearray(base)
        for _ in range(k):
            op = rng.randrange(5)
            i = rng.randrange(len(data) + 1)
            if op == 0 and data:
                data[min(i, len(data) - 1)] = rng.randrange(256)
            elif op == 1:
                del data[i:i + rng.randrange(1, 64)]
            elif op == 2:
                data[i:i] = rng.choice([b"{", b"[", b"\"", b"\\u0000", b"\xff", b"\\ud800",
                                        b"1e999999", b"null", b",", b"9" * 5000, b"[" * 3000])
            elif op == 3:
                j = rng.randrange(len(data) + 1)
                data[i:i] = data[min(i, j):max(i, j)][:4096]
            else:
                data = data[:i]
        return bytes(data)

    return st.builds(mutate, st.integers(0, 2**32), st.integers(1, 6))


def _gpu_spec() -> dict[str, Any]:
    return {"ociVersion": "1.0.2", "root": {"path": "rootfs"},
            "process": {"args": ["sh"], "cwd": "/",
                        "env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=0",
                                "CUDA_DEVICE_MEMORY_LIMIT=1g"]},
            "annotations": {"cdi.k8s.io/x": "nvidia.com/gpu=0"},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}],
            "linux": {"devices": [], "resources": {"devices": [{"allow": False,
                                                                "access": "rwm"}]}}}


def test_fuzz_oci_spec() -> None:
    base = json.dumps(_gpu_spec()).encode()

    def prop(raw: bytes) -> str:
        try:
            spec = oci.parse_spec(raw)
        except NvctkError as e:
            oci.gpu_marker(raw)  # the passthrough's look at what it cannot parse
            return _clear(e)
        try:
            env = oci.spec_env(spec)
            assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
            request_from_spec(spec, nvconfig.Config())
        except NvctkError as e:
            return _clear(e)
        return "ok"

    fuzz("oci.parse_spec + spec_env + request_from_spec (config.json)",
         st.one_of(_json_mutations(base), st.binary(max_size=200)), prop)


def test_fuzz_oci_state() -> None:
    base = json.dumps({"ociVersion": "1.0.2", "id": "c1", "status": "creating", "pid": 4242,
                       "bundle": "/b", "annotations": {"a": "b"}}).encode()

    def prop(raw: bytes) -> str:
        try:
            s = oci.load_state(raw)
        except NvctkError as e:
            return _clear(e)
        assert 0 <= s.pid < 1 << 31 and "\0" not in s.bundle
        return "ok"

    fuzz("oci.load_state (hook stdin)", st.one_of(_json_mutations(base), st.binary(max_size=120)),
         prop)


# --- files: nvctk's config, ld.so.cache, engine configs, CDI, device plugin ---------------
def test_fuzz_nvctk_config(sim_host: Any) -> None:
    base = Path(sim_host.config_path).read_bytes()

    def prop(raw: bytes) -> str:
        text = raw.decode("utf-8", "replace")
        try:
            nvconfig.parse(text, "fuzz.toml")
        except NvctkError as e:
            return _clear(e, "fuzz.toml")
        return "ok"

    fuzz("config.parse (config.toml)", _json_mutations(base), prop)


def test_fuzz_ldcache(sim_host: Any) -> None:
    base = Path(ldcache.cache_path(sim_host.root)).read_bytes()

    def field_pokes(seed: int, k: int) -> bytes:
        # header and entry fields set to extreme values: offsets, counts, lengths
        rng = random.Random(seed)
        data = bytearray(base)
        for _ in range(k):
            i = rng.randrange(0, min(len(data) - 4, 4096)) & ~3
            data[i:i + 4] = rng.choice([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, len(data),
                                        len(data) - 1]).to_bytes(4, "little")
        return bytes(data)

    def prop(raw: bytes) -> str:
        try:
            entries = ldcache.parse(raw)
            ldcache.parse(raw, ["libcuda", "libnvidia-ml"])
        except NvctkError as e:
            return _clear(e, "ld.so.cache")
        assert all(isinstance(x.path, str) for x in entries)
        return "ok"

    fuzz("ldcache.parse (ld.so.cache)",
         st.one_of(_json_mutations(base), st.builds(field_pokes, st.integers(0, 2**32),
                                                     st.integers(1, 8))), prop)


def _file_target(tmp: Path, name: str) -> Path:
    p = tmp / name
    p.parent.mkdir(parents=True, exist_ok=True)
    return p


ENGINE_BASES = {
    "containerd": (REPO / "containerd-config.toml.example").read_bytes(),
    "docker": json.dumps({"runtimes": {"runc": {"path": "runc"}}, "default-runtime": "runc",
                          "log-level": "info"}, indent=2).encode(),
    "crio": b'[crio.runtime]\ndefault_runtime = "runc"\n[crio.runtime.runtimes.runc]\n'
            b'runtime_path = "/usr/bin/runc"\n',
}


@pytest.mark.parametrize("engine", sorted(ENGINE_BASES))
def test_fuzz_engine_config(engine: str, tmp_path: Path) -> None:
    path = _file_target(tmp_path, f"{engine}/config")
    drop = tmp_path / f"{engine}/drop-in.toml"
    req = engines_common.EngineRequest(runtime_path="/usr/bin/nvctk-runtime", config=str(path),
                                 drop_in=str(drop) if engine == "crio" else "")

    def both() -> None:
        plan_configure(engine, req)
        plan_remove(engine, req)

    prop = _file_prop(path, both, str(path), limit=4000)

    fuzz(f"engines.{engine} (configure/remove editors)",
         st.one_of(_json_mutations(ENGINE_BASES[engine]), st.binary(max_size=100)), prop)


def test_fuzz_cdi_spec(tmp_path: Path) -> None:
    base = json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [
        {"name": "0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}],
                                         "env": ["A=1"]}}],
        "containerEdits": {"mounts": [{"hostPath": "/x", "containerPath": "/y"}],
                           "hooks": [{"hookName": "createContainer", "path": "/h"}]}}).encode()
    yaml_base = (b"cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: '0'\n"
                 b"  containerEdits:\n    deviceNodes:\n    - path: /dev/nvidia0\n"
                 b"anchors: &a [*a]\n")
    path = _file_target(tmp_path, "cdi/nvidia.yaml")

    def read() -> None:
        load.load_spec_file(str(path))
        # and into the edits form, as CDI mode decodes it
        cdi_edits(resolve.read_devices(load.resolve(("nvidia.com/gpu=0",), (str(path.parent),))),
                  "/sbin/ldconfig")

    prop = _file_prop(path, read, limit=4000)

    fuzz("cdi.load_spec_file + resolve + plan.cdi (CDI specs)",
         st.one_of(_json_mutations(base), _json_mutations(yaml_base)), prop)


def test_fuzz_deviceplugin_config(tmp_path: Path) -> None:
    base = (b"version: v1\nflags:\n  migStrategy: none\n  deviceListStrategy: [envvar, cdi-cri]\n"
            b"sharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
            b"      replicas: 4\n")
    path = _file_target(tmp_path, "dp/config.yaml")

    prop = _file_prop(path, lambda: dpconfig.load(str(path)), str(path))

    fuzz("deviceplugin.config.load", st.one_of(_json_mutations(base), st.binary(max_size=80)),
         prop)


def test_deviceplugin_config_fifo_never_blocks(tmp_path: Path) -> None:
    """Every other file parser refuses what is not a regular file without blocking
    (docs/decisions.md, "Nothing read at start can block")."""
    pytest.importorskip("yaml")
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    import subprocess
    import sys

    code = ("import sys\nfrom nvctk.k8s import config\n"
            "try:\n    config.load(sys.argv[1])\nexcept Exception as e:\n    print(e)\n")
    try:
        r = subprocess.run([sys.executable, "-c", code, str(fifo)], capture_output=True,
                           text=True, timeout=5)
    except subprocess.TimeoutExpired:
        pytest.fail("deviceplugin.config.load blocked on a FIFO for 5 s")
    assert "not a regular file" in r.stdout or "cannot read" in r.stdout, r.stdout + r.stderr


def test_docker_config_with_a_lone_surrogate_escape(tmp_path: Path) -> None:
    path = tmp_path / "daemon.json"
    path.write_bytes(b'{"log-level": "\\ud800"}')
    req = engines_common.EngineRequest(runtime_path="/usr/bin/nvctk-runtime", config=str(path))
    try:
        plan_configure("docker", req)
    except NvctkError as e:
        assert str(path) in str(e)
