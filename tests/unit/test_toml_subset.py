"""nvctk.base.toml_subset: a dict it returns is always tomllib's; None hands over to tomllib.

The generators below build documents from TOML's grammar and know whether each
is inside the subset, so the tests check both directions: the subset is always
taken (never None), and everything else is always left to tomllib.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nvctk.base import config as nvconfig
from nvctk.base.toml_subset import loads

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def tomllib_or_none(text: str) -> dict[str, Any] | None:
    try:
        return tomllib.loads(text)
    except Exception:  # TOMLDecodeError, or ValueError/RecursionError from deep inside
        return None


def agrees(text: str) -> dict[str, Any] | None:
    """loads(text), after checking it never disagrees with tomllib."""
    got = loads(text)
    if got is not None:
        assert tomllib_or_none(text) == got, text
    return got


ACCEPTED = [
    "",
    "\n\n",
    "# only a comment",
    "a = 1",
    "a = 1\n",
    "  a\t=\t1  # trailing comment\n",
    "a=1\r\nb=2\r\n",
    'key-with_dash0 = "v"',
    '"quoted key" = 1',
    '"" = 1',
    "'literal key' = 1",
    '"a.b" = 1',
    "1234 = 5",
    "true = false",
    'a = "esc \\" \\\\ \\b \\t \\n \\f \\r"',
    'a = "\\u00e9\\U0001F600\\u0041\\uABcd"',
    'a = "tab\tinside"',
    'a = "unicode é 😀 \u0085 \u2028"',
    "a = 'C:\\path\\no\\escapes \"'",
    "a = ''",
    'a = ""',
    "a = 0\nb = -0\nc = +0\nd = +17\ne = -17\nf = 1_000_000\ng = 9223372036854775807",
    "a = 123456789012345678901234567890",
    "a = true\nb = false",
    "a = []",
    "a = [ ]",
    "a = [1, 2, 3]",
    "a = [1, 2, 3,]",
    'a = [\n  "x",  # first\n  # a comment line\n  "y",\n]\n',
    "a = [[1, 2], [], [[3]], ['s']]",
    'a = [1, "mixed", true, [2], {k = 1}]',
    "a = {}",
    "a = { }",
    'a = { x = 1, "y" = "2", z = [1, 2], w = { v = true } }',
    "a = {x=1,y=2}",
    "a = { x = [\n 1,\n 2 # c\n] }",
    'extra-mounts = [{ host-path = "/a", container-path = "/b", read-only = false }]',
    "a = 1 #\x80 comment with C1 and ünïcode and \t tab",
    "a = 1 # comment with \"quotes\" and 'apostrophes' and [brackets] = #",
    "a = 1 #! not a directive\nb = [ #!\n  2 ]",
]

REJECTED = [
    # valid TOML, outside the subset
    "[table]\na = 1",
    "[[array]]\na = 1",
    "a.b = 1",
    "a . b = 1",
    "a. = 1",
    "a .= 1",
    "a = { b. = 1 }",
    '"a".b = 1',
    "a = { b.c = 1 }",
    "a = 1.5",
    "a = 1e3",
    "a = inf",
    "a = -nan",
    "a = 0x1f",
    "a = 0o17",
    "a = 0b101",
    "a = 1979-05-27",
    "a = 1979-05-27T07:32:00Z",
    "a = 1979-05-27 07:32:00",
    "a = 07:32:00",
    'a = """multi\nline"""',
    "a = '''multi'''",
    'a = """"""',
    "a = ''''''",
    "a = 1_" + "0" * 5000,  # past int()'s digit limit: tomllib raises ValueError itself
    # not TOML
    "a",
    "a =",
    "a = ",
    "= 1",
    "a = 1\na = 2",
    'a = 1\n"a" = 2',
    "a = { x = 1, x = 2 }",
    "a = 1 b = 2",
    "a = 1 2",
    "a = 01",
    "a = 00",
    "a = -00",
    "a = 0_0",
    "a = 1_2__3",
    "a = 1__0",
    "a = _1",
    "a = 1_",
    "a = +",
    "a = ++1",
    "a = truee",
    "a = True",
    "a = tru",
    "a = [1,,2]",
    "a = [,]",
    "a = [1",
    "a = [1 2]",
    "a = { x = 1, }",
    "a = { x = 1\n}",
    "a = {\nx = 1 }",
    "a = { x = 1 # c\n}",
    "a = { x }",
    'a = "unterminated',
    'a = "line\nbreak"',
    "a = 'line\nbreak'",
    'a = "bad \\e escape"',
    'a = "bad \\x41 escape"',
    'a = "bad \\a escape"',
    'a = "\\u12"',
    'a = "\\u12G4"',
    'a = "\\uD800"',
    'a = "\\U00110000"',
    'a = "\\u 123"',
    'a = "trailing backslash\\"',
    'a = "ctrl \x01 char"',
    'a = "del \x7f char"',
    "a = 'ctrl \x00 char'",
    "a = 1 # ctrl \x01 in comment",
    "a = 1 # bare CR \r in comment",
    "a = 1\rb = 2",
    "\ufeffa = 1",
    "a\u00a0= 1",
    "é = 1",
    "a = é",
    "{a = 1}",
    "a = ]",
    "a = }",
    "a = 1]",
    "a = [" * 2000 + "]" * 2000,
]


@pytest.mark.parametrize("text", ACCEPTED)
def test_accepted(text: str) -> None:
    assert agrees(text) is not None


@pytest.mark.parametrize("text", REJECTED)
def test_rejected(text: str) -> None:
    assert loads(text) is None


# --- documents from TOML's grammar, each knowing whether it is in the subset ---

CTRL = [chr(i) for i in range(32) if i != 9] + ["\x7f"]
SHORT_ESCAPES = {"\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r", '"': '\\"', "\\": "\\\\"}
text_chars = st.characters(codec="utf-8")  # any code point a string can hold
comment_text = st.text(st.characters(codec="utf-8", exclude_characters=CTRL), max_size=12)
ws = st.text(" \t", max_size=2)


@st.composite
def basic_string(draw: st.DrawFn, s: str) -> str:
    out = []
    for c in s:
        how = draw(st.sampled_from(["raw", "raw", "raw", "u", "U", "short"]))
        if (how == "short" or c in CTRL or c in '"\\') and c in SHORT_ESCAPES:
            out.append(SHORT_ESCAPES[c])
        elif how == "U":
            out.append(f"\\U{ord(c):08{draw(st.sampled_from('xX'))}}")
        elif (how == "u" and ord(c) <= 0xFFFF) or c in CTRL or c in '"\\':
            out.append(f"\\u{ord(c):04{draw(st.sampled_from('xX'))}}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


@st.composite
def string(draw: st.DrawFn) -> tuple[str, str]:
    s = draw(st.text(text_chars, max_size=8))
    if "'" not in s and not any(c in CTRL for c in s) and draw(st.booleans()):
        return f"'{s}'", s
    return draw(basic_string(s)), s


@st.composite
def integer(draw: st.DrawFn) -> tuple[str, int]:
    n = draw(st.integers(-(2**80), 2**80) | st.sampled_from([0, 1, -1]))
    digits = str(abs(n))
    text = digits[0]
    for d in digits[1:]:
        text += ("_" if draw(st.integers(0, 4)) == 2 else "") + d
    sign = "-" if n < 0 else draw(st.sampled_from(["", "", "+"]))
    return sign + text, n


@st.composite
def key(draw: st.DrawFn, name: str) -> str:
    """`name` written as a bare, basic-quoted or literal-quoted key."""
    forms = [draw(basic_string(name))]
    if name and all(c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-" for c in name):
        forms += [name, name]
    if "'" not in name and not any(c in CTRL for c in name):
        forms.append(f"'{name}'")
    return draw(st.sampled_from(forms))


key_names = st.one_of(
    st.sampled_from(["a", "b", "driver-root", "extra-mounts", "host_path", "1", "true", "", "a.b"]),
    st.text(text_chars, max_size=6),
)

# valid TOML outside the subset
OUTSIDE = ["1.5", "-2e3", "inf", "nan", "0xff", "0o7", "0b1", "1979-05-27", "07:32:00",
           "1979-05-27T07:32:00Z", "1979-05-27 07:32:00.5", '"""x\ny"""', "'''z'''", '""""""']

Value = tuple[str, Any, bool]  # (TOML text, tomllib's value, inside the subset)


@st.composite
def array_space(draw: st.DrawFn) -> str:
    pieces = draw(st.lists(st.sampled_from([" ", "\t", "\n", "#"]), max_size=3))
    return "".join(f"#{draw(comment_text)}\n" if p == "#" else p for p in pieces)


@st.composite
def scalars(draw: st.DrawFn) -> Value:
    kind = draw(st.integers(0, 30))
    if kind == 13:  # rare: one such value takes its whole document out of the subset
        return draw(st.sampled_from(OUTSIDE)), None, False
    if kind % 3 == 0:
        b = draw(st.booleans())
        return ("true" if b else "false"), b, True
    text, value = draw(string() if kind % 3 == 1 else integer())
    return text, value, True


def arrays(items: st.SearchStrategy[Value]) -> st.SearchStrategy[Value]:
    @st.composite
    def build(draw: st.DrawFn) -> Value:
        vals = draw(st.lists(items, max_size=4))
        text = "[" + draw(array_space())
        for i, (t, _, _) in enumerate(vals):
            if i:
                text += draw(array_space()) + "," + draw(array_space())
            text += t
        trailing_comma = draw(st.booleans())
        if vals and trailing_comma:
            text += draw(array_space()) + ","
        text += draw(array_space()) + "]"
        return text, [v for _, v, _ in vals], all(ok for _, _, ok in vals)

    return build()


def inline_tables(items: st.SearchStrategy[Value]) -> st.SearchStrategy[Value]:
    @st.composite
    def build(draw: st.DrawFn) -> Value:
        names = draw(st.lists(key_names, max_size=4, unique=True))
        ok = True
        parts = []
        table = {}
        for name in names:
            t, v, inside = draw(items)
            k = draw(key(name))
            if draw(st.integers(0, 15)) == 7:  # a dotted key: valid, outside the subset
                k, v, inside = f"{k}.x", {"x": v}, False
            parts.append(f"{k}{draw(ws)}={draw(ws)}{t}")
            table[name] = v
            ok = ok and inside
        body = ("," + draw(ws)).join(parts)
        return "{" + draw(ws) + body + draw(ws) + "}", table, ok

    return build()


values = st.recursive(scalars(), lambda inner: arrays(inner) | inline_tables(inner), max_leaves=12)


Document = tuple[str, dict[str, Any], bool]  # (text, tomllib's value if inside, inside)


@st.composite
def documents(draw: st.DrawFn) -> Document:
    """Always valid TOML."""
    lines = []
    data = {}
    ok = True
    names = draw(st.lists(key_names, max_size=6, unique=True))
    for name in names:
        for _ in range(draw(st.integers(0, 1))):  # a blank or comment line
            lines.append(draw(ws) + draw(st.sampled_from(["", f"#{draw(comment_text)}"])))
        t, v, inside = draw(values)
        comment = f"#{draw(comment_text)}" if draw(st.booleans()) else ""
        lines.append(f"{draw(ws)}{draw(key(name))}{draw(ws)}={draw(ws)}{t}{draw(ws)}{comment}")
        data[name] = v
        ok = ok and inside
    if "zz-table" not in names and draw(st.integers(0, 15)) == 7:
        lines.append("[zz-table]\nx = 1")
        ok = False
    text = "\n".join(lines) + draw(st.sampled_from(["", "\n"]))
    if draw(st.integers(0, 4)) == 2:
        # no raw newline is ever inside a string above, so this changes line ends only
        text = text.replace("\n", "\r\n")
    return text, data, ok


@settings(max_examples=300, deadline=None)
@given(documents())
def test_grammar_documents(doc: Document) -> None:
    text, data, inside = doc
    expected = tomllib.loads(text)  # the generator only writes valid TOML
    got = loads(text)
    if inside:
        assert expected == data  # the generator knows what it wrote
        assert got == expected
    else:
        assert got is None


@settings(max_examples=200, deadline=None)
@given(documents(), st.data())
def test_mutated_documents_never_disagree(doc: Document, data: st.DataObject) -> None:
    text = doc[0]
    noise = st.sampled_from([*"\"'\\[]{},=#.\n\r \t_+-01ex:uU", "\x00", "\x7f", "é", '"""'])
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(text)))
        if text and data.draw(st.booleans()):
            text = text[:i] + text[i + 1 :]
        else:
            text = text[:i] + data.draw(noise) + text[i:]
    got = loads(text)
    if got is not None:
        assert got == tomllib.loads(text)  # raising here is a disagreement too


# --- what nvctk itself writes must always take the fast path ---

renderable = st.text(
    st.characters(codec="utf-8", exclude_characters=CTRL), max_size=10
)  # render() writes TOML only for strings without control characters
abs_paths = renderable.map(lambda s: "/" + s)
abs_or_empty = st.one_of(st.just(""), abs_paths)
# valid configs only (parse() checks ranges, absolute paths, non-empty runtimes)
configs = st.builds(
    nvconfig.Config,
    driver_root=abs_paths,
    runtimes=st.lists(renderable.filter(bool), min_size=1, max_size=3).map(tuple),
    hook_path=abs_or_empty,
    hook_timeout=st.integers(*nvconfig.INT_RANGES["hook-timeout"]),
    ldconfig=abs_paths,
    log_file=abs_or_empty,
    log_level=st.sampled_from(nvconfig.LOG_LEVELS),
    accept_envvar_when_unprivileged=st.booleans(),
    accept_volume_mount_devices=st.booleans(),
    supported_capabilities=st.lists(st.sampled_from(nvconfig.ALL_CAPABILITIES)).map(tuple),
    vgpu_library=abs_or_empty,
    state_dir=abs_paths,
    extra_mounts=st.lists(st.builds(nvconfig.ExtraMount, abs_paths, abs_paths, st.booleans()),
                          max_size=3).map(tuple),
)


@settings(max_examples=200, deadline=None)
@given(configs, st.booleans())
def test_rendered_configs_take_the_fast_path(cfg: nvconfig.Config, comments: bool) -> None:
    text = nvconfig.render(cfg, comments)
    got = loads(text)
    assert got is not None
    assert got == tomllib.loads(text)
    assert nvconfig.parse(text, "x") == cfg


def test_default_config_takes_the_fast_path() -> None:
    text = nvconfig.render(nvconfig.Config())
    assert agrees(text) is not None
