"""JSON for the container-start path, without importing the json package.

`import json` pulls in `re` (json.decoder and json.scanner compile patterns at
import), which costs every GPU container's start, twice (runtime and hook;
figures in docs/decisions.md). The C accelerator `_json` that json itself uses does the real
work and needs none of that, so this module drives it directly. Results are the
same as json.loads/json.dumps (a test compares them on generated documents);
any error, and any input outside the common case (UTF-16/32 bytes, a BOM), goes
through the json package so messages are exactly json's.

`_json` is CPython's private accelerator: what it reads of its context is not a
promised interface. tests/unit/test_jsonio.py therefore fails, rather than this module
quietly getting slower, when the scanner or encoder is not `_json`'s, when valid
documents take the json fallback, or when the values differ from json's.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

try:
    import _json
except ImportError:  # an interpreter without the accelerator: plain json
    _json = None  # type: ignore[assignment]

_WS = " \t\n\r"


class _Decoder:
    """The attributes _json.make_scanner reads from a json.JSONDecoder (the C scanner
    keeps its own key memo per call)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> float:
        return {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}[name]


_scan = _json.make_scanner(_Decoder()) if _json is not None else None  # type: ignore[arg-type]


def loads(data: str | bytes | bytearray) -> Any:
    """json.loads: the same value, or the same ValueError (JSONDecodeError)."""
    if _scan is None:
        return _slow_loads(data)
    if isinstance(data, (bytes, bytearray)):
        # json.loads detects UTF-16/32 (NUL bytes up front) and a BOM: leave those to it
        if data[:3] == b"\xef\xbb\xbf" or b"\x00" in data[:4]:
            return _slow_loads(data)
        try:
            text = data.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return _slow_loads(data)
    else:
        text = data
    n = len(text)
    i = 0
    while i < n and text[i] in _WS:
        i += 1
    try:
        value, end = _scan(text, i)
    except (StopIteration, SystemError):
        # SystemError: on CPython 3.11 the scanner builds its JSONDecodeError from
        # sys.modules["json.decoder"] and, that not imported, raises nothing usable
        return _slow_loads(data)
    while end < n and text[end] in _WS:
        end += 1
    if end != n:
        return _slow_loads(data)  # "Extra data": json says where
    return value


def _slow_loads(data: str | bytes | bytearray) -> Any:
    import json  # start time: json (+ re) only for what _json leaves to it

    return json.loads(data)


def _unserializable(o: object) -> Any:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


def dumps(obj: Any, *, sort_keys: bool = False, ensure_ascii: bool = True) -> str:
    """json.dumps(obj, separators=(",", ":"), sort_keys=..., ensure_ascii=...)."""
    if _json is None:
        import json  # start time: only without the accelerator

        return json.dumps(obj, separators=(",", ":"), sort_keys=sort_keys,
                          ensure_ascii=ensure_ascii)
    encode = _json.encode_basestring_ascii if ensure_ascii else _json.encode_basestring
    encoder = _json.make_encoder(
        {}, _unserializable, encode, None, ":", ",", sort_keys, False, True
    )
    return "".join(encoder(obj, 0))
