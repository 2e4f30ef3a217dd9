"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each asking request's entries, filled in as its prefill
chunks run and handed out once, with its first output."""
from __future__ import annotations

from engine.core.scheduler_output import SchedulerOutput
from engine.model_runner import PromptLogprobs
from engine.outputs import TokenLogprobs
from engine.sequence import SequenceGroup


class PromptLogprobTracker:
    def __init__(self) -> None:
        self._entries: dict[str, list[TokenLogprobs | None]] = {}  # by request id; entry 0 is None

    def start(self, request_id: str) -> None:
        self._entries[request_id] = [None]

    def record(self, out: SchedulerOutput, rows: PromptLogprobs) -> None:
        """Append the step's prompt rows to their requests' entries. A re-prefill (recompute preemption before
        the first token) starts over: what it recomputes replaces the earlier entries."""
        token, top_ids, top_logprobs = rows.token.tolist(), rows.top_ids.tolist(), rows.top_logprobs.tolist()
        row = 0
        for s in out.scheduled:
            span = s.prompt_logprob_positions()
            entries = self._entries.get(s.group.request_id) if span else None
            if entries is not None:
                k = s.group.params.prompt_logprobs
                del entries[span.start + 1:]
                entries += [[(target, token[r]), *zip(top_ids[r][:k], top_logprobs[r][:k])]
                            for r, target in enumerate(s.seq.token_ids[span.start + 1:span.stop + 1], row)]
            row += len(span)

    def take(self, group: SequenceGroup) -> list[TokenLogprobs | None] | None:
        """The request's entries once complete, handed over once; a request that ends before they are complete
        (aborted, failed) drops them."""
        entries = self._entries.get(group.request_id)
        if entries is None:
            return None
        complete = len(entries) == group.seqs[0].num_prompt_tokens
        if complete or group.is_finished:
            del self._entries[group.request_id]
        return entries if complete else None

    def __bool__(self) -> bool:
        return bool(self._entries)
