"""YAML that nvctk reads from files others wrote (CDI specs, the device plugin's config).

PyYAML's pure loader is quadratic-ish on deep flow nesting ("[" * 3000 took 65 s in
the fuzz suite) and its C loader segfaults on deeper (100000 "["), so flow nesting is
bounded first, by one linear pass at C speed: no real file nests more than a few levels.
Brackets inside strings count too; a string of 64 unbalanced "[" is refused alike.
"""

from __future__ import annotations

import itertools

# typing is for the type checker only
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_FLOW_DEPTH = 64
# "[" and "{" -> 1, "]" and "}" -> -1 (as a signed byte), everything else 0
_DEPTH = bytes(1 if c in b"[{" else 255 if c in b"]}" else 0 for c in range(256))
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def flow_depth(data: bytes) -> int:
    """The deepest [ { nesting of data (brackets in strings included)."""
    steps = data.translate(None, _NOT_BRACKETS).translate(_DEPTH)
    return max(itertools.accumulate(memoryview(steps).cast("b")), default=0)


def load(data: bytes) -> Any:
    """yaml.safe_load(data); ValueError (with a one-line message) for anything that is
    not a YAML document nvctk would take."""
    depth = flow_depth(data)
    if depth > MAX_FLOW_DEPTH:
        raise ValueError(f"nested {depth} levels deep ([ and {{), more than {MAX_FLOW_DEPTH}")
    import yaml

    try:
        return yaml.safe_load(data)
    except yaml.YAMLError as e:
        raise ValueError(f"not valid YAML: {str(e).splitlines()[0] if str(e) else e!r}")
    except RecursionError:
        raise ValueError("nested too deeply")
    except ValueError as e:  # the parser's own (an integer past int()'s digit limit)
        raise ValueError(f"not valid YAML: {str(e)[:200]}")
