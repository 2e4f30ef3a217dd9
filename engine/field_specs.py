"""Each config field's valid values, declared once in its metadata (``spec``):
``check_fields`` validates against them, and the service reads the same
metadata for its command-line flags and its API schema."""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints


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
    """A dataclass field; its bounds apply to values other than None."""
    bounds = {"bounds": Bounds(low, high, low_open)} if low is not None or high is not None else {}
    return field(default=default, metadata=metadata | bounds)


def check_fields(obj: Any) -> None:
    """Raises ValueError naming the first field outside its choices or bounds."""
    for f in fields(obj):
        value, allowed = getattr(obj, f.name), choices(type(obj), f.name)
        if allowed and value not in allowed:
            raise ValueError(f"{f.name} must be one of {', '.join(map(str, allowed))}, got {value!r}")
        if (bounds := f.metadata.get("bounds")) is None or value is None:
            continue
        if value_type(type(obj), f.name) is int and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{f.name} must be an integer, got {value!r}")
        if value not in bounds:
            raise ValueError(f"{f.name} must be {bounds.describe()}, got {value}")


@functools.cache
def value_type(cls: type, name: str) -> type:
    """The type of a dataclass field's values, without None: int, float, str, bool or list."""
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
