"""nvctk.base.record.Record: value semantics driven by __slots__."""

from __future__ import annotations

import copy
import pickle

import pytest

from nvctk.base.record import FrozenRecord, Record, fields


class Point(Record):
    __slots__ = ("x", "y")

    def __init__(self, x: int, y: int = 0) -> None:
        self.x = x
        self.y = y


class Labelled(Point):
    __slots__ = ("label", "tags")

    def __init__(self, x: int, y: int, label: str, tags: tuple[Point, ...] = ()) -> None:
        super().__init__(x, y)
        self.label = label
        self.tags = tags


def test_fields_are_the_slots_base_first() -> None:
    assert fields(Point) == ("x", "y")
    assert fields(Labelled) == ("x", "y", "label", "tags")


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        (Point(1, 2), Point(1, 2), True),
        (Point(1, 2), Point(1, 3), False),
        (Point(1, 2), Labelled(1, 2, ""), False),  # another class is never equal
        (Labelled(1, 2, "a", (Point(0),)), Labelled(1, 2, "a", (Point(0),)), True),
    ],
)
def test_equality_and_no_hash(a: Record, b: Record, equal: bool) -> None:
    """Equal by value; a mutable record is unhashable (its hash could change under a
    dict or set holding it), as a dataclass with eq=True and frozen=False."""
    assert (a == b) is equal
    with pytest.raises(TypeError, match="unhashable"):
        hash(a)


def test_repr_names_every_field() -> None:
    assert repr(Point(1, 2)) == "Point(x=1, y=2)"


def test_replace_copies_and_changes() -> None:
    p = Labelled(1, 2, "a")
    q = p.replace(label="b")
    assert (q.x, q.y, q.label) == (1, 2, "b") and p.label == "a"
    with pytest.raises(TypeError, match="no field"):
        p.replace(z=1)


def test_to_dict_is_json_ready() -> None:
    d = Labelled(1, 2, "a", (Point(3, 4),)).to_dict()
    assert d == {"x": 1, "y": 2, "label": "a", "tags": [{"x": 3, "y": 4}]}


def test_slots_reject_unknown_attributes() -> None:
    with pytest.raises(AttributeError):
        Point(1).z = 3  # type: ignore[attr-defined]


class Frozen(FrozenRecord):
    __slots__ = ("a", "b")

    def __init__(self, a: int, b: tuple[int, ...] = ()) -> None:
        object.__setattr__(self, "a", a)
        object.__setattr__(self, "b", b)


def test_frozen_record_cannot_change_but_can_be_replaced_copied_pickled() -> None:
    f = Frozen(1, (2,))
    with pytest.raises(AttributeError, match="immutable"):
        f.a = 2  # type: ignore[misc]
    with pytest.raises(AttributeError, match="immutable"):
        del f.a  # type: ignore[misc]
    assert f.replace(a=3) == Frozen(3, (2,))
    assert copy.deepcopy(f) == f and pickle.loads(pickle.dumps(f)) == f
    assert hash(f) == hash(Frozen(1, (2,))) and {f, Frozen(1, (2,))} == {f}
