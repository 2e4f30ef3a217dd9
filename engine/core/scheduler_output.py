"""The one plain object ``Scheduler.schedule()`` returns to the model runner."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.core.state_cache import StateMove, StateStep
from engine.sequence import DraftView, Sequence, SequenceGroup


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of this step.

    The runner computes K/V for tokens ``[start, start + num_new_tokens)`` of
    ``seq.token_ids`` (positions equal indices); ``block_table`` already has
    room for them. ``do_sample`` is true when, after this step, every known
    token has K/V, so the last position's logits pick the next token (false for
    the non-final chunks of a chunked prefill). ``forks`` are the children a
    group of n > 1 samples forks once its prompt is in: they share its blocks
    and draw their first tokens from this sequence's logits.

    Speculative decoding: a decode may carry ``draft_token_ids``, proposed to follow its last token; they are the
    step's last tokens (counted in ``num_new_tokens``, their slots claimed) and each position gets logits, so the
    step verifies them. ``num_accepted`` drafts survive (``Scheduler.update_from_output``); the rest roll back.
    """

    group: SequenceGroup
    seq: Sequence
    start: int
    num_new_tokens: int
    do_sample: bool
    block_table: list[int] = field(default_factory=list)
    forks: tuple[Sequence, ...] = ()
    draft_token_ids: tuple[int, ...] = ()
    num_accepted: int = 0
    state: StateStep | None = None  # a hybrid model's state slot (and snapshot to save) this step

    def prompt_logprob_positions(self) -> range:
        """This chunk's positions whose logits score the next prompt token (``SamplingParams.prompt_logprobs``):
        position p gives prompt token p + 1's logprob. Usually empty."""
        end = min(self.start + self.num_new_tokens, self.seq.num_prompt_tokens - 1)
        if self.start >= end or not wants_prompt_logprobs(self.group, self.seq):
            return range(0)
        return range(self.start, end)

    def pool_positions(self) -> range:
        """This chunk's positions a pooling request (``group.pooling``) pools: every one for mean pooling, the
        prompt's last for last-token pooling, position 0 for CLS. Empty for other requests."""
        pooling, end = self.group.pooling, self.start + self.num_new_tokens
        if pooling is None:
            return range(0)
        if pooling.pooling == "mean":
            return range(self.start, end)
        if pooling.pooling == "last":
            return range(end - 1, end) if end == self.seq.num_prompt_tokens else range(0)
        return range(0, 1) if self.start == 0 else range(0)


def wants_prompt_logprobs(group: SequenceGroup, seq: Sequence) -> bool:
    """Whether ``seq``'s prefill computes its request's prompt logprobs: the request asked, this is its first
    choice and it has no output yet. They go out once, with the first output: a re-prefill after tokens were
    sampled (recompute preemption, or a resumed request that had delivered tokens) does not compute them again."""
    return group.params.prompt_logprobs is not None and seq.index == 0 and seq.num_tokens == seq.num_prompt_tokens


@dataclass(slots=True)
class TokenMask:
    """A step's constrained logits rows and their allowed tokens: xgrammar's int32 bitmask, a row each (bit
    ``j % 32`` of word ``j // 32`` set when token ``j`` is allowed). The sampler applies it (cuda_ext's
    ``masked_row_argmax`` / ``apply_token_bitmask``)."""

    rows: list[int]
    bitmask: torch.Tensor


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    # (src, dst) device block ids; copy-on-write copies, one block each.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # (device block, cpu block) to copy device -> cpu before the forward pass.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (cpu block, device block) to copy cpu -> device before the forward pass.
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # A hybrid model's state moves (forks, snapshot restores, swaps), in order, before the forward pass.
    state_moves: list[StateMove] = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    # Groups the scheduler finished with FINISHED_ERROR (reason in group.error):
    # they can never run (too long for max_model_len, the token budget or the pool).
    failed: list[SequenceGroup] = field(default_factory=list)
    num_draft_tokens: int = 0  # proposed tokens the step verifies (speculative decoding)
    # The constrained rows' allowed tokens (structured output), set once scheduling is over; read by the sampler.
    token_mask: TokenMask | None = None
    # samples() and beam_samples(), built once: the engine (to sample) and update_from_output (to record)
    # both walk them.
    _samples: list[tuple[int, ScheduledSeq, Sequence]] | None = field(default=None, repr=False)
    _beam_samples: list[tuple[int, ScheduledSeq]] = field(default_factory=list, repr=False)

    def samples(self) -> list[tuple[int, ScheduledSeq, Sequence]]:
        """(logits row, scheduled seq, sequence) per token to draw, in the sampler's order: the ``do_sample``
        sequences' rows in schedule order, a row shared by the children it forks, a verification's 1 + k rows
        consecutive (its draft rows' sequence a ``DraftView``). Beam candidates are not drawn
        (``beam_samples``). Call it once scheduling is over (the list is kept)."""
        if self._samples is None:
            self._samples = []
            row = 0
            for s in self.scheduled:
                if not s.do_sample:
                    continue
                if s.group.params.use_beam_search:
                    self._beam_samples.append((row, s))
                elif s.draft_token_ids:
                    drafts = s.draft_token_ids
                    self._samples.append((row, s, s.seq))
                    self._samples += [(row + j, s, DraftView(s.seq, drafts[:j])) for j in range(1, len(drafts) + 1)]
                    row += len(drafts)
                else:
                    self._samples.append((row, s, s.seq))
                    self._samples += [(row, s, child) for child in s.forks]
                row += 1
        return self._samples

    def beam_samples(self) -> list[tuple[int, ScheduledSeq]]:
        """(logits row, scheduled seq) per beam candidate whose next-token distribution is due."""
        self.samples()
        return self._beam_samples

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not (self.scheduled or self.blocks_to_copy or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or self.state_moves)
