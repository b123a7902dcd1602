"""NVIDIA_REQUIRE_* grammar and checks (REFERENCE §5)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvctk.base.errors import RequestError, RequirementError
from nvctk.request import requirements
from nvctk.request.requirements import HostFacts, check, compare_versions, parse_expression

H100 = HostFacts(cuda="12.4", driver="550.54.15", arch="9.0", brand="nvidia", gpu="GPU 0")
T4 = HostFacts(cuda="12.4", driver="550.54.15", arch="7.5", brand="tesla", gpu="GPU 1")
NO_GPU = HostFacts(cuda="12.4", driver="550.54.15")

# (expression, hosts, holds)
CASES: list[tuple[str, list[HostFacts], bool]] = [
    ("cuda>=12.0", [H100], True),
    ("cuda>=12.4", [H100], True),
    ("cuda>12.4", [H100], False),
    ("cuda=12.4.0", [H100], True),  # trailing .0 ignored
    ("cuda=12.4", [HostFacts("12.4.0", "1")], True),
    ("cuda!=12.4", [H100], False),
    ("cuda<13", [H100], True),
    ("cuda<=12.3", [H100], False),
    ("cuda==12.4", [H100], True),
    ("driver>=535", [H100], True),
    ("driver>=550.54.16", [H100], False),
    ("driver<550.100", [H100], True),  # numeric, not lexical
    ("arch>=8.0", [H100], True),
    ("arch>=8.0", [H100, T4], False),  # every selected GPU
    ("arch>=8.0", [NO_GPU], True),  # `none`: no GPU to check
    ("brand=NVIDIA", [H100], True),  # case-insensitive
    ("brand=tesla", [H100], False),
    ("brand!=tesla", [H100], True),
    ("brand=tesla brand=nvidia", [H100, T4], True),  # OR
    ("brand=tesla,arch>=7.0", [T4], True),  # AND
    ("brand=tesla,arch>=8.0", [T4], False),
    ("cuda>=13.0 brand=nvidia,driver>=500", [H100], True),
    ("cuda>=13.0 brand=tesla,driver>=500", [H100], False),
    ("  cuda>=12   ", [H100], True),
]


@pytest.mark.parametrize(("expr", "hosts", "holds"), CASES)
def test_check(expr: str, hosts: list[HostFacts], holds: bool) -> None:
    if holds:
        check([expr], hosts)
    else:
        with pytest.raises(RequirementError):
            check([expr], hosts)


def test_all_expressions_must_hold() -> None:
    check(["cuda>=12", "arch>=9.0"], [H100])
    with pytest.raises(RequirementError, match="driver>=999"):
        check(["cuda>=12", "driver>=999"], [H100])


def test_message_names_term_and_host_value() -> None:
    with pytest.raises(RequirementError) as e:
        check(["cuda>=12.6"], [H100])
    assert "cuda>=12.6" in str(e.value) and "12.4" in str(e.value)
    with pytest.raises(RequirementError) as e:
        check(["arch>=8.0"], [H100, T4])
    assert "GPU 1" in str(e.value) and "7.5" in str(e.value)
    with pytest.raises(RequirementError) as e:
        check(["brand=tesla cuda>=13"], [H100])
    assert "brand=tesla (host brand nvidia)" in str(e.value)
    assert "cuda>=13 (host cuda 12.4)" in str(e.value)


@pytest.mark.parametrize(
    "expr",
    ["cuda", "cuda>=", "cuda>>12", "gpu>=1", "brand>tesla", "cuda>=twelve", "arch>=8.x",
     "cuda>=12,,", ",", "cuda=>12"],
)
def test_malformed(expr: str) -> None:
    with pytest.raises(RequestError):
        parse_expression(expr)
    with pytest.raises(RequestError):
        check([expr], [NO_GPU])  # reported even with no GPU selected


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [("12.0", "12", 0), ("12.4", "12.10", -1), ("550.54.15", "550.54.15.0", 0), ("9", "10", -1),
     ("1.0.0.1", "1", 1)],
)
def test_compare_versions(a: str, b: str, want: int) -> None:
    assert compare_versions(a, b) == want


# The term and version grammar is parsed by hand (no `re` on the create path); these
# are the patterns it replaced, which it must agree with on every input.
_TERM = re.compile(r"^([A-Za-z_]+)(<=|>=|!=|==|=|<|>)(.+)$")
_VERSION = re.compile(r"^[0-9]+(\.[0-9]+)*$")


def _by_regex(text: str) -> tuple[str, str, str] | None:
    m = _TERM.match(text)
    return (m.group(1), m.group(2), m.group(3)) if m else None


@pytest.mark.parametrize(
    "text",
    ["cuda>=12.4", "cuda<=", "cuda<==1", "cuda==12", "cuda=>12", "cuda>>1", "brand=tesla",
     "Driver!=1", "_x<1", "cuda>=12\n", "cuda>=12\n\n", "cuda\n>=12", "cuda>=1\n2", "é>=1",
     "cuda", "=1", "cuda=", "cuda>", "cuda!", "cuda!==", "cuda<>1", "a=b=c", "cuda>=\r"],
)
def test_term_split_as_regex(text: str) -> None:
    assert requirements._split_term(text) == _by_regex(text)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="cudaB_é<>=!.12 \n\r\t", max_size=12))
def test_term_split_as_regex_any(text: str) -> None:
    assert requirements._split_term(text) == _by_regex(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="0123456789.٣a \n", max_size=10))
def test_version_as_regex(value: str) -> None:
    if "\n" not in value:  # a term's value never holds one
        assert requirements._is_version(value) == bool(_VERSION.match(value))
