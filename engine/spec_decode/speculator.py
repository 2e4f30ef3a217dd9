"""Which sequences speculate each step, how many tokens, and what is proposed for them.

Before each step the engine asks ``Speculator.propose`` for the running groups: every eligible sequence in decode
(one token without K/V) gets up to k proposed tokens in ``Sequence.draft_token_ids``, which the scheduler moves
onto its decode. After the step ``observe`` adapts each sequence's pace (``Backoff``) to what was accepted.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from engine.config import EngineConfig, SpeculativeConfig
from engine.core.scheduler_output import SchedulerOutput
from engine.resolved_config import ResolvedConfig
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.spec_decode.ngram import NgramProposer

# The most steps a sequence whose proposals keep failing goes without proposals between tries.
_MAX_WAIT = 32


class Proposer(Protocol):
    """Proposes, per sequence, up to ``k`` tokens to follow its tokens (fewer or none is fine). A proposer that
    needs the target's hidden states (EAGLE or Medusa heads) would take them here too; none does yet."""

    def propose(self, seqs: list[Sequence], ks: list[int], salts: list[bytes | None]) -> list[list[int]]:
        """``salts``: each sequence's prefix-cache salt (a proposer that caches K/V keeps tenants apart)."""

    def release_inactive(self) -> None:
        """Drop what it keeps for sequences that ended or were preempted (after each step)."""


@dataclass(slots=True)
class Backoff:
    """A sequence's proposal pace: ``k`` tokens next, one more than last accepted (at most the configured k).
    A verification that accepts nothing drops it to one token after ``wait`` steps without proposals, and the
    wait doubles with each such failure (up to ``_MAX_WAIT``), so text that never repeats costs almost nothing:
    each failed try verifies one extra token, ever more rarely."""

    k: int
    skip: int = 0
    wait: int = 2

    def next_k(self) -> int:
        if self.skip:
            self.skip -= 1
            return 0
        return self.k

    def observe(self, num_accepted: int, k_max: int) -> None:
        if num_accepted:
            self.k, self.wait = min(k_max, num_accepted + 1), 2
        else:
            self.k, self.skip, self.wait = 1, self.wait, min(2 * self.wait, _MAX_WAIT)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.proposer = proposer
        self.max_model_len = max_model_len
        self._proposed: list[Sequence] = []

    @staticmethod
    def eligible(group: SequenceGroup) -> bool:
        """Whether the request speculates: it did not opt out, and no grammar or beam search needs each token
        before the next is proposed."""
        p = group.params
        return p.use_speculation and group.beam is None and p.structured_output is None

    def propose(self, groups: Iterable[SequenceGroup]) -> None:
        seqs, ks, salts = [], [], []
        for group in groups:
            if not self.eligible(group) or len(group.seqs) < group.params.n:  # forks pending share one row
                continue
            for seq in group.seqs:
                if seq.status is SequenceStatus.RUNNING and seq.num_tokens - seq.num_computed_tokens == 1:
                    k = self._num_tokens(group, seq)
                    if k > 0:
                        seqs.append(seq)
                        ks.append(k)
                        salts.append(group.cache_salt)
        if seqs:
            for seq, k, drafts in zip(seqs, ks, self.proposer.propose(seqs, ks, salts), strict=True):
                seq.draft_token_ids = list(drafts[:k])
        self._proposed = seqs

    def _num_tokens(self, group: SequenceGroup, seq: Sequence) -> int:
        """This step's k: the sequence's pace, and no token past max_tokens or max_model_len (a verification
        that accepts everything emits k + 1 tokens)."""
        if seq.backoff is None:
            seq.backoff = Backoff(self.k)
        k = min(seq.backoff.next_k(), self.max_model_len - seq.num_tokens - 1)
        if group.params.max_tokens is not None:
            k = min(k, group.params.max_tokens - seq.num_output_tokens - 1)
        return k

    def discard_unscheduled(self) -> None:
        """Proposals the scheduler did not take (budget, preemption) are for this step only."""
        for seq in self._proposed:
            seq.draft_token_ids = []
        self._proposed = []

    def observe(self, out: SchedulerOutput) -> None:
        """After ``out``'s outputs: each verified sequence's pace, and the proposer's state of ended ones."""
        for s in out.scheduled:
            if s.draft_token_ids and s.seq.backoff is not None:
                s.seq.backoff.observe(s.num_accepted, self.k)
        self.proposer.release_inactive()


def make_speculator(config: EngineConfig, resolved: ResolvedConfig) -> Speculator | None:
    """The engine's speculator, None when ``config`` does not speculate."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        proposer: Proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    else:
        from engine.spec_decode.draft_model import DraftModelProposer  # loads a model: only when asked for

        proposer = DraftModelProposer(config, resolved)
    return Speculator(spec, proposer, resolved.scheduler.max_model_len)
