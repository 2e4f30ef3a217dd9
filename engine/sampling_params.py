"""Per-request sampling parameters, validated on construction.

Each numeric field declares its valid range once (``spec``): the validation
here and the service's request parsing and API schema all read it.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.field_specs import check_fields, spec

MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 128


@dataclass(slots=True)
class SamplingParams:
    n: int = spec(1, low=1)
    temperature: float = spec(1.0, low=0)
    top_p: float = spec(1.0, low=0, high=1, low_open=True)
    top_k: int = spec(-1, low=-1)  # -1 (or 0) disables top-k
    min_p: float = spec(0.0, low=0, high=1)
    seed: int | None = spec(None, low=0)  # up to int64
    presence_penalty: float = spec(0.0, low=-2, high=2)
    frequency_penalty: float = spec(0.0, low=-2, high=2)
    repetition_penalty: float = spec(1.0, low=0, low_open=True)
    max_tokens: int | None = spec(16, low=1)  # None: up to the model's context length
    min_tokens: int = spec(0, low=0)
    stop_token_ids: list[int] = spec([], low=0, max_items=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    logprobs: int | None = spec(None, low=0, high=MAX_LOGPROBS)  # top alternatives per token; 0: none

    def __post_init__(self) -> None:
        if self.top_k == 0:
            self.top_k = -1
        self.stop_token_ids = list(self.stop_token_ids)
        check_fields(self)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
