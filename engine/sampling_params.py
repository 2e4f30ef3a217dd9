"""Per-request sampling parameters, validated on construction.

Each numeric field declares its valid range once, as ``Bounds`` in the field's
metadata: the validation below and the service's API schema both read it.
"""
from __future__ import annotations

import types
from dataclasses import Field, dataclass, field, fields
from typing import Any, get_args, get_type_hints

MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Bounds:
    low: int | None = None
    high: int | None = None
    low_open: bool = False  # low itself is out of range
    text: str = ""  # the range in words, where low/high alone would mislead

    def __contains__(self, value: float) -> bool:
        above = self.low is None or value > self.low or (value == self.low and not self.low_open)
        return above and (self.high is None or value <= self.high)

    def describe(self) -> str:
        if self.text:
            return self.text
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}]"


def _bounded(default: Any, low: int | None = None, high: int | None = None, low_open: bool = False,
             text: str = "") -> Any:
    return field(default=default, metadata={"bounds": Bounds(low, high, low_open, text)})


@dataclass(slots=True)
class SamplingParams:
    n: int = _bounded(1, low=1)
    temperature: float = _bounded(1.0, low=0)
    top_p: float = _bounded(1.0, low=0, high=1, low_open=True)
    top_k: int = _bounded(-1, low=-1, text="-1 (disabled) or >= 1")  # 0 also disables, read as -1
    min_p: float = _bounded(0.0, low=0, high=1)
    seed: int | None = _bounded(None, low=0, high=MAX_SEED)
    presence_penalty: float = _bounded(0.0, low=-2, high=2)
    frequency_penalty: float = _bounded(0.0, low=-2, high=2)
    repetition_penalty: float = _bounded(1.0, low=0, low_open=True)
    max_tokens: int | None = _bounded(16, low=1)  # None: up to the model's context length
    min_tokens: int = _bounded(0, low=0)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Number of top alternatives per token; 0 = sampled token only.
    logprobs: int | None = _bounded(None, low=0, high=MAX_LOGPROBS)

    def __post_init__(self) -> None:
        if self.top_k == 0:
            self.top_k = -1
        for f in fields(self):
            if "bounds" in f.metadata:
                _check(f, getattr(self, f.name))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")
        self.stop_token_ids = list(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def value_type(name: str) -> type:
    """A field's type without its ``None``: int, float, bool or list."""
    hint = _HINTS[name]
    if isinstance(hint, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return getattr(hint, "__origin__", hint)


def _check(f: Field, value: Any) -> None:
    if value is None:
        return
    if value_type(f.name) is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"{f.name} must be an integer, got {value!r}")
    bounds: Bounds = f.metadata["bounds"]
    if value not in bounds:
        raise ValueError(f"{f.name} must be {bounds.describe()}, got {value}")


_HINTS = get_type_hints(SamplingParams)
