"""A parser for the subset of TOML that nvctk's config files use, without tomllib.

`import tomllib` costs ~28 ms on a 2-core VM (it pulls in re, typing, datetime,
string, ...), and nvctk's config is read by both the shim and the hook of every
GPU container's start. The files nvctk writes (`nvctk config default`, the
simulated host's config) are flat `key = value` lines, which this reads with
string methods only.

`loads` returns None for anything outside the subset, valid TOML or not: the
caller then asks tomllib, which also words the errors. The one rule here is
that a dict returned equals `tomllib.loads(text)`; the steps below mirror
tomllib's (Python 3.11) so that they accept exactly the same texts.

The subset: comments, blank lines, top-level `key = value` with bare or quoted
(one-line) keys, one-line basic and literal strings, decimal integers, booleans,
arrays (over several lines, with comments and a trailing comma) and inline
tables. Not in it: [tables], [[arrays of tables]], dotted keys, floats, hex,
octal and binary integers, dates and times, multi-line strings.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

_WS = " \t"
_WS_NL = " \t\n"
_BARE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
# Characters a bare value (boolean, number, date) is made of: a token of them is
# judged whole, so "12.5" or "1979-05-27" is refused as such, not read as 12 or
# 1979 followed by junk (which the check after every value would refuse too)
_TOKEN = _BARE | frozenset("+.:")
_DIGITS = "0123456789"
_HEX = frozenset("0123456789abcdefABCDEF")
# tomllib's ILLEGAL_BASIC_STR_CHARS (also used for literal strings and comments)
_ILLEGAL = frozenset([chr(i) for i in range(32) if i != 9] + ["\x7f"])
_ESCAPES = {"b": "\b", "t": "\t", "n": "\n", "f": "\f", "r": "\r", '"': '"', "\\": "\\"}


class _Reject(Exception):
    """Not in the subset (or not TOML): tomllib decides."""


def loads(text: str) -> dict[str, Any] | None:
    """The TOML document `text` as tomllib would return it, or None if it is outside the subset."""
    # as tomllib: the spec lets a parser read CRLF as LF, even inside strings
    src = text.replace("\r\n", "\n") if "\r" in text else text
    try:
        return _document(src)
    except (_Reject, RecursionError):
        return None


def _document(src: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    pos, end = 0, len(src)
    while True:
        pos = _skip(src, pos, _WS)
        if pos >= end:
            return out
        c = src[pos]
        if c == "\n":
            pos += 1
            continue
        if c in _BARE or c == '"' or c == "'":
            pos, key, value = _key_value(src, pos)
            if key in out:
                raise _Reject
            out[key] = value
            pos = _skip(src, pos, _WS)
        elif c != "#":
            raise _Reject  # a [table] header, or no statement at all
        pos = _comment(src, pos)
        if pos < end:
            if src[pos] != "\n":
                raise _Reject
            pos += 1


def _skip(src: str, pos: int, chars: str | frozenset[str]) -> int:
    end = len(src)
    while pos < end and src[pos] in chars:
        pos += 1
    return pos


def _comment(src: str, pos: int) -> int:
    """Past the comment at pos, if there is one, up to its newline."""
    if not src.startswith("#", pos):
        return pos
    nl = src.find("\n", pos)
    if nl < 0:
        nl = len(src)
    if not _ILLEGAL.isdisjoint(src[pos + 1 : nl]):
        raise _Reject
    return nl


def _skip_array_space(src: str, pos: int) -> int:
    while True:
        before = pos
        pos = _comment(src, _skip(src, pos, _WS_NL))
        if pos == before:
            return pos


def _key_value(src: str, pos: int) -> tuple[int, str, Any]:
    c = src[pos : pos + 1]
    if c == '"':
        pos, key = _basic_string(src, pos + 1)
    elif c == "'":
        pos, key = _literal_string(src, pos + 1)
    elif c in _BARE:
        start = pos
        pos = _skip(src, pos, _BARE)
        key = src[start:pos]
    else:
        raise _Reject
    pos = _skip(src, pos, _WS)
    if not src.startswith("=", pos):
        raise _Reject  # a dotted key, or not a key/value pair
    pos, value = _value(src, _skip(src, pos + 1, _WS))
    return pos, key, value


def _value(src: str, pos: int) -> tuple[int, Any]:
    c = src[pos : pos + 1]
    if c == '"':
        if src.startswith('"""', pos):
            raise _Reject
        return _basic_string(src, pos + 1)
    if c == "'":
        if src.startswith("'''", pos):
            raise _Reject
        return _literal_string(src, pos + 1)
    if c == "[":
        return _array(src, pos + 1)
    if c == "{":
        return _inline_table(src, pos + 1)
    start = pos
    end = len(src)
    while pos < end and src[pos] in _TOKEN:
        pos += 1
    return pos, _scalar(src[start:pos])


def _scalar(token: str) -> bool | int:
    if token == "true":
        return True
    if token == "false":
        return False
    # a decimal integer as TOML has it: [+-]?(0|[1-9](_?[0-9])*)
    digits = token[1:] if token[:1] in ("+", "-") else token
    if not digits or digits[0] not in _DIGITS or (digits[0] == "0" and len(digits) > 1):
        raise _Reject
    prev_digit = False
    for ch in digits:
        if ch in _DIGITS:
            prev_digit = True
        elif ch == "_" and prev_digit:
            prev_digit = False
        else:
            raise _Reject
    if not prev_digit:
        raise _Reject  # ends with "_"
    try:
        return int(token.replace("_", ""))
    except ValueError:  # past int()'s limit on digits: tomllib raises that itself
        raise _Reject


def _basic_string(src: str, pos: int) -> tuple[int, str]:
    """The one-line "..." string whose body starts at pos."""
    parts: list[str] = []
    quote = -1
    while True:
        if quote < pos:
            quote = src.find('"', pos)
            if quote < 0:
                raise _Reject
        backslash = src.find("\\", pos, quote)
        stop = quote if backslash < 0 else backslash
        part = src[pos:stop]
        if not _ILLEGAL.isdisjoint(part):
            raise _Reject  # including a newline: the string is unterminated
        parts.append(part)
        if backslash < 0:
            return quote + 1, "".join(parts)
        pos, char = _escape(src, backslash + 1)
        parts.append(char)


def _escape(src: str, pos: int) -> tuple[int, str]:
    """The character escaped at pos (just past a backslash)."""
    c = src[pos : pos + 1]
    if c in _ESCAPES:
        return pos + 1, _ESCAPES[c]
    if c == "u" or c == "U":
        n = 4 if c == "u" else 8
        hex_digits = src[pos + 1 : pos + 1 + n]
        if len(hex_digits) != n or not _HEX.issuperset(hex_digits):
            raise _Reject
        code = int(hex_digits, 16)
        if 0xD800 <= code <= 0xDFFF or code > 0x10FFFF:
            raise _Reject  # not a Unicode scalar value
        return pos + 1 + n, chr(code)
    raise _Reject  # \e, \x.. (TOML 1.1), a bad escape, or a backslash at the end


def _literal_string(src: str, pos: int) -> tuple[int, str]:
    """The one-line '...' string whose body starts at pos."""
    quote = src.find("'", pos)
    if quote < 0:
        raise _Reject
    body = src[pos:quote]
    if not _ILLEGAL.isdisjoint(body):
        raise _Reject
    return quote + 1, body


def _array(src: str, pos: int) -> tuple[int, list[Any]]:
    """The array whose first item (or "]") is at or after pos."""
    items: list[Any] = []
    pos = _skip_array_space(src, pos)
    if src.startswith("]", pos):
        return pos + 1, items
    while True:
        pos, item = _value(src, pos)
        items.append(item)
        pos = _skip_array_space(src, pos)
        c = src[pos : pos + 1]
        if c == "]":
            return pos + 1, items
        if c != ",":
            raise _Reject
        pos = _skip_array_space(src, pos + 1)
        if src.startswith("]", pos):
            return pos + 1, items


def _inline_table(src: str, pos: int) -> tuple[int, dict[str, Any]]:
    """The inline table whose first key (or "}") is at or after pos."""
    table: dict[str, Any] = {}
    pos = _skip(src, pos, _WS)
    if src.startswith("}", pos):
        return pos + 1, table
    while True:
        pos, key, value = _key_value(src, pos)
        if key in table:
            raise _Reject
        table[key] = value
        pos = _skip(src, pos, _WS)
        c = src[pos : pos + 1]
        if c == "}":
            return pos + 1, table
        if c != ",":
            raise _Reject
        pos = _skip(src, pos + 1, _WS)
