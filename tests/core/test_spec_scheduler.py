"""The scheduler's side of speculative decoding: proposed tokens share the token budget, are verified against
the sampled tokens, and roll back; they are dropped rather than preempt anyone."""
from engine.sampler import SamplerOutput

from .helpers import check_kv_invariants, make_group, make_scheduler, run_step


def _started(sched, *prompts: list[int]) -> list:
    """The groups of ``prompts``, prefilled and each with its first token."""
    groups = [make_group(str(i), p) for i, p in enumerate(prompts)]
    for group in groups:
        sched.add_group(group)
    run_step(sched)
    return [g.seqs[0] for g in groups]


def test_drafts_share_the_budget_and_only_accepted_ones_stay():
    sched = make_scheduler(max_num_batched_tokens=8, block_size=8)
    a, b = _started(sched, [1, 2, 3], [4, 5, 6])
    out = sched.schedule({a.seq_id: [10, 11, 12, 13, 14], b.seq_id: [20, 21, 22]})
    assert [(s.num_new_tokens, s.draft_token_ids) for s in out.scheduled] == [(6, (10, 11, 12, 13, 14)), (2, (20,))]
    # a: the target agrees on two drafts, then says 99; b: disagrees at once.
    tokens = [10, 11, 99, 0, 0, 0] + [30, 0]
    sched.update_from_output(out, SamplerOutput(tokens, [None] * len(tokens)))
    assert a.output_token_ids[-3:] == [10, 11, 99] and b.output_token_ids[-1] == 30
    assert [s.num_accepted for s in out.scheduled] == [2, 0]
    for seq in (a, b):
        assert seq.num_computed_tokens == seq.num_tokens - 1
        assert sched.kv.tables[seq.seq_id].num_slots == seq.num_computed_tokens
    check_kv_invariants(sched.kv)
    stats = sched.stats()
    assert (stats.spec_decode_num_drafts_total, stats.spec_decode_num_draft_tokens_total,
            stats.spec_decode_num_accepted_tokens_total) == (2, 6, 2)
    assert stats.spec_decode_mean_accepted_length == 2.0


def test_drafts_are_dropped_before_anyone_is_preempted():
    sched = make_scheduler(num_device_blocks=2, block_size=8)
    a, b = _started(sched, [1, 2, 3, 4, 5, 6], [3, 4, 5, 6, 7, 8])
    out = sched.schedule({a.seq_id: [10, 11, 12, 13]})  # would need a second block for a: none is free
    assert not out.preempted and [(s.num_new_tokens, s.draft_token_ids) for s in out.scheduled] == [(1, ()), (1, ())]


def test_a_stop_among_accepted_tokens_ends_the_sequence_there():
    sched = make_scheduler(block_size=8)
    (a,) = _started(sched, [1, 2, 3])
    sched.running["0"].params.stop_token_ids = [11]
    out = sched.schedule({a.seq_id: [10, 11, 12]})
    sched.update_from_output(out, SamplerOutput([10, 11, 12, 13], [None] * 4))
    assert a.output_token_ids[-2:] == [10, 11] and a.is_finished
    assert sched.kv.num_free_blocks == sched.kv.num_blocks
