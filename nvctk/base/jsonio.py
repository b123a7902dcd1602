"""JSON for the container-start path, without importing the json package.

`import json` pulls in `re` (json.decoder and json.scanner compile patterns at
import), which costs every GPU container's start, twice (runtime and hook;
figures in docs/decisions.md). So documents are decoded by jansson, a C library linked
into nvctk._sys, and encoded by nvctk._sys's compact encoder; both on Python's public C
API. Results are the same as json.loads/json.dumps (tests/unit/test_jsonio.py compares
them on generated documents). The decoder refuses every document on which jansson and
json could differ (duplicate keys, integers beyond 64 bits, NaN/Infinity, lone
surrogates, invalid UTF-8, deep nesting) and every invalid one; those, and input outside
the common case (UTF-16/32 bytes, a BOM), go through the json package, so values and
messages there are exactly json's. The tests fail, rather than let starts go slow
unnoticed, when an ordinary document takes that fallback.
"""

from __future__ import annotations

from nvctk import _sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


def loads(data: str | bytes | bytearray) -> Any:
    """json.loads: the same value, or the same ValueError (JSONDecodeError)."""
    # json.loads detects UTF-16/32 (NUL bytes up front) and a BOM in bytes: leave those to it
    if isinstance(data, (bytes, bytearray)) and (
            data[:3] == b"\xef\xbb\xbf" or b"\x00" in data[:4]):
        return _slow_loads(data)
    try:
        return _sys.json_loads(data)
    except ValueError:  # invalid, or one json may read differently: json decides
        return _slow_loads(data)


def _slow_loads(data: str | bytes | bytearray) -> Any:
    import json  # start time: json (+ re) only for what the fast path leaves to it

    return json.loads(data)


def dumps(obj: Any, *, sort_keys: bool = False, ensure_ascii: bool = True) -> str:
    """json.dumps(obj, separators=(",", ":"), sort_keys=..., ensure_ascii=...)."""
    return _sys.json_dumps(obj, sort_keys, ensure_ascii)
