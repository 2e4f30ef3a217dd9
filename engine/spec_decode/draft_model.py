"""A draft model proposes: a small checkpoint with the target's tokenizer runs k greedy steps ahead, on its own
paged KV (a ``KVCacheManager`` and ``ModelRunner`` of its own, one block table per sequence it follows).

Its pool has as many blocks as the target's, sized from the same budget (``ResolvedConfig`` counts both models'
K/V per block), and caches prefixes under the same salts, so shared prompts cost it what they cost the target.
It holds blocks only for running sequences: a preempted one is dropped and, once it runs again, caught up
from its cached prefix."""
from __future__ import annotations

import dataclasses

import torch

from engine.config import EngineConfig
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler_output import ScheduledSeq, SchedulerOutput
from engine.resolved_config import ResolvedConfig
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence, SequenceGroup, SequenceStatus


class DraftModelProposer:
    """Greedy proposals (q is one-hot, so the verification's rule is exact). The draft keeps the K/V of each
    sequence's final tokens between steps: a proposal first computes what the sequence gained since (its last
    accepted tokens and the target's token), then one token per step; the K/V of the proposed tokens is rolled
    back (``truncate``) at once, since the target may reject them. A sequence that ended frees its blocks."""

    def __init__(self, config: EngineConfig, target: ResolvedConfig) -> None:
        from engine.distributed.executor import create_executor  # the draft loads as the target does

        sched = target.scheduler
        draft_config = dataclasses.replace(
            config, model=config.speculative_model, tokenizer=None, speculative_method=None, speculative_model=None,
            num_device_blocks=sched.num_device_blocks, num_cpu_blocks=0, max_model_len=sched.max_model_len,
            async_scheduling=False, tensor_parallel_size=1, quantization=None)
        self.config, self.runner = create_executor(draft_config)
        if self.config.model_config.vocab_size > target.model_config.vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.config.model_config.vocab_size}) is larger than "
                             f"the target's ({target.model_config.vocab_size}): not the same tokenizer")
        self.kv = KVCacheManager(sched.num_device_blocks, 0, sched.block_size, sched.enable_prefix_caching,
                                 self.config.scheduler.sliding_window)
        self._followed: dict[int, Sequence] = {}  # seq_id -> the sequence whose final tokens' K/V the draft holds
        self._group = SequenceGroup("draft", [], SamplingParams(temperature=0.0), 0.0)  # greedy: argmax rows only

    def propose(self, seqs: list[Sequence], ks: list[int], salts: list[bytes | None]) -> list[list[int]]:
        live, free = [], self.kv.num_free_blocks
        for i, seq in enumerate(seqs):
            need = self._follow(seq, ks[i], salts[i])
            if need <= free:  # else no proposal this step
                live.append(i)
                free -= need
        proposals: list[list[int]] = [[] for _ in seqs]
        views = {i: Sequence(list(seqs[i].token_ids), seqs[i].num_prompt_tokens) for i in live}
        for step in range(max((ks[i] for i in live), default=0)):
            rows = [i for i in live if ks[i] > step]
            tokens = self._step([(seqs[i], views[i], step) for i in rows])
            for i, token in zip(rows, tokens):
                proposals[i].append(token)
                views[i].token_ids.append(token)
        for i in live:
            self.kv.truncate(seqs[i].seq_id, seqs[i].num_tokens)
        return proposals

    def _follow(self, seq: Sequence, k: int, salt: bytes | None) -> int:
        """Give ``seq`` a block table (with its cached prefix) if it has none; the blocks its catch-up and k
        tokens need."""
        if seq.seq_id not in self.kv.tables:
            hits = self.kv.find_cached_prefix(seq.token_ids, salt)
            self.kv.admit(seq.seq_id, hits, salt, seq.num_tokens)
            self._followed[seq.seq_id] = seq
        return self.kv.num_new_blocks([(seq.seq_id, seq.num_tokens - self.kv.tables[seq.seq_id].num_computed + k)])

    def _step(self, rows: list[tuple[Sequence, Sequence, int]]) -> list[int]:
        """One forward pass: step 0 computes each sequence's new final tokens, step j its j-th proposed token."""
        out = SchedulerOutput()
        for seq, view, step in rows:
            if step == 0:
                # Nothing new since the last proposal (the target did not run it): the last token again.
                start = min(self.kv.tables[seq.seq_id].num_computed, seq.num_tokens - 1)
                self.kv.append(seq.seq_id, seq.num_tokens - start)
                s = ScheduledSeq(group=self._group, seq=view, start=start, num_new_tokens=seq.num_tokens - start,
                                 do_sample=True)
            else:  # slots past the final tokens, given back after the proposal
                self.kv.append(seq.seq_id, step)
                s = ScheduledSeq(group=self._group, seq=view, start=seq.num_tokens + step - 1, num_new_tokens=1,
                                 do_sample=True)
            s.block_table = self.kv.block_ids(seq.seq_id)
            out.scheduled.append(s)
        logits = self.runner.execute(out)
        for seq, view, step in rows:
            if step == 0:
                self.kv.mark_computed(seq.seq_id, seq.num_tokens, seq.token_ids)
        argmax = logits.argmax if logits.argmax is not None else logits.values.argmax(dim=-1)
        return argmax.to(torch.int64).tolist()

    def release_inactive(self) -> None:
        """Free the blocks of sequences that ended or were preempted (their full blocks stay cached)."""
        for seq_id, seq in list(self._followed.items()):
            if seq.status is not SequenceStatus.RUNNING:
                self.kv.free(seq_id)
                del self._followed[seq_id]
