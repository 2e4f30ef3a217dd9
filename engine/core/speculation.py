"""Speculative decoding, the scheduler's side: which running sequences speculate and how many tokens each (its
pace), and the verification of a step's drafts. The proposers (``engine/spec_decode``) only propose."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.kv_allocator import KVAllocator
from engine.core.scheduler_output import ScheduledSeq
from engine.sequence import Sequence, SequenceGroup, SequenceStatus

# The most steps a sequence whose proposals keep failing goes without proposals between tries.
_MAX_WAIT = 32


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


@dataclass(slots=True)
class SpecTarget:
    """A sequence to propose for: up to ``k`` tokens; ``salt`` keeps a caching proposer's tenants apart."""

    seq: Sequence
    k: int
    salt: bytes | None


class Speculation:
    def __init__(self, k: int, max_model_len: int | None) -> None:
        self.k = k
        self.max_model_len = max_model_len
        self._paces: dict[int, Backoff] = {}  # by seq_id, until the sequence finishes (``forget``)
        self.num_drafts = 0  # verifications: steps of a sequence with drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @staticmethod
    def eligible(group: SequenceGroup) -> bool:
        """Whether the request speculates: it did not opt out, and no grammar or beam search needs each token
        before the next is proposed."""
        p = group.params
        return p.use_speculation and not p.use_beam_search and p.structured_output is None

    def targets(self, running: Iterable[SequenceGroup]) -> list[SpecTarget]:
        """Every eligible running sequence in decode (one token without K/V) with its k for this step."""
        targets = []
        for group in running:
            if not self.eligible(group) or len(group.seqs) < group.params.n:  # forks pending share one row
                continue
            for seq in group.seqs:
                if seq.status is SequenceStatus.RUNNING and seq.num_tokens - seq.num_computed_tokens == 1:
                    k = self._num_tokens(group, seq)
                    if k > 0:
                        targets.append(SpecTarget(seq, k, group.cache_salt))
        return targets

    def _num_tokens(self, group: SequenceGroup, seq: Sequence) -> int:
        """This step's k: the sequence's pace, and no token past max_tokens or max_model_len (a verification
        that accepts everything emits k + 1 tokens)."""
        pace = self._paces.get(seq.seq_id)
        if pace is None:
            pace = self._paces[seq.seq_id] = Backoff(self.k)
        k = pace.next_k()
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - seq.num_tokens - 1)
        if group.params.max_tokens is not None:
            k = min(k, group.params.max_tokens - seq.num_output_tokens - 1)
        return k

    def forget(self, seq_id: int) -> None:
        """The sequence finished: its pace goes."""
        self._paces.pop(seq_id, None)

    def verify(self, samples: list[tuple[int, ScheduledSeq, Sequence]], tokens: list[int], kv: KVAllocator) -> None:
        """Each verification keeps its drafts up to the first one the target's own token at that position
        differs from (that token replaces it; all accepted, the last row's token is a bonus); the rejected
        drafts' slots are given back, and the sequence's pace follows what was accepted."""
        i = 0
        while i < len(samples):
            s = samples[i][1]
            drafts = s.draft_token_ids
            if not drafts:
                i += 1
                continue
            accepted = 0
            while accepted < len(drafts) and tokens[i + accepted] == drafts[accepted]:
                accepted += 1
            s.num_accepted = accepted
            if s.seq.status is SequenceStatus.RUNNING:
                kv.truncate(s.seq.seq_id, s.start + 1 + accepted)
            if (pace := self._paces.get(s.seq.seq_id)) is not None:
                pace.observe(accepted, self.k)
            self.num_drafts += 1
            self.num_draft_tokens += len(drafts)
            self.num_accepted_tokens += accepted
            i += len(drafts) + 1
