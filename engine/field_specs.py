"""Each config field's valid values, declared once in its metadata (``spec``):
``check_fields`` validates against them, and the service reads the same
metadata for its command-line flags and its API schema."""
from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what msgpack and torch carry: no integer field goes beyond


@dataclass(frozen=True, slots=True)
class Bounds:
    low: int | None = None
    high: int | None = None
    low_open: bool = False  # low itself is out of range

    def __contains__(self, value: float) -> bool:
        above = self.low is None or value > self.low or (value == self.low and not self.low_open)
        return above and (self.high is None or value <= self.high)

    def describe(self) -> str:
        low = f"{'>' if self.low_open else '>='} {self.low}"
        return low if self.high is None else f"in {'(' if self.low_open else '['}{self.low}, {self.high}]"


def spec(default: Any = None, low: int | None = None, high: int | None = None, low_open: bool = False,
         **metadata: Any) -> Any:
    """A dataclass field; its bounds apply to values other than None, and to each item of a list
    (whose length ``max_items`` caps)."""
    metadata |= {"bounds": Bounds(low, high, low_open)} if low is not None or high is not None else {}
    value = {"default_factory": default.copy} if isinstance(default, list) else {"default": default}
    return field(**value, metadata=metadata)


def check_fields(obj: Any) -> None:
    """Raises ValueError naming the first field outside its choices or bounds (floats: finite ones)."""
    for f in fields(obj):
        value, allowed, kind = getattr(obj, f.name), choices(type(obj), f.name), value_type(type(obj), f.name)
        if allowed and value not in allowed:
            raise ValueError(f"{f.name} must be one of {', '.join(map(str, allowed))}, got {value!r}")
        if isinstance(value, list) and len(value) > f.metadata.get("max_items", len(value)):
            raise ValueError(f"{f.name} holds at most {f.metadata['max_items']} items, got {len(value)}")
        for item in value if isinstance(value, list) else [] if value is None else [value]:
            if kind in (int, list) and type(item) is not int:  # bools are not numbers here
                raise ValueError(f"{f.name} must be an integer, got {item!r}")
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"{f.name} must be a finite number, got {item}")
            if (bounds := value_bounds(type(obj), f.name)) is not None and item not in bounds:
                raise ValueError(f"{f.name} must be {bounds.describe()}, got {item}")


@functools.cache
def value_bounds(cls: type, name: str) -> Bounds | None:
    """A field's declared bounds; an integer's (or an integer list's items') open ends stop at int64."""
    b = next(f for f in fields(cls) if f.name == name).metadata.get("bounds")
    if value_type(cls, name) not in (int, list):
        return b
    b = b or Bounds()
    return Bounds(INT64_MIN if b.low is None else b.low, INT64_MAX if b.high is None else b.high, b.low_open)


@functools.cache
def value_type(cls: type, name: str) -> type:
    """The type of a dataclass field's values, without None: int, float, str, bool or list (of int)."""
    hint = get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return type(get_args(hint)[0]) if get_origin(hint) is Literal else get_origin(hint) or hint


@functools.cache
def choices(cls: type, name: str) -> tuple[Any, ...]:
    """A dataclass field's allowed values, from its Literal type or its metadata; () when any goes."""
    hint = get_type_hints(cls)[name]
    declared = next(f for f in fields(cls) if f.name == name).metadata.get("choices", ())
    return get_args(hint) if get_origin(hint) is Literal else declared
