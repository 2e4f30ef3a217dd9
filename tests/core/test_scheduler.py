import pytest

from engine.sequence import SequenceStatus

from .helpers import KVMemory, check_kv_invariants, make_group, make_scheduler, run_step, sample


def _shape(out) -> list[tuple[str, int, int, bool]]:
    return [(s.group.request_id, s.start, s.num_new_tokens, s.do_sample) for s in out.scheduled]


def _check_contents(sched, memory: KVMemory) -> None:
    """Every running/swapped sequence's table points at its own computed tokens."""
    bs = sched.config.block_size
    for group in list(sched.running.values()) + list(sched.swapped):
        for seq in group.unfinished_seqs():
            table = sched.kv.tables[seq.seq_id]
            got = memory.tokens_of(table.block_ids, seq.num_computed_tokens, bs, table.on_cpu)
            assert got == seq.token_ids[:seq.num_computed_tokens], f"seq {seq.seq_id}"


def test_chunked_prefill_splits_a_long_prompt_under_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_group(make_group("a", list(range(20))))
    shapes = [_shape(run_step(sched)) for _ in range(4)]
    assert shapes == [[("a", 0, 8, False)], [("a", 8, 8, False)], [("a", 16, 4, True)], [("a", 20, 1, True)]]


def test_block_table_covers_exactly_the_scheduled_tokens():
    sched = make_scheduler(max_num_batched_tokens=12)
    sched.add_group(make_group("a", list(range(20))))
    out = sched.schedule()
    assert out.scheduled[0].block_table == [0, 1]  # 12 tokens, block size 8


def test_running_groups_go_before_new_admissions_and_share_the_budget():
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_group(make_group("a", list(range(6)), arrival=0))
    sched.add_group(make_group("b", list(range(100, 106)), arrival=1))
    assert _shape(run_step(sched)) == [("a", 0, 6, True), ("b", 0, 4, False)]
    sched.add_group(make_group("c", list(range(200, 203)), arrival=2))
    assert _shape(run_step(sched)) == [("a", 6, 1, True), ("b", 4, 2, True), ("c", 0, 3, True)]
    assert out_tokens(sched) == {"a": 8, "b": 7, "c": 4}


def out_tokens(sched) -> dict[str, int]:
    return {g.request_id: g.seqs[0].num_tokens for g in sched.running.values()}


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False)
    sched.add_group(make_group("a", list(range(6))))
    sched.add_group(make_group("b", list(range(100, 106))))
    assert _shape(run_step(sched)) == [("a", 0, 6, True)]
    assert _shape(run_step(sched)) == [("a", 6, 1, True), ("b", 0, 6, True)]


# The context length is the edges' rule (engine.context_length): the scheduler trusts it.
@pytest.mark.parametrize("overrides, prompt_len, reason", [
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=8), 9, "chunked prefill is disabled"),
    (dict(num_device_blocks=2), 17, "needs 3 KV blocks"),
])
def test_unservable_requests_fail_clearly_without_wedging_the_queue(overrides, prompt_len, reason):
    sched = make_scheduler(**overrides)
    bad, good = make_group("bad", list(range(prompt_len))), make_group("good", [1, 2, 3])
    sched.add_group(bad)
    sched.add_group(good)
    out = run_step(sched)
    assert out.failed == [bad] and reason in bad.error
    assert bad.seqs[0].status is SequenceStatus.FINISHED_ERROR
    assert _shape(out) == [("good", 0, 3, True)]
    assert sched.stats().num_blocks_used == 1


def test_without_a_model_the_block_count_must_be_given():
    with pytest.raises(ValueError, match="without a model, num_device_blocks must be given"):
        make_scheduler(num_device_blocks=None)
    assert make_scheduler(num_cpu_blocks=None).config.num_cpu_blocks == 0  # no swap space


def test_max_num_seqs_counts_the_n_samples_of_a_request():
    sched = make_scheduler(max_num_seqs=3)
    sched.add_group(make_group("a", [1, 2], n=2))
    sched.add_group(make_group("b", [3, 4], n=2))
    sched.add_group(make_group("c", [5, 6]))
    assert [s[0] for s in _shape(run_step(sched))] == ["a"]  # b needs 2 more seqs, c waits behind it (FCFS)
    with pytest.raises(ValueError):
        sched.add_group(make_group("a", [1]))


def test_duplicate_and_malformed_groups_are_rejected():
    sched = make_scheduler()
    with pytest.raises(ValueError, match="at least one token"):
        sched.add_group(make_group("x", []))
    g = make_group("y", [1])
    g.seqs[0].status = SequenceStatus.RUNNING
    with pytest.raises(ValueError, match="WAITING"):
        sched.add_group(g)


def _fill_decoding(sched, n_groups: int, prompt_len: int, memory: KVMemory) -> list:
    groups = [make_group(f"r{i}", [i * 10 + t for t in range(prompt_len)], arrival=i) for i in range(n_groups)]
    for g in groups:
        sched.add_group(g)
    run_step(sched, memory)
    return groups


@pytest.mark.parametrize("caching, r2_start", [(False, 0), (True, 8)])
def test_recompute_preemption_evicts_the_latest_arrival_first(caching, r2_start):
    # 3 groups of 8-token prompts need a second block at their first decode; 5 blocks in all.
    sched = make_scheduler(num_device_blocks=5, enable_prefix_caching=caching)
    memory = KVMemory()
    groups = _fill_decoding(sched, 3, 8, memory)
    out = run_step(sched, memory)
    assert out.preempted == [groups[2]]
    assert [s[0] for s in _shape(out)] == ["r0", "r1"]
    assert sched.waiting[0] is groups[2] and groups[2].seqs[0].status is SequenceStatus.WAITING
    assert groups[2].seqs[0].num_computed_tokens == 0 and groups[2].metrics.num_preemptions == 1
    assert sched.stats().num_preemptions_total == 1 and sched.stats().num_blocks_free == 1
    check_kv_invariants(sched.kv)
    # Once r0 finishes, r2 is re-prefilled: its prompt and its sampled token
    # (the full first block comes from the prefix cache when caching is on).
    sched.finish_seq(groups[0], groups[0].seqs[0], SequenceStatus.FINISHED_STOPPED)
    out = run_step(sched, memory)
    assert _shape(out) == [("r1", 9, 1, True), ("r2", r2_start, 9 - r2_start, True)]
    _check_contents(sched, memory)


def test_latest_arrival_preempts_itself_and_earlier_groups_keep_running():
    sched = make_scheduler(num_device_blocks=5, enable_prefix_caching=False)
    groups = _fill_decoding(sched, 3, 8, KVMemory())
    sched.finish_seq(groups[0], groups[0].seqs[0], SequenceStatus.FINISHED_STOPPED)
    sched.add_group(make_group("new", list(range(40, 48)), arrival=9))  # 1 block, admitted now
    out = run_step(sched)
    assert [s[0] for s in _shape(out)] == ["r1", "r2", "new"] and sched.stats().num_blocks_free == 0
    out = run_step(sched)  # "new" needs a 2nd block: the latest arrival preempts itself
    assert out.preempted == [sched.waiting[0]] and sched.waiting[0].request_id == "new"
    assert [s[0] for s in _shape(out)] == ["r1", "r2"]


def test_swap_preemption_moves_the_victim_to_cpu_and_back_before_admissions():
    sched = make_scheduler(num_device_blocks=5, num_cpu_blocks=5, preemption_mode="swap")
    memory = KVMemory()
    groups = _fill_decoding(sched, 3, 8, memory)
    victim_table = sched.kv.block_ids(groups[2].seqs[0].seq_id)
    out = run_step(sched, memory)
    assert out.preempted == [groups[2]] and [d for d, _ in out.blocks_to_swap_out] == victim_table
    cpu_ids = [c for _, c in out.blocks_to_swap_out]
    assert groups[2].seqs[0].status is SequenceStatus.SWAPPED and len(sched.swapped) == 1
    assert sched.stats().num_cpu_blocks_used == 1 and sched.stats().num_swapped_out_blocks_total == 1
    _check_contents(sched, memory)
    # No room to swap r2 back in (it needs 2 blocks, 1 is free): "late" must not jump ahead.
    sched.add_group(make_group("late", [7, 7, 7], arrival=5))
    out = run_step(sched, memory)
    assert [s[0] for s in _shape(out)] == ["r0", "r1"] and not out.blocks_to_swap_in
    assert len(sched.waiting) == 1
    sched.finish_seq(groups[0], groups[0].seqs[0], SequenceStatus.FINISHED_STOPPED)
    out = run_step(sched, memory)
    assert [c for c, _ in out.blocks_to_swap_in] == cpu_ids
    assert _shape(out) == [("r1", 10, 1, True), ("r2", 8, 1, True), ("late", 0, 3, True)]
    assert sched.stats().num_swapped_in_blocks_total == 1 and sched.stats().num_cpu_blocks_used == 0
    _check_contents(sched, memory)


def test_abort_frees_every_block_in_every_state():
    sched = make_scheduler(num_device_blocks=5, num_cpu_blocks=5, preemption_mode="swap")
    sched.add_group(make_group("f", list(range(50, 58)), arrival=-1, n=2))
    _fill_decoding(sched, 2, 8, KVMemory())  # f forks after its prompt; r0 and r1 prefill
    run_step(sched)  # the decodes need 3 new blocks, 2 are free: r1 is swapped out
    assert len(sched.swapped) == 1 and len(sched.running["f"].seqs) == 2
    sched.add_group(make_group("w", [1, 2, 3]))  # waiting
    aborted = sched.abort(["f", "r0", "r1", "w", "unknown"])
    assert [g.request_id for g in aborted] == ["f", "r0", "r1", "w"]
    assert all(s.status is SequenceStatus.FINISHED_ABORTED for g in aborted for s in g.seqs)
    stats = sched.stats()
    assert stats.num_blocks_used == 0 and stats.num_cpu_blocks_used == 0
    assert [o.request_id for o in sched.take_unreported()] == ["f", "r0", "r1", "w"]  # reported once
    assert not sched.has_unfinished() and (len(sched.running), len(sched.waiting), len(sched.swapped)) == (0, 0, 0)
    check_kv_invariants(sched.kv)
    assert sched.schedule().is_empty


def test_abort_between_schedule_and_update_is_safe():
    sched = make_scheduler()
    sched.add_group(make_group("a", [1, 2, 3], n=2))
    out = sched.schedule()
    sched.abort("a")
    outputs = sched.update_from_output(out, sample(out))  # the abort's output alone: no token was appended
    assert [(o.request_id, o.finished, [(c.token_ids, c.finish_reason) for c in o.outputs]) for o in outputs] == [
        ("a", True, [([], "abort")])]
    assert sched.stats().num_blocks_used == 0 and not sched.has_unfinished()


def test_fork_then_decode_emits_one_copy_on_write():
    sched = make_scheduler()
    memory = KVMemory()
    group = make_group("a", list(range(6)), n=2)
    sched.add_group(group)
    run_step(sched, memory)  # the prompt; then the child forks and both draw a first token
    parent, child = group.seqs
    assert (parent.index, child.index) == (0, 1) and parent.token_ids[-1] != child.token_ids[-1]
    shared = sched.kv.block_ids(parent.seq_id)
    assert sched.kv.block_ids(child.seq_id) == shared
    out = run_step(sched, memory)
    assert out.blocks_to_copy == [(shared[0], out.scheduled[0].block_table[0])]
    assert out.scheduled[1].block_table == shared
    _check_contents(sched, memory)
    check_kv_invariants(sched.kv)


def test_finished_group_leaves_and_returns_its_blocks():
    sched = make_scheduler()
    group = make_group("a", list(range(5)), n=2)
    sched.add_group(group)
    run_step(sched)
    child = group.seqs[1]
    sched.finish_seq(group, group.seqs[0], SequenceStatus.FINISHED_LENGTH)
    assert len(sched.running) == 1
    sched.finish_seq(group, child, SequenceStatus.FINISHED_STOPPED)
    assert len(sched.running) == 0 and not sched.has_unfinished()
    assert sched.stats().num_blocks_used == 0
    with pytest.raises(ValueError):
        sched.finish_seq(group, child, SequenceStatus.RUNNING)


def test_prefix_cache_hit_skips_cached_blocks_and_is_counted():
    sched = make_scheduler()
    prompt = list(range(10))
    first = make_group("a", prompt)
    sched.add_group(first)
    run_step(sched)
    second = make_group("b", prompt[:9] + [77])
    sched.add_group(second)
    out = run_step(sched)
    assert _shape(out)[1] == ("b", 8, 2, True)
    assert out.scheduled[1].block_table[0] == out.scheduled[0].block_table[0]
    assert second.num_cached_tokens == 8
    stats = sched.stats()
    assert (stats.prefix_cache_queries_total, stats.prefix_cache_hits_total) == (20, 8)


def test_prefix_cache_respects_the_tenant_salt():
    sched = make_scheduler()
    sched.add_group(make_group("a", list(range(10)), salt=b"t1"))
    run_step(sched)
    sched.add_group(make_group("b", list(range(10)), salt=b"t2"))
    assert _shape(run_step(sched))[1] == ("b", 0, 10, True)


@pytest.mark.parametrize("caching, start", [(False, 0), (True, 8)])
def test_recomputed_forked_group_reprefills_each_sequence(caching, start):
    sched = make_scheduler(num_device_blocks=4, enable_prefix_caching=caching)
    memory = KVMemory()
    b = make_group("b", list(range(100, 108)), arrival=0)
    a = make_group("a", list(range(6)), arrival=1, n=2)
    sched.add_group(b)
    sched.add_group(a)
    run_step(sched, memory)
    child = a.seqs[1]
    assert child.token_ids[-1] != a.seqs[0].token_ids[-1]  # the siblings diverge
    for _ in range(5):
        out = run_step(sched, memory)
        _check_contents(sched, memory)
        if out.preempted:
            break
    assert out.preempted == [a] and sched.waiting[0] is a
    assert all(s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0 for s in a.seqs)
    sched.finish_seq(b, b.seqs[0], SequenceStatus.FINISHED_STOPPED)
    out = run_step(sched, memory)
    assert [(s.seq, s.start, s.num_new_tokens) for s in out.scheduled] == [
        (a.seqs[0], start, 9 - start), (child, start, 9 - start)]
    _check_contents(sched, memory)
    check_kv_invariants(sched.kv)


def _decoding(sched, priorities: list[int], prompt_len: int, memory: KVMemory | None = None) -> list:
    groups = [make_group(f"r{i}", [i * 10 + t for t in range(prompt_len)], arrival=i, priority=p)
              for i, p in enumerate(priorities)]
    for g in groups:
        sched.add_group(g)
    run_step(sched, memory)
    return groups


def test_waiting_groups_are_admitted_by_priority_then_arrival():
    sched = make_scheduler(max_num_batched_tokens=8, enable_chunked_prefill=False)  # one 8-token prompt a step
    for i, priority in enumerate([1, 0, 0, -1]):
        sched.add_group(make_group(f"r{i}", [i] * 8, arrival=i, priority=priority, max_tokens=1))
    admitted = [_shape(run_step(sched))[-1][0] for _ in range(4)]
    assert admitted == ["r3", "r1", "r2", "r0"]


def test_pressure_preempts_the_lowest_priority_before_later_arrivals():
    # As in the FCFS test above, the first decode needs 3 new blocks and 2 are free: the victim is r0, the
    # earliest arrival, because its priority is the lowest.
    sched = make_scheduler(num_device_blocks=5, enable_prefix_caching=False)
    groups = _decoding(sched, [1, 0, 0], 8)
    out = run_step(sched)
    assert out.preempted == [groups[0]] and [s[0] for s in _shape(out)] == ["r1", "r2"]
    assert list(sched.running) == ["r1", "r2"] and sched.waiting[0] is groups[0]


def test_a_higher_priority_arrival_preempts_lower_priority_groups_and_runs_at_once():
    sched = make_scheduler(num_device_blocks=6, enable_prefix_caching=False)
    memory = KVMemory()
    groups = _decoding(sched, [1, 1, 1], 4, memory)  # one block each, 3 of 6 free
    vip = make_group("vip", list(range(100, 131)), arrival=9)  # 4 blocks: one victim must go, the latest
    sched.add_group(vip)
    out = run_step(sched, memory)
    # The step that admits vip runs it alone: its first token waits for no lower-priority decode.
    assert out.preempted == [groups[2]] and _shape(out) == [("vip", 0, 31, True)]
    assert list(sched.running) == ["vip", "r0", "r1"]  # rank order: vip is never the next victim
    _check_contents(sched, memory)
    equal = make_group("equal", list(range(200, 240)), arrival=10, priority=1)  # never preempts its own rank
    sched.add_group(equal)
    out = run_step(sched, memory)
    assert not out.preempted and sched.waiting[-1] is equal
    assert _shape(out) == [("vip", 31, 1, True), ("r0", 4, 1, True), ("r1", 4, 1, True)]  # all decode again


def test_an_arrival_of_the_same_priority_shares_the_step_with_the_decodes():
    sched = make_scheduler()
    _decoding(sched, [1, 0], 4)
    sched.add_group(make_group("new", [5, 6, 7], arrival=9))  # priority 0: outranks r0, not r1
    assert _shape(run_step(sched)) == [("r1", 4, 1, True), ("new", 0, 3, True)]  # r0 (priority 1) sits out
    sched.add_group(make_group("late", [8, 9], arrival=10, priority=1))
    assert [s[0] for s in _shape(run_step(sched))] == ["r1", "new", "r0", "late"]


def test_a_higher_priority_arrival_goes_before_lower_priority_swapped_groups():
    sched = make_scheduler(num_device_blocks=5, num_cpu_blocks=5, preemption_mode="swap")
    memory = KVMemory()
    groups = _decoding(sched, [1, 0, 0], 8, memory)
    assert run_step(sched, memory).preempted == [groups[0]] and list(sched.swapped) == [groups[0]]
    sched.add_group(make_group("late", [7, 7, 7], arrival=5))  # FCFS would wait behind the swapped r0
    out = run_step(sched, memory)
    assert [s[0] for s in _shape(out)] == ["r1", "r2", "late"] and not out.blocks_to_swap_in
    _check_contents(sched, memory)
