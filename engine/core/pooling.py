"""Embeddings of pooling requests (``SequenceGroup.pooling``): each request's pooled rows, added up as its prefill
chunks run, and its vector handed out once, with its one output."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.scheduler_output import SchedulerOutput
from engine.pooling_params import ResolvedPooling
from engine.sequence import SequenceGroup


@dataclass(slots=True)
class _Pooled:
    """A request's pooled rows so far: (first position, sum of the chunk's rows) per chunk run."""

    parts: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    vector: list[float] | None = None  # once the prompt is in


class PoolingTracker:
    def __init__(self) -> None:
        self._pooled: dict[str, _Pooled] = {}  # by request id

    def start(self, request_id: str) -> None:
        self._pooled[request_id] = _Pooled()

    def record(self, out: SchedulerOutput, pooled: torch.Tensor | None) -> list[SequenceGroup]:
        """Add the step's pooled rows to their requests; returns the groups whose prompt is now in (their vector
        ready). A re-prefill (recompute preemption) starts over: its chunks replace those from its position on."""
        done, segment = [], 0
        for s in out.scheduled:
            if s.group.pooling is None:
                continue
            state = self._pooled.get(s.group.request_id)
            if s.group.is_finished:  # aborted meanwhile: its output says so, without a vector
                state = None
            if s.pool_positions():  # the runner pooled a segment for it
                if state is not None:
                    state.parts = [p for p in state.parts if p[0] < s.start] + [(s.start, pooled[segment])]
                segment += 1
            if state is not None and s.start + s.num_new_tokens == s.seq.num_prompt_tokens:
                state.vector = _finish(sum(p[1] for p in state.parts), s.group.pooling, s.seq.num_prompt_tokens)
                done.append(s.group)
        return done

    def take(self, group: SequenceGroup) -> list[float] | None:
        """The request's vector once ready, handed over once; a request that ends before (aborted, failed) drops
        its rows."""
        state = self._pooled.get(group.request_id)
        if state is None or (state.vector is None and not group.is_finished):
            return None
        del self._pooled[group.request_id]
        return state.vector

    def __bool__(self) -> bool:
        return bool(self._pooled)


def _finish(total: torch.Tensor, pooling: ResolvedPooling, num_tokens: int) -> list[float]:
    """Mean (the sum of every position over their count) or the one row; Matryoshka truncation, then the
    L2 normalization (so a truncated vector has unit length again)."""
    vector = total / num_tokens if pooling.pooling == "mean" else total
    if pooling.dimensions is not None:
        vector = vector[:pooling.dimensions]
    if pooling.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector.tolist()
