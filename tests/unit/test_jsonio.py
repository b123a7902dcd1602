"""nvctk.base.jsonio must agree with the json package: same values, same errors."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvctk.base import jsonio

REPO = Path(__file__).resolve().parents[2]

documents = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(documents, st.booleans(), st.booleans(), st.sampled_from(["", " ", "\n\t ", "\r\n"]))
def test_round_trip_matches_json(doc: Any, sort_keys: bool, ascii_only: bool, ws: str) -> None:
    text = jsonio.dumps(doc, sort_keys=sort_keys, ensure_ascii=ascii_only)
    assert text == json.dumps(doc, separators=(",", ":"), sort_keys=sort_keys,
                              ensure_ascii=ascii_only)
    padded = ws + text + ws
    assert jsonio.loads(padded) == json.loads(padded)
    assert jsonio.loads(padded.encode()) == json.loads(padded.encode())


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_any_text_gives_json_value_or_json_error(text: str) -> None:
    try:
        want: Any = json.loads(text)
    except ValueError as e:
        with pytest.raises(ValueError) as got:
            jsonio.loads(text)
        assert str(got.value) == str(e)
    else:
        got_value = jsonio.loads(text)
        assert got_value == want or (isinstance(want, float) and math.isnan(want))


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b"[1] x", b'{"a":1,}', b"\xff", "\ufeff{}".encode(), "[1]".encode("utf-16")],
)
def test_bytes_edge_cases_match_json(data: bytes) -> None:
    try:
        want: Any = json.loads(data)
    except ValueError as e:
        with pytest.raises(type(e)) as got:
            jsonio.loads(data)
        assert str(got.value) == str(e)
    else:
        assert jsonio.loads(data) == want


def test_unserializable_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="not JSON serializable"):
        jsonio.dumps({"a": object()})


def test_constants_as_json_reads_them() -> None:
    assert jsonio.loads('[Infinity,-Infinity]') == [math.inf, -math.inf]
    assert math.isnan(jsonio.loads("NaN"))


def test_importing_it_does_not_import_json_or_re() -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(REPO)!r}); from nvctk.base import jsonio; "
        "jsonio.dumps(jsonio.loads('{\"a\": [1, 2.5, null]}')); "
        "print(sorted({'json', 're'} & set(sys.modules)))"
    )
    r = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_the_fast_path_is_the_c_accelerator() -> None:
    """A CPython whose _json no longer fits fails here, not by going slow unnoticed."""
    assert jsonio._scan is not None and type(jsonio._scan).__module__ == "_json"
    assert type(jsonio._scan).__name__ == "Scanner"


@settings(max_examples=200, deadline=None)
@given(documents, st.booleans())
def test_valid_documents_never_take_the_fallback(doc: Any, as_bytes: bool) -> None:
    text = json.dumps(doc, separators=(",", ":"))
    old = jsonio._slow_loads

    def no_fallback(data: str | bytes | bytearray) -> Any:
        raise AssertionError(f"fell back to json for {data!r}")

    jsonio._slow_loads = no_fallback  # type: ignore[assignment]
    try:
        got = jsonio.loads(text.encode() if as_bytes else text)
    finally:
        jsonio._slow_loads = old  # type: ignore[assignment]
    assert got == doc
