"""Record: the base of the small value classes on the container-start path.

Those classes were dataclasses; `import dataclasses` pulls in inspect, ast, dis,
enum and re and every decorated class runs generated code, in both the runtime and
the hook of every GPU container's start (docs/decisions.md has the figures). A Record
subclass lists its fields in `__slots__` and writes its own typed `__init__`;
this base gives it value equality, hashing, a readable repr, `replace` and
`to_dict`, all driven by the slots.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, TypeVar

    R = TypeVar("R", bound="Record")

_FIELDS: dict[type, tuple[str, ...]] = {}


def fields(cls: type) -> tuple[str, ...]:
    """The slots of cls and its Record bases, base first."""
    try:
        return _FIELDS[cls]
    except KeyError:
        names: list[str] = []
        for c in reversed(cls.__mro__):
            slots = c.__dict__.get("__slots__", ())
            names.extend((slots,) if isinstance(slots, str) else slots)
        _FIELDS[cls] = got = tuple(names)
        return got


def plain(value: Any) -> Any:
    """Records, tuples, lists and dicts as JSON-ready dicts and lists."""
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


class Record:
    __slots__ = ()

    def _fill(self, *values: Any) -> None:
        """Set every field, in slot order: a subclass's __init__ whose fields are
        declared as class annotations in one line, not one assignment a field."""
        for k, v in zip(fields(type(self)), values, strict=True):
            object.__setattr__(self, k, v)

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, k) for k in fields(type(self)))

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    # a Record's fields can change: unhashable, as a dataclass with eq and not frozen
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in fields(type(self)))
        return f"{type(self).__name__}({args})"

    def replace(self: R, **changes: Any) -> R:
        """A copy with some fields changed (dataclasses.replace, without re-validation)."""
        new = object.__new__(type(self))
        for k in fields(type(self)):
            object.__setattr__(new, k, changes.pop(k) if k in changes else getattr(self, k))
        if changes:
            raise TypeError(f"{type(self).__name__} has no field(s) {', '.join(changes)}")
        return new

    def to_dict(self) -> dict[str, Any]:
        return {k: plain(getattr(self, k)) for k in fields(type(self))}


class FrozenRecord(Record):
    """A Record whose fields are set once, in __init__ (with object.__setattr__), as a
    frozen dataclass's: such values are hashed and shared, so a change goes through
    replace(). Its __init__ must take the fields positionally, in slot order."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: cannot assign {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable: cannot delete {name!r}")

    def __hash__(self) -> int:  # type: ignore[override]
        return hash((type(self).__name__, *self._values()))

    def __reduce__(self) -> tuple[Any, ...]:
        # copy and pickle would restore the slots with setattr
        return type(self), tuple(getattr(self, k) for k in fields(type(self)))
