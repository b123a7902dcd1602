"""YAML that nvctk reads from files others wrote (CDI specs, the device plugin's config).

PyYAML's pure loader is slow on deep flow nesting ("[" * 3000 took 65 s in the fuzz
suite) and its C loader segfaults on deeper (100000 "["), so nesting is bounded first,
by linear passes at C speed: flow nesting by brackets, block nesting by indentation.
No real file nests more than a few levels; brackets inside strings count too (a string
of 64 unbalanced "[" is refused alike). Within those bounds the C loader (libyaml) is
safe and 4x faster, so it is used where PyYAML has it.
"""

from __future__ import annotations

import itertools
import re

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_FLOW_DEPTH = 64
MAX_INDENT = 256  # columns: block nesting is at most this deep
_DEEP_INDENT = re.compile(rb"^[ \t]{%d}" % (MAX_INDENT + 1), re.M)
# "- - - x": block sequences nested on one line, with no indentation to show it
_COMPACT = re.compile(rb"(?:[-?][ \t]+){%d}" % (MAX_FLOW_DEPTH + 1))
# "[" and "{" -> 1, "]" and "}" -> -1 (as a signed byte), everything else 0
_DEPTH = bytes(1 if c in b"[{" else 255 if c in b"]}" else 0 for c in range(256))
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def flow_depth(data: bytes) -> int:
    """The deepest [ { nesting of data (brackets in strings included)."""
    steps = data.translate(None, _NOT_BRACKETS).translate(_DEPTH)
    return max(0, max(itertools.accumulate(memoryview(steps).cast("b")), default=0))


def load(data: bytes) -> Any:
    """yaml.safe_load(data); ValueError (with a one-line message) for anything that is
    not a YAML document nvctk would take."""
    depth = flow_depth(data)
    if depth > MAX_FLOW_DEPTH:
        raise ValueError(f"nested {depth} levels deep ([ and {{), more than {MAX_FLOW_DEPTH}")
    if _DEEP_INDENT.search(data) or _COMPACT.search(data):
        raise ValueError(f"nested too deeply (a line indented more than {MAX_INDENT} columns, "
                         f"or over {MAX_FLOW_DEPTH} sequences opened on one line)")
    import yaml  # start time: yaml (+ typing) only for a YAML document

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        return yaml.load(data, Loader=loader)
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML: {str(e).splitlines()[0] if str(e) else e!r}")
    except RecursionError:
        raise ValueError("nested too deeply")
    except ValueError as e:  # the parser's own (an integer past int()'s digit limit)
        raise ValueError(f"not valid YAML: {str(e)[:200]}")
