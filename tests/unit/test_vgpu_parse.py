"""The limit grammar: nvctk.vgpu.limits (Python, at create time) and libvgpu's C parser
must agree on every input; limits_from_env and the limits file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libvgpu" / "tests"))
import harness as H

from nvctk.base.errors import RequestError
from nvctk.vgpu import limits as vgpu

G = 1 << 30


@pytest.fixture(scope="module")
def c_parse():
    H.build()
    p = subprocess.Popen([str(H.PARSE)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(kind: str, value: str) -> int | None:
        assert p.stdin is not None and p.stdout is not None
        p.stdin.write(f"{kind} {value}\n")
        p.stdin.flush()
        out = p.stdout.readline().split()
        return int(out[1]) if out[0] == "ok" else None

    yield run
    p.kill()


def py(fn, value: str) -> int | None:
    try:
        return fn(value)
    except ValueError:
        return None


@pytest.mark.parametrize(
    "value,expected",
    [
        ("1gb", G), ("1GB", G), ("1.0g", G), ("1GiB", G), ("1g", G), ("1073741824", G),
        ("4096m", 4 * G), ("1.5g", G + G // 2), ("0.5k", 512), (".5k", 512), ("1.k", 1024),
        ("100b", 100), (" 8g ", 8 * G), ("0", 0), ("0.0g", 0), ("1t", 1 << 40),
        ("0.1k", 102), ("2M", 2 << 20), ("3Kib", 3072),
        ("1x", None), ("", None), ("g", None), ("1.5", None), ("-1g", None), ("1 g", None),
        ("1ib", None), ("1gbb", None), ("1e9", None), ("\u0661", None), ("0x10", None), (".", None),
        ("99999999999999999999g", None), ("9223372036854775808", None),
    ],
)
def test_memory_examples(c_parse, value: str, expected: int | None) -> None:
    assert py(vgpu.parse_memory, value) == expected
    if "\n" not in value:
        assert c_parse("mem", value) == expected


@pytest.mark.parametrize("value,expected", [("0", 0), ("1", 1), ("100", 100), ("050", 50), ("101", None), ("50%", None), ("", None), ("1.5", None), ("-1", None)])
def test_sm_examples(c_parse, value: str, expected: int | None) -> None:
    assert py(vgpu.parse_sm, value) == expected
    assert c_parse("sm", value) == expected


_memory_like = st.from_regex(r"[ \t]?[0-9]{0,21}(\.[0-9]{0,19})?[kKmMgGtTxX]?([iI]?[bB])?[ \t]?", fullmatch=True)


@settings(max_examples=400, deadline=None)
@given(st.one_of(_memory_like, st.text(alphabet="0123456789.kmgtbiKMGTBI -", max_size=12)))
def test_memory_c_and_python_agree(c_parse, value: str) -> None:
    assert py(vgpu.parse_memory, value) == c_parse("mem", value)


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="0123456789 .%-", max_size=5))
def test_sm_c_and_python_agree(c_parse, value: str) -> None:
    assert py(vgpu.parse_sm, value) == c_parse("sm", value)


def test_limits_from_env() -> None:
    lim = vgpu.limits_from_env(
        {"CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_MEMORY_LIMIT_1": "2g", "CUDA_DEVICE_SM_LIMIT": "30", "PATH": "/bin"}, 3
    )
    # strictest wins: GPU 1's own 2g cannot lift the 1g every GPU has
    assert lim.memory == (G, G, G) and lim.sm == (30, 30, 30) and lim.any
    assert not vgpu.limits_from_env({}, 2).any
    assert not vgpu.limits_from_env({"CUDA_DEVICE_MEMORY_LIMIT": "0"}, 2).any


M = 1 << 20


@pytest.mark.parametrize(("env", "memory", "sm"), [
    # a per-device "no limit" never lifts the global limit
    ({"CUDA_DEVICE_MEMORY_LIMIT": "20480m", "CUDA_DEVICE_MEMORY_LIMIT_0": "0"}, (20480 * M, 20480 * M), (0, 0)),
    # a per-device value larger than the global one does not loosen it
    ({"CUDA_DEVICE_MEMORY_LIMIT": "512m", "CUDA_DEVICE_MEMORY_LIMIT_1": "4g"}, (512 * M, 512 * M), (0, 0)),
    # smaller per-device values tighten their device only
    ({"CUDA_DEVICE_MEMORY_LIMIT": "4g", "CUDA_DEVICE_MEMORY_LIMIT_1": "1g"}, (4 * G, G), (0, 0)),
    # a global "no limit" does not remove a device's own limit
    ({"CUDA_DEVICE_MEMORY_LIMIT": "0", "CUDA_DEVICE_MEMORY_LIMIT_1": "1g"}, (0, G), (0, 0)),
    ({"CUDA_DEVICE_SM_LIMIT": "0", "CUDA_DEVICE_SM_LIMIT_0": "30"}, (0, 0), (30, 0)),
    # the SM share follows the same rule
    ({"CUDA_DEVICE_SM_LIMIT": "25", "CUDA_DEVICE_SM_LIMIT_0": "100"}, (0, 0), (25, 25)),
    ({"CUDA_DEVICE_SM_LIMIT": "25", "CUDA_DEVICE_SM_LIMIT_1": "0"}, (0, 0), (25, 25)),
    ({"CUDA_DEVICE_SM_LIMIT": "50", "CUDA_DEVICE_SM_LIMIT_1": "10"}, (0, 0), (50, 10)),
], ids=["mem-dev0-zero", "mem-dev-larger", "mem-dev-smaller", "mem-global-zero",
        "sm-global-zero", "sm-dev-100", "sm-dev-zero", "sm-dev-smaller"])
def test_strictest_limit_wins(env: dict[str, str], memory: tuple[int, ...], sm: tuple[int, ...]) -> None:
    """Every variable that applies to a GPU can only tighten its limit: the merged env
    (image ENV + `docker run -e` + a Pod's env + a device plugin's share) holds no
    order nvctk could trust, so no variable may loosen another."""
    lim = vgpu.limits_from_env(env, 2)
    assert (lim.memory, lim.sm) == (memory, sm)
    # the limits file says the same per GPU, so libvgpu (stricter of file and env) agrees
    values = lim.values()
    assert [int(values[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"]) for i in range(2)] == list(memory)
    assert [int(values[f"CUDA_DEVICE_SM_LIMIT_{i}"]) for i in range(2)] == list(sm)


@pytest.mark.parametrize(("value", "want"), [
    ("0", vgpu.DEFAULT_RESERVE), ("1m", vgpu.DEFAULT_RESERVE), ("63m", vgpu.DEFAULT_RESERVE),
    ("64m", vgpu.DEFAULT_RESERVE), ("128m", 128 * M), ("1g", G)])
def test_context_reserve_only_rises_above_the_floor(value: str, want: int) -> None:
    """NVCTK_VGPU_CONTEXT_RESERVE from the container's env can raise the charge for a
    context's own memory, never lower it below the node's floor (0 would leave every
    context's real memory uncharged): the value nvctk writes to the limits file."""
    lim = vgpu.limits_from_env({"CUDA_DEVICE_MEMORY_LIMIT": "1g", vgpu.RESERVE_VAR: value}, 1)
    assert lim.context_reserve == want
    assert int(lim.values()[vgpu.RESERVE_VAR]) == want


@pytest.mark.parametrize(
    "env,name",
    [
        ({"CUDA_DEVICE_MEMORY_LIMIT": "1gbx"}, "CUDA_DEVICE_MEMORY_LIMIT"),
        ({"CUDA_DEVICE_MEMORY_LIMIT_2": "1g"}, "CUDA_DEVICE_MEMORY_LIMIT_2"),
        ({"CUDA_DEVICE_MEMORY_LIMIT_a": "1g"}, "CUDA_DEVICE_MEMORY_LIMIT_a"),
        ({"CUDA_DEVICE_SM_LIMIT": "200"}, "CUDA_DEVICE_SM_LIMIT"),
        ({"CUDA_DEVICE_SM_LIMIT_0": "x"}, "CUDA_DEVICE_SM_LIMIT_0"),
        ({"CUDA_DEVICE_MEMORY_SHARED_CACHE": "rel/path"}, "CUDA_DEVICE_MEMORY_SHARED_CACHE"),
    ],
)
def test_limits_from_env_names_the_variable(env: dict[str, str], name: str) -> None:
    with pytest.raises(RequestError, match=name):
        vgpu.limits_from_env(env, 2)


def test_limits_file_round_trip_and_c_reads_it(tmp_path: Path, c_parse) -> None:
    lim = vgpu.limits_from_env({"CUDA_DEVICE_MEMORY_LIMIT_0": "1.5g", "CUDA_DEVICE_SM_LIMIT": "40"}, 2)
    path = tmp_path / "limits"
    vgpu.write_limits_file(path, lim.values(), cache="/run/nvctk/vgpu/cache")
    assert path.stat().st_mode & 0o777 == 0o444
    assert vgpu.read_limits_file(path, 2) == vgpu.VgpuLimits(
        lim.memory, lim.sm, "/run/nvctk/vgpu/cache", vgpu.DEFAULT_RESERVE)  # always written
    out = subprocess.run([str(H.PARSE), "config"], env={"NVCTK_VGPU_LIMITS_FILE": str(path)}, capture_output=True, text=True, check=True).stdout
    conf = dict(line.split(" ", 1) for line in out.splitlines())
    assert conf["mem0"] == str(G + G // 2) and conf["mem1"] == "0"
    assert conf["sm0"] == conf["sm1"] == "40"
    assert conf["cache"] == "/run/nvctk/vgpu/cache"
    # the stricter of file and env, per GPU
    out = subprocess.run([str(H.PARSE), "config"], env={"NVCTK_VGPU_LIMITS_FILE": str(path), "CUDA_DEVICE_MEMORY_LIMIT": "1g", "CUDA_DEVICE_SM_LIMIT_1": "90"}, capture_output=True, text=True, check=True).stdout
    conf = dict(line.split(" ", 1) for line in out.splitlines())
    assert conf["mem0"] == str(G) and conf["mem1"] == str(G) and conf["sm1"] == "40"
    # a malformed file fails closed
    bad = tmp_path / "bad"
    bad.write_text("CUDA_DEVICE_MEMORY_LIMIT_0=lots\n")
    cp = subprocess.run([str(H.PARSE), "config"], env={"NVCTK_VGPU_LIMITS_FILE": str(bad)}, capture_output=True, text=True)
    assert cp.returncode == 1 and "CUDA_DEVICE_MEMORY_LIMIT_0" in cp.stdout
