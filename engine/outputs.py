"""What the engine hands back: token ids only, text is the caller's business."""
from __future__ import annotations

from dataclasses import dataclass

# One entry per generated token: (token_id, logprob) pairs, the sampled token
# first, then the top alternatives by falling logprob (the sampled token may
# appear again among them).
TokenLogprobs = list[tuple[int, float]]


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class CompletionOutput:
    """One choice. From ``LLMEngine.step`` the lists hold only the tokens new
    since the previous step (a delta); ``LLM.generate`` returns them whole."""

    index: int
    token_ids: list[int]
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    error: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    prompt: str | None = None
    # SamplingParams.prompt_logprobs, on the request's first output only: per prompt token, None for the first,
    # then [(prompt_token_ids[i], logprob), *top k] (as in CompletionOutput.logprobs, the token may recur there).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # A pooling request's (LLMEngine.add_request with PoolingParams) vector, on its one (final) output.
    embedding: list[float] | None = None


# The finish reasons a choice can end with on its own (abort and error end the whole request).
_CHOICE_FINISH_REASONS = (None, "stop", "length")


@dataclass(slots=True)
class ResumeState:
    """What a request already delivered, for ``LLMEngine.add_request(resume=...)``: another engine
    ran it and died. Per choice index: its output tokens so far and its finish reason (None: it
    continues). The logprobs of these tokens are not known: a resumed choice reports logprobs for
    its new tokens only, and its cumulative_logprob sums those alone (it starts from 0)."""

    output_token_ids: list[list[int]]
    finish_reasons: list[str | None]

    def __post_init__(self) -> None:
        if len(self.output_token_ids) != len(self.finish_reasons):
            raise ValueError(f"resume has {len(self.output_token_ids)} token lists and "
                             f"{len(self.finish_reasons)} finish reasons (one of each per choice)")
        bad = [r for r in self.finish_reasons if r not in _CHOICE_FINISH_REASONS]
        if bad:
            raise ValueError(f"resume finish reasons must be None, 'stop' or 'length', got {bad[0]!r}")

    def check(self, n: int) -> None:
        """One entry per choice of a request of ``n``."""
        if len(self.output_token_ids) != n:
            raise ValueError(f"resume has {len(self.output_token_ids)} choices, the request has n={n}")


@dataclass(slots=True)
class BeamSequence:
    """One hypothesis of ``LLM.beam_search``: its generated tokens (eos included when it stopped on one)."""

    token_ids: list[int]
    text: str = ""
    cumulative_logprob: float = 0.0


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSequence]  # best first (by length-penalised score)
