"""nvctk.base.yamlio: the depth guards in front of PyYAML's C loader, which segfaults on deep
nesting (each hostile case runs in a child process: a missing guard kills that child,
not the suite)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nvctk.base import yamlio


def _nested(depth: int) -> dict[str, object]:
    """{"a": {"b1": {... {"b<depth-1>": {"c": 1}}}}}"""
    inner: dict[str, object] = {"c": 1}
    for i in range(depth - 1, 0, -1):
        inner = {f"b{i}": inner}
    return {"a": inner}


FINE = [
    (b"a: [1, {b: 2}]\n", {"a": [1, {"b": 2}]}),
    (b"- a\n- - b\n", ["a", ["b"]]),
    (b"", None),
    (b'{"cdiVersion": "0.5.0"}', {"cdiVersion": "0.5.0"}),  # JSON is YAML
    (b"a:\n" + b"".join(b" " * i + b"b%d:\n" % i for i in range(1, 40)) + b" " * 40 + b"c: 1\n",
     _nested(40)),  # 40 levels of block mappings: deep, but far below the guard
]


@pytest.mark.parametrize(("data", "want"), FINE)
def test_loads_real_documents(data: bytes, want: object) -> None:
    assert yamlio.load(data) == want


HOSTILE = [
    (b"[" * 100000, "nested 100000 levels deep"),
    (b"{a: " * 70 + b"1" + b"}" * 70, "nested 70 levels deep"),
    (b"- " * 100000 + b"x", "nested too deeply"),
    (b"a:\n" + b" " * 300 + b"b: 1\n", "nested too deeply"),
    (b"x: " + b"9" * 5000, "not valid YAML"),
    (b"a: [", "not valid YAML"),
]


@pytest.mark.parametrize(("data", "message"), HOSTILE)
def test_hostile_documents_are_a_value_error_never_a_crash(data: bytes, message: str) -> None:
    code = ("import sys\nfrom nvctk.base import yamlio\ntry:\n"
            "    yamlio.load(sys.stdin.buffer.read())\n    print('loaded')\n"
            "except ValueError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True,
                       timeout=60)
    assert r.returncode == 0, r.returncode  # -11: the C loader segfaulted
    assert message in r.stdout.decode(), r.stdout


def test_flow_depth_counts_brackets_linearly() -> None:
    assert yamlio.flow_depth(b"a: [b, {c: [d]}]") == 3
    assert yamlio.flow_depth(b"]]][[") == 0  # closers first: never deeper than the top
    assert yamlio.flow_depth(b"plain") == 0
