"""The incremental ``RequestOutput`` of a sequence group: each choice's tokens since it was last reported."""
from __future__ import annotations

import time

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from engine.sequence import Sequence, SequenceGroup


def request_output(group: SequenceGroup, seqs: list[Sequence], error: str | None,
                   prompt_logprobs: list[TokenLogprobs | None] | None, embedding: list[float] | None = None
                   ) -> RequestOutput:
    """The output reporting ``seqs``' news (their new tokens, their finish; a pooling request's vector)."""
    finished = group.is_finished
    if finished:
        group.metrics.finished_time = time.time()
    first = group.seqs[0]
    return RequestOutput(request_id=group.request_id, prompt_token_ids=first.token_ids[:first.num_prompt_tokens],
                         outputs=[delta(group, seq) for seq in seqs], finished=finished, error=error,
                         num_cached_tokens=group.num_cached_tokens, metrics=group.metrics,
                         prompt_logprobs=prompt_logprobs, embedding=embedding)


def with_new_tokens(group: SequenceGroup) -> list[Sequence]:
    """The group's sequences with output tokens not reported yet."""
    return [seq for seq in group.seqs if len(seq.token_ids) - seq.num_prompt_tokens > seq.num_emitted_tokens]


def delta(group: SequenceGroup, seq: Sequence) -> CompletionOutput:
    """``seq``'s tokens since its last report (they count as reported now)."""
    start, seq.num_emitted_tokens = seq.num_emitted_tokens, len(seq.token_ids) - seq.num_prompt_tokens
    wants_logprobs = group.params.logprobs is not None
    return CompletionOutput(
        index=seq.index, token_ids=seq.token_ids[seq.num_prompt_tokens + start:],
        logprobs=seq.logprobs[start:] if wants_logprobs else None,
        cumulative_logprob=seq.cumulative_logprob if wants_logprobs or group.params.use_beam_search else None,
        finish_reason=seq.status.finish_reason)
