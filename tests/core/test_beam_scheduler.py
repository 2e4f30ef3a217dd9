"""Beam search on the scheduler alone: random next-token distributions, a model of the KV pools,
and after every step each candidate's block table must hold its own tokens (forks, copy-on-write,
swaps and recomputes included), the seat counters must match the groups, and nothing may leak."""
from __future__ import annotations

import pytest
import torch

from engine.beam_search import TopTokens, num_kept
from engine.core.scheduler import _pending_forks
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceGroup, SequenceStatus
from .helpers import KVMemory, make_scheduler, make_seq, sample

VOCAB = 12
SCENARIOS = {
    "roomy": dict(),
    "recompute": dict(num_device_blocks=14, preemption_mode="recompute"),
    "swap": dict(num_device_blocks=14, num_cpu_blocks=14, preemption_mode="swap"),
    "chunked-recompute": dict(num_device_blocks=14, preemption_mode="recompute", max_num_batched_tokens=12,
                              enable_chunked_prefill=True),
}


def beam_group(request_id: str, prompt: list[int], width: int, n: int, max_tokens: int) -> SequenceGroup:
    params = SamplingParams(n=n, best_of=width, use_beam_search=True, temperature=0.0, max_tokens=max_tokens,
                            ignore_eos=True)
    return SequenceGroup(request_id, [make_seq(prompt)], params, 0.0)


def check_invariants(sched, memory: KVMemory) -> None:
    bs = sched.config.block_size
    for group in sched.running.values():
        for seq in group.seqs_with(SequenceStatus.RUNNING):
            table = sched.kv.block_ids(seq.seq_id)
            n = seq.num_computed_tokens
            assert memory.tokens_of(table, n, bs, on_cpu=False) == seq.token_ids[:n]
    running = [g for g in sched.running.values()]
    assert sched._num_running_seqs == sum(len(g.seqs_with(SequenceStatus.RUNNING)) for g in running)
    assert sched._num_pending_forks == sum(_pending_forks(g) for g in running)
    assert sched._num_running_seqs + sched._num_pending_forks <= sched.config.max_num_seqs


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_beam_groups_keep_their_tokens(scenario):
    sched = make_scheduler(max_num_seqs=16, **SCENARIOS[scenario])
    memory, gen = KVMemory(), torch.Generator().manual_seed(0)
    groups = [beam_group(f"b{i}", [(7 * i + j) % VOCAB for j in range(11 + 5 * i)], width, 2, 14)
              for i, width in enumerate((4, 3, 2))]
    plain = SequenceGroup("s", [make_seq(list(range(9)))], SamplingParams(n=2, max_tokens=14, ignore_eos=True), 0.0)
    for group in [*groups, plain]:
        sched.add_group(group)
    steps = 0
    while sched.has_unfinished():
        out = sched.schedule()
        memory.execute(out, sched.config.block_size)
        k = max((num_kept(s.group.params, sched.eos_token_ids) for _, s in out.beam_samples()), default=1)
        sampled = sample(out)
        logprobs = torch.randn(len(out.beam_samples()), VOCAB, generator=gen).log_softmax(-1)
        sampled.beam_tokens = TopTokens.of(logprobs, k)
        sched.update_from_output(out, sampled)
        check_invariants(sched, memory)
        steps += 1
        if steps == 9:
            sched.abort("b1")  # mid-search: its candidates' blocks return at once
            assert not any(s.seq_id in sched.kv.tables for s in groups[1].seqs)
        assert steps < 500
    assert sched.kv.num_free_blocks == sched.kv.num_blocks and not sched.kv.tables
    for group in (groups[0], groups[2]):
        # n best hypotheses, best first, each the full max_tokens long (no eos): distinct token streams.
        assert [s.index for s in group.seqs] == [0, 1]
        assert all(s.status is SequenceStatus.FINISHED_LENGTH and s.num_output_tokens == 14 for s in group.seqs)
        assert group.seqs[0].output_token_ids != group.seqs[1].output_token_ids
        assert group.seqs[0].cumulative_logprob >= group.seqs[1].cumulative_logprob
    if scenario != "roomy":
        assert sched.num_preemptions > 0
