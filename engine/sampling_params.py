"""Per-request sampling parameters, validated on construction.

Each numeric field declares its valid range once (``spec``): the validation
here and the service's request parsing and API schema all read it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from engine.field_specs import check_fields, spec
from engine.structured_output import StructuredOutputParams

MAX_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 128
MAX_LOGIT_BIAS = 1024
# Fields beam search takes only at their defaults: its step scores raw log-probabilities (divided by the
# temperature), so no sampling filter, penalty or output constraint applies.
FIXED_BY_BEAM_SEARCH = ("top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                        "min_tokens", "logprobs", "prompt_logprobs", "structured_output", "logit_bias")


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
    # Each prompt token's logprob and its top alternatives (vLLM's; None: off), on the request's first output.
    prompt_logprobs: int | None = spec(None, low=0, high=MAX_LOGPROBS)
    # A grammar the output must follow (a dict, the wire form, is converted).
    structured_output: StructuredOutputParams | None = None
    # Token id -> bias in [-100, 100] added to the logits; a list of [id, bias] pairs (the wire form) is converted.
    logit_bias: dict[int, float] | None = None
    # Beam search (vLLM's former API): best_of (default n) candidates, the n best hypotheses returned.
    use_beam_search: bool = False
    best_of: int | None = spec(None, low=1)
    length_penalty: float = spec(1.0)  # a hypothesis scores cumulative logprob / length ** length_penalty
    early_stopping: bool | str = spec(False, choices=(True, False, "never"))  # transformers' semantics
    # False: no speculative decoding for this request (its tokens come one per step) when the engine speculates.
    use_speculation: bool = True

    def __post_init__(self) -> None:
        if self.top_k == 0:
            self.top_k = -1
        self.stop_token_ids = list(self.stop_token_ids)
        check_fields(self)
        if isinstance(self.structured_output, dict):
            self.structured_output = StructuredOutputParams.from_wire(self.structured_output)
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.use_beam_search:
            self._check_beam_search()
        elif self.best_of not in (None, self.n):
            raise ValueError("best_of different from n needs use_beam_search")

    def _check_beam_search(self) -> None:
        if self.n > self.beam_width:
            raise ValueError(f"n ({self.n}) must be <= best_of, the beam width ({self.beam_width})")
        defaults = {f.name: f.default for f in fields(self)}
        unsupported = [name for name in FIXED_BY_BEAM_SEARCH if getattr(self, name) != defaults[name]]
        if unsupported:
            raise ValueError(f"{unsupported[0]} is not supported with use_beam_search")

    @property
    def beam_width(self) -> int:
        """Live candidates of a beam search (best_of, default n); 1 without beam search."""
        return (self.best_of or self.n) if self.use_beam_search else 1

    @property
    def num_seqs(self) -> int:
        """Sequences the request runs at once: its n samples or its beam candidates."""
        return self.beam_width if self.use_beam_search else self.n

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def argmax_only(self) -> bool:
        """The next token is the raw logits' argmax and nothing else of the logits is read: greedy, no
        penalties, no min_tokens mask, no logprobs, no beam search."""
        return (self.greedy and self.logprobs is None and self.prompt_logprobs is None and not self.use_beam_search
                and not self.min_tokens and not self.presence_penalty and not self.frequency_penalty
                and self.repetition_penalty == 1.0 and self.structured_output is None and not self.logit_bias)


def _check_logit_bias(bias: dict | list) -> dict[int, float]:
    pairs = bias.items() if isinstance(bias, dict) else bias
    try:
        result = {int(t): float(b) for t, b in pairs}
    except (TypeError, ValueError):
        raise ValueError("logit_bias must map token ids to numbers") from None
    if len(result) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(result)} entries, at most {MAX_LOGIT_BIAS} are allowed")
    if any(t < 0 for t in result) or any(not -100 <= b <= 100 for b in result.values()):
        raise ValueError("logit_bias token ids must be >= 0 and biases in [-100, 100]")
    return result


@dataclass(slots=True)
class BeamSearchParams:
    """Offline beam search (``LLM.beam_search``, vLLM-shaped): every one of the ``beam_width``
    best hypotheses is returned, with transformers' ``length_penalty`` / ``early_stopping``."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False
    temperature: float = 0.0

    def to_sampling_params(self) -> SamplingParams:
        """The request the engine runs (validated there)."""
        return SamplingParams(n=self.beam_width, use_beam_search=True, max_tokens=self.max_tokens,
                              length_penalty=self.length_penalty, early_stopping=self.early_stopping,
                              ignore_eos=self.ignore_eos, temperature=self.temperature)
