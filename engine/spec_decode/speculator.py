"""The proposing stage of speculative decoding: before each step the engine asks the scheduler which sequences
speculate and how many tokens (``Scheduler.speculation_targets``), the proposer proposes, and the scheduler
attaches the proposals to their decodes (``Scheduler.schedule(drafts)``); ``update_from_output`` verifies them.
"""
from __future__ import annotations

import time
from typing import Protocol

from engine.config import EngineConfig
from engine.core.speculation import SpecTarget
from engine.resolved_config import ResolvedConfig
from engine.sequence import Sequence
from engine.spec_decode.ngram import NgramProposer


class Proposer(Protocol):
    """Proposes, per sequence, up to ``k`` tokens to follow its tokens (fewer or none is fine). A proposer that
    needs the target's hidden states (EAGLE or Medusa heads) would take them here too; none does yet."""

    def propose(self, seqs: list[Sequence], ks: list[int], salts: list[bytes | None]) -> list[list[int]]:
        """``salts``: each sequence's prefix-cache salt (a proposer that caches K/V keeps tenants apart)."""

    def release_inactive(self) -> None:
        """Drop what it keeps for sequences that ended or were preempted."""


class Speculator:
    def __init__(self, proposer: Proposer) -> None:
        self.proposer = proposer
        self.propose_seconds = 0.0
        self.verify_seconds = 0.0  # from scheduling a step with drafts to its outputs

    def propose(self, targets: list[SpecTarget]) -> dict[int, list[int]]:
        """Each target's proposed tokens (at most its k), by seq_id; first, what the proposer keeps for
        sequences that ended or were preempted is dropped."""
        started = time.perf_counter()
        self.proposer.release_inactive()
        drafts = {}
        if targets:
            proposals = self.proposer.propose([t.seq for t in targets], [t.k for t in targets],
                                              [t.salt for t in targets])
            drafts = {t.seq.seq_id: list(d[:t.k]) for t, d in zip(targets, proposals, strict=True) if d}
        self.propose_seconds += time.perf_counter() - started
        return drafts


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
    return Speculator(proposer)
