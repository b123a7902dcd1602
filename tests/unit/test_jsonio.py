"""nvctk.base.jsonio must agree with the json package: same values, same errors; and
ordinary documents must take its fast path (jansson through nvctk._sys), not json."""

from __future__ import annotations

import collections
import enum
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvctk import _sys
from nvctk.base import jsonio

REPO = Path(__file__).resolve().parents[2]

documents = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)

# what the fast path decodes: integers within 64 bits, finite floats, keys unique and
# without NUL (jansson refuses "\u0000" in a key, not in a value)
INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
fast_documents = st.recursive(
    st.none() | st.booleans() | INT64 | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(st.characters(blacklist_categories=("Cs",),
                                          blacklist_characters="\x00")), inner, max_size=5),
    max_leaves=30,
)


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types (1, 1.0 and True are == but not the same JSON)."""
    return repr(a) == repr(b)


def assert_loads_as_json(data: str | bytes) -> None:
    """jsonio.loads(data) gives json.loads' value, or its error with its message."""
    try:
        want: Any = json.loads(data)
    except (ValueError, RecursionError) as e:
        with pytest.raises(type(e)) as got:
            jsonio.loads(data)
        assert str(got.value) == str(e)
    else:
        assert same(jsonio.loads(data), want)


def refuse_fallback(data: str | bytes | bytearray) -> Any:
    raise AssertionError(f"fell back to json for {data!r}")


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
    assert_loads_as_json(text)


@pytest.mark.parametrize(
    "data",
    [b"", b"{", b"[1] x", b'{"a":1,}', b"\xff", "\ufeff{}".encode(), "[1]".encode("utf-16")],
)
def test_bytes_edge_cases_match_json(data: bytes) -> None:
    assert_loads_as_json(data)


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


def test_the_fast_path_is_nvctk_sys() -> None:
    """jsonio decodes and encodes in nvctk's compiled extension, not in json."""
    assert _sys.__file__ is not None and _sys.__file__.endswith(".so")
    assert same(_sys.json_loads('{"a":[1,2.5,null,true,"x"]}'), {"a": [1, 2.5, None, True, "x"]})


@pytest.fixture
def no_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonio, "_slow_loads", refuse_fallback)


@settings(max_examples=300, deadline=None)
@given(fast_documents, st.booleans(), st.booleans(), st.sampled_from(["", " ", "\n\t ", "\r\n"]))
def test_valid_documents_never_take_the_fallback(doc: Any, as_bytes: bool, ascii_only: bool,
                                                 ws: str) -> None:
    text = ws + json.dumps(doc, separators=(",", ":"), ensure_ascii=ascii_only) + ws
    old = jsonio._slow_loads
    jsonio._slow_loads = refuse_fallback  # type: ignore[assignment]
    try:
        got = jsonio.loads(text.encode() if as_bytes else text)
    finally:
        jsonio._slow_loads = old  # type: ignore[assignment]
    assert same(got, json.loads(text))


# --- whatever the fast path accepts, it reads as json does ---------------------------------


def fast_agrees_with_json(data: str | bytes) -> None:
    try:
        got = _sys.json_loads(data)
    except ValueError:
        return  # refused: jsonio hands it to json
    assert same(got, json.loads(data)), data


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=st.sampled_from('{}[]:,"\\ \n01-+.eE9aftrunlsu\x00\x1f\u00e9\U0001f600'),
               max_size=30))
def test_json_shaped_text_fast_or_refused(text: str) -> None:
    fast_agrees_with_json(text)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=30))
def test_any_bytes_fast_or_refused(data: bytes) -> None:
    fast_agrees_with_json(data)


numbers = st.builds(
    lambda sign, whole, frac, exp: sign + whole + frac + exp,
    st.sampled_from(["", "-"]),
    st.sampled_from(["0"]) | st.from_regex(r"\A[1-9][0-9]{0,25}\Z"),
    st.sampled_from([""]) | st.from_regex(r"\A\.[0-9]{1,25}\Z"),
    st.sampled_from([""]) | st.from_regex(r"\A[eE][-+]?[0-9]{1,4}\Z"),
)


@settings(max_examples=1000, deadline=None)
@given(numbers)
def test_numbers_read_as_float_and_int_read_them(number: str) -> None:
    """jansson's strtod rounds as float() does; past 64 bits or the float range, json."""
    fast_agrees_with_json(number)
    assert same(jsonio.loads(number), json.loads(number))


@settings(max_examples=500, deadline=None)
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_every_float_repr_decodes_to_itself_on_the_fast_path(x: float) -> None:
    assert same(_sys.json_loads(repr(x)), x)


@pytest.mark.parametrize(("text", "fast"), [
    ('{"a":1,"a":2}', False),  # json keeps the last; jansson would refuse
    (str(2**63 - 1), True), (str(-(2**63)), True), (str(2**63), False), (str(-(2**63) - 1), False),
    (str(10**40), False), ("1e400", False), ("-1e400", False), ("1e-400", True), ("-0", True),
    ("-0.0", True), ("NaN", False), ("[Infinity]", False),
    ('"\\ud800"', False), ('"\\udc00x"', False), ('"\\ud83d\\ude00"', True),
    ('"a\\u0000b"', True), ('{"k\\u0000":1}', False),
    ("0\x00", False), ('[1]\x00"x"', False), ("[1,\x002]", False),
    ("[" * 150 + "]" * 150, True), ("[" * 300 + "]" * 300, False),
])
def test_where_jansson_and_json_could_differ_json_decides(text: str, fast: bool) -> None:
    assert_loads_as_json(text)
    try:
        _sys.json_loads(text)
        took_fast = True
    except ValueError:
        took_fast = False
    assert took_fast == fast


@pytest.mark.parametrize("data", [
    "[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000,
    b'"\xff"', b'"\xed\xa0\x80"', b'"\xc0\x80"', b'"\xf4\x90\x80\x80"', b"[1]\x00",
    "\ud800", '"\ud800"', '"a\x00"', "1 2", "",
])
def test_hostile_input_gets_jsons_answer(data: str | bytes) -> None:
    assert_loads_as_json(data)


def test_huge_string_on_the_fast_path(no_fallback: None) -> None:
    big = "x\u00e9\U0001f600" * 2_000_000
    text = json.dumps({"s": big, "t": [big]})
    assert jsonio.loads(text) == {"s": big, "t": [big]}
    assert jsonio.dumps(big, ensure_ascii=False) == json.dumps(big, ensure_ascii=False)


# --- the encoder writes what json.dumps writes, and refuses what it refuses ---------------


class Color(enum.IntEnum):
    RED = 1


class FloatSub(float):
    def __repr__(self) -> str:
        return "not json"


def jd(obj: Any, sort_keys: bool = False, ensure_ascii: bool = True) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=sort_keys, ensure_ascii=ensure_ascii)


@pytest.mark.parametrize("obj", [
    {2.5: "b", True: "c", -7: "t", float("nan"): 1, float("inf"): 2, -1e300: 3},
    {None: "d", False: "e"}, {1: "a", None: "n"}, {"b": 1, "a": {"d": [], "c": None}},
    [float("nan"), float("inf"), -float("inf"), -0.0, 1e16, 1e-7, 5e-324],
    "\ud800 \udfff \x7f \x1f \u2028 \U0010ffff", (1, (2, [3])), [Color.RED, FloatSub(1.5)],
    {Color.RED: 1}, collections.OrderedDict([("b", 1), ("a", 2)]), "", [], {}, [[]], [{}],
])
@pytest.mark.parametrize("sort_keys", [False, True])
@pytest.mark.parametrize("ascii_only", [False, True])
def test_encoder_edge_cases_match_json(obj: Any, sort_keys: bool, ascii_only: bool) -> None:
    try:
        want = jd(obj, sort_keys, ascii_only)
    except TypeError as e:  # keys that do not sort
        with pytest.raises(TypeError) as got:
            jsonio.dumps(obj, sort_keys=sort_keys, ensure_ascii=ascii_only)
        assert str(got.value) == str(e)
    else:
        assert jsonio.dumps(obj, sort_keys=sort_keys, ensure_ascii=ascii_only) == want


def circular_list() -> Any:
    a: list[Any] = []
    a.append(a)
    return a


def circular_dict() -> Any:
    d: dict[str, Any] = {}
    d["x"] = [d]
    return d


def deep_list() -> Any:
    d: list[Any] = []
    for _ in range(100_000):
        d = [d]
    return d


@pytest.mark.parametrize(("obj", "sort_keys"), [
    (circular_list(), False), (circular_dict(), False), (deep_list(), False),
    ({(1, 2): 1}, False), ({"a": 1, 2: 1}, True), ({"a": {1, 2}}, False), (b"x", False),
    ([1, object()], False),
])
def test_encoder_refuses_as_json_does(obj: Any, sort_keys: bool) -> None:
    with pytest.raises((TypeError, ValueError, RecursionError)) as want:
        jd(obj, sort_keys)
    with pytest.raises(type(want.value)) as got:
        jsonio.dumps(obj, sort_keys=sort_keys)
    assert str(got.value) == str(want.value)


def test_shared_not_circular_is_fine() -> None:
    shared = [1]
    assert jsonio.dumps([shared, shared, {"a": shared}]) == "[[1],[1],{\"a\":[1]}]"


def test_a_key_sort_that_edits_the_list_being_written_does_not_crash() -> None:
    outer: list[Any] = []

    class Key(str):
        def __lt__(self, other: object) -> bool:
            outer.clear()  # drops the dict being written, but for the encoder's reference
            return str.__lt__(self, str(other))

    outer.extend([{Key("b"): 1, Key("a"): 2}, "tail"])
    got = jsonio.dumps(outer, sort_keys=True)
    assert got.startswith('[{"a":2,"b":1}')


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_decoding_opens_no_file() -> None:
    """jansson would seed its hash from /dev/urandom at the first object: in a hook's
    mount namespace that path is the container's (a FIFO there would block the hook)."""
    code = (f"import sys; sys.path.insert(0, {str(REPO)!r}); from nvctk.base import jsonio; "
            "jsonio.loads('{\"a\": {\"b\": 1}}')")
    r = subprocess.run(["strace", "-f", "-e", "trace=open,openat", sys.executable, "-I", "-S",
                        "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "/dev/urandom" not in r.stderr and "/dev/random" not in r.stderr


@pytest.mark.parametrize("text", [
    "\x0c1", "1\x0b", "\u00a01", "1\u2028", "\ufeff1", "[1,]", '{"a":1,}', "01", "1.", ".5", "+1",
    "-", "1e", "1e+", '"\\x"', '"\\u12"', "tru", "True", "nul", "[1 2]", '{"a" 1}', "{1:2}",
    '"\t"', "'a'", "[1]]", "{}}", "",
])
def test_what_json_refuses_the_fast_path_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        _sys.json_loads(text)


@pytest.mark.parametrize("data", [1, None, memoryview(b"[1]"), ["[1]"]])
def test_what_is_not_a_document_gets_jsons_type_error(data: Any) -> None:
    with pytest.raises(TypeError) as want:
        json.loads(data)
    with pytest.raises(TypeError) as got:
        jsonio.loads(data)
    assert str(got.value) == str(want.value)
