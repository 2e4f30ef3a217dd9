"""The contiguous (Orca) baselines driven by the real scheduler: reservations,
no overlap, slot accounting that sums to the arena, everything freed."""
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.baselines.contiguous import ContiguousKVCacheManager
from engine.sampling_params import SamplingParams
from engine.sequence import SequenceGroup

from .helpers import KVMemory, arena_decomposition, make_group, make_scheduler, make_seq, run_step

BS = 8
MAX_LEN = 64
POLICIES = ["contiguous-max", "contiguous-pow2", "contiguous-oracle"]


def _group(request_id: str, prompt_len: int, max_tokens: int, n: int = 1) -> SequenceGroup:
    prompt = [(sum(map(ord, request_id)) + i) % 50 for i in range(prompt_len)]
    params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
    return SequenceGroup(request_id, [make_seq(prompt)], params, 0.0)


def _scheduler(policy: str, **overrides):
    fields = dict(kv_allocator=policy, block_size=BS, num_device_blocks=32, max_model_len=MAX_LEN,
                  max_num_seqs=16, max_num_batched_tokens=64)
    fields.update(overrides)
    return make_scheduler(**fields)


def _expected_run(policy: str, prompt_len: int, max_tokens: int) -> int:
    """Blocks of the run, from the policies' definitions (independent of the manager)."""
    out_pow2 = 1
    while out_pow2 < max_tokens:
        out_pow2 *= 2
    tokens = {"contiguous-max": MAX_LEN, "contiguous-oracle": prompt_len + max_tokens,
              "contiguous-pow2": min(prompt_len + out_pow2, MAX_LEN)}[policy]
    blocks = -(-tokens // BS)
    run = 1
    while run < blocks:
        run *= 2
    return run


def _check(sched, memory: KVMemory) -> None:
    kv: ContiguousKVCacheManager = sched.kv
    owner: dict[int, int] = {}
    for seq_id, run in kv.tables.items():
        for b in range(run.start, run.start + (1 << run.order)):
            assert owner.setdefault(b, seq_id) == seq_id, f"block {b} in two runs"
    stats = kv.stats()
    assert (stats.num_tokens_stored + stats.num_reserved_slots + stats.num_internal_frag_slots
            + stats.num_external_frag_slots + stats.num_free_slots == stats.num_blocks * BS)
    assert min(stats.num_reserved_slots, stats.num_internal_frag_slots, stats.num_external_frag_slots,
               stats.num_free_slots) >= 0
    assert stats.num_used_blocks == len(owner)
    for group in sched.running.values():
        seq = group.seqs[0]
        assert stats.num_tokens_stored >= seq.num_computed_tokens
        table = kv.block_ids(seq.seq_id)
        assert table == list(range(kv.tables[seq.seq_id].start, kv.tables[seq.seq_id].start + len(table)))
        got = memory.tokens_of(table, seq.num_computed_tokens, BS, on_cpu=False)
        assert got == seq.token_ids[:seq.num_computed_tokens]
    assert stats.num_tokens_stored == sum(g.seqs[0].num_computed_tokens for g in sched.running.values())


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("prompt_len,max_tokens", [(5, 3), (10, 20), (30, 34), (1, 1)])
def test_run_size_follows_the_policy(policy, prompt_len, max_tokens):
    sched = _scheduler(policy)
    group = _group("a", prompt_len, max_tokens)
    sched.add_group(group)
    out = sched.schedule()
    run = sched.kv.tables[group.seqs[0].seq_id]
    assert 1 << run.order == _expected_run(policy, prompt_len, max_tokens)
    assert out.scheduled[0].block_table == list(range(run.start, run.start + -(-prompt_len // BS)))
    stats = sched.kv.stats()
    assert stats.num_reserved_slots == run.reserved_len  # claimed, nothing computed yet
    assert stats.num_internal_frag_slots == (1 << run.order) * BS - run.reserved_len


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICIES), num_blocks=st.integers(8, 40), chunked=st.booleans(),
       requests=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 34)), min_size=1, max_size=12),
       abort_at=st.integers(0, 30))
def test_random_traces_never_overlap_and_free_everything(policy, num_blocks, chunked, requests, abort_at):
    sched = _scheduler(policy, num_device_blocks=num_blocks, enable_chunked_prefill=chunked,
                       max_num_batched_tokens=32)
    memory = KVMemory()
    for i, (prompt_len, max_tokens) in enumerate(requests):
        sched.add_group(_group(f"r{i}", prompt_len, max_tokens))
    for step in range(2000):
        if not sched.has_unfinished():
            break
        if step == abort_at:
            sched.abort(["r0"])
        run_step(sched, memory)
        _check(sched, memory)
        assert sched.num_preemptions == 0  # everything was reserved up front
    assert not sched.has_unfinished()
    assert sched.stats().num_blocks_used == 0 and not sched.kv.tables
    assert sched.kv.arena.free_runs() == arena_decomposition(num_blocks)


def test_blocked_admission_reports_scattered_free_slots_as_external_fragmentation():
    sched = _scheduler("contiguous-oracle", num_device_blocks=8)
    memory = KVMemory()
    for i in range(4):  # 4 runs of 2 blocks fill the arena
        sched.add_group(_group(f"r{i}", 8, 8 if i % 2 else 2))
    run_step(sched, memory)
    assert len(sched.running) == 4
    for _ in range(2):  # r0 and r2 (2 output tokens) finish: two scattered free 2-block runs
        run_step(sched, memory)
    assert len(sched.running) == 2
    sched.add_group(_group("big", 20, 12))  # needs a 4-block run
    run_step(sched, memory)
    stats = sched.kv.stats()
    assert "big" not in sched.running
    assert stats.num_external_frag_slots == 4 * BS and stats.num_free_slots == 0
    _check(sched, memory)
    sched.add_group(_group("huge", 40, 24))  # an 8-block run: more than is free in any layout
    sched.abort("big")
    run_step(sched, memory)
    stats = sched.kv.stats()
    assert "huge" not in sched.running
    assert stats.num_external_frag_slots == 0 and stats.num_free_slots == 4 * BS


def test_contiguous_allocators_refuse_sharing_and_impossible_runs():
    sched = _scheduler("contiguous-pow2")
    with pytest.raises(ValueError, match="needs kv_allocator='paged'"):
        sched.add_group(_group("n2", 4, 4, n=2))
    assert not sched.kv.find_cached_prefix(list(range(32)), None)
    small = _scheduler("contiguous-max", num_device_blocks=6)  # largest run: 4 blocks < 8 for MAX_LEN
    group = _group("a", 4, 4)
    small.add_group(group)
    out = small.schedule()
    assert out.failed == [group] and "largest run of the 6-block arena is 4" in group.error
    with pytest.raises(ValueError, match="needs max_model_len"):
        make_scheduler(kv_allocator="contiguous-max", max_model_len=None)


def test_paged_and_contiguous_agree_on_a_trace_that_fits():
    """With room for everything, the allocator changes memory, not the schedule."""
    shapes = {}
    for policy in ["paged"] + POLICIES:
        sched = _scheduler(policy, num_device_blocks=64)
        memory = KVMemory()
        for i, (p, m) in enumerate([(5, 3), (12, 9), (20, 4)]):
            sched.add_group(_group(f"r{i}", p, m))
        trace = []
        while sched.has_unfinished():
            out = run_step(sched, memory)
            trace.append([(s.group.request_id, s.start, s.num_new_tokens) for s in out.scheduled])
        shapes[policy] = trace
    assert all(t == shapes["paged"] for t in shapes.values())


def test_abort_returns_the_run(policy="contiguous-oracle"):
    sched = _scheduler(policy)
    sched.add_group(make_group("a", list(range(10))))
    sched.schedule()
    assert sched.stats().num_blocks_used > 0
    sched.abort("a")
    assert sched.stats().num_blocks_used == 0 and sched.kv.arena.free_runs() == [(0, 32)]
