"""Requests as the scheduler sees them: sequence groups of sequences.

Core records only: a feature's per-request state (a beam search, a speculation pace, a grammar matcher) lives in
that feature's own map, keyed by request or sequence id, never here."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from engine.multimodal.block_keys import ImageBlockKeys
from engine.multimodal.inputs import MultiModalInputs
from engine.outputs import RequestMetrics, TokenLogprobs
from engine.pooling_params import ResolvedPooling
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its structured-output grammar compiles (vLLM's WAITING_FOR_FSM)
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    # By value: an Enum member hashes through Python code (Enum.__hash__), a str in C; these run per
    # sequence per step.
    @property
    def finished(self) -> bool:
        return self._value_ in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self._value_ if self._value_ in _FINISHED else None


_FINISHED = frozenset(s.value for s in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                                         SequenceStatus.FINISHED_ABORTED, SequenceStatus.FINISHED_ERROR))
_seq_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Sequence:
    """One token stream. ``token_ids`` holds prompt then output tokens;
    ``num_computed_tokens`` counts the prefix whose K/V is in the cache."""

    token_ids: list[int]
    num_prompt_tokens: int
    index: int = 0  # choice index within its group (n > 1)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_emitted_tokens: int = 0  # output tokens already returned by LLMEngine.step
    seq_id: int = field(default_factory=_seq_ids.__next__)  # unique in the process: keys the KV block tables

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_prefill(self) -> bool:
        """True while more than one known token still lacks K/V."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None) -> None:
        self.token_ids.append(token_id)
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[0][1]  # the sampled token's

    def fork(self, index: int) -> Sequence:
        """A new sequence with this one's tokens, choice ``index`` of its group."""
        return Sequence(list(self.token_ids), self.num_prompt_tokens, index)

    def reset_for_recompute(self) -> None:
        """Recompute preemption: the K/V is dropped, tokens are kept."""
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING


@dataclass(slots=True, frozen=True)
class DraftView:
    """What the sampler reads of ``seq`` as if ``drafts`` followed its tokens: a verification row's penalties,
    min_tokens mask and seeded noise see exactly the tokens before its position, as without speculation."""

    seq: Sequence
    drafts: tuple[int, ...]

    @property
    def index(self) -> int:
        return self.seq.index

    @property
    def num_prompt_tokens(self) -> int:
        return self.seq.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + list(self.drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + list(self.drafts)

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + len(self.drafts)


@dataclass(slots=True, eq=False)
class SequenceGroup:
    """One request: its n sequences share the prompt (and its blocks). A beam search's
    sequences are its live candidates, then, once it is over, its best hypotheses."""

    request_id: str
    seqs: list[Sequence]
    params: SamplingParams
    arrival_time: float
    # extra prefix-hash key (tenant isolation); with images their ImageBlockKeys (engine/multimodal/block_keys.py)
    cache_salt: bytes | ImageBlockKeys | None = None
    priority: int = 0  # lower runs first (vLLM's convention); equal priorities are served in arrival order
    rank: tuple[int, int] = (0, 0)  # (priority, arrival index): the scheduler's order, set by it on arrival
    metrics: RequestMetrics = None  # type: ignore[assignment]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # why the scheduler failed it (FINISHED_ERROR)
    pooling: ResolvedPooling | None = None  # an embedding request: its prompt's prefill only, no tokens
    multimodal: MultiModalInputs | None = None  # its images and M-RoPE positions (engine/multimodal)

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def prompt_token_ids(self) -> list[int]:
        first = self.seqs[0]
        return first.token_ids[: first.num_prompt_tokens]

    def seqs_with(self, status: SequenceStatus) -> list[Sequence]:
        return [s for s in self.seqs if s.status is status]

    def unfinished_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.status.finished]

    @property
    def is_finished(self) -> bool:
        return all(s.status.finished for s in self.seqs)
