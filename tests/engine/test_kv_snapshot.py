"""The dashboard's KV snapshot: its blocks add up to the EngineStats of the same step, and its ref counts,
owners and request block lists match the block tables."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.core.kv_snapshot import CACHED, COW, FREE, NO_OWNER, SHARED, USED, KVSnapshot, PoolSnapshot
from engine.stats import EngineStats

HELD = (USED, SHARED, COW)


def held(pool: PoolSnapshot) -> np.ndarray:
    return np.isin(pool.state, HELD)


def check_against_stats(snap: KVSnapshot, stats: EngineStats) -> None:
    """Every figure the dashboard shows, recomputed from the blocks, against the engine's own."""
    dev, bs = snap.device, snap.block_size
    used = held(dev)
    filled, computed = dev.filled[used].astype(int), dev.computed[used].astype(int)
    assert (used.sum(), (~used).sum(), (dev.state == CACHED).sum()) == (
        stats.num_blocks_used, stats.num_blocks_free, stats.num_blocks_cached)
    assert dev.num_blocks == stats.num_blocks_total and snap.cpu.num_blocks == stats.num_cpu_blocks_total
    assert held(snap.cpu).sum() == stats.num_cpu_blocks_used
    assert computed.sum() == stats.kv_tokens_stored
    assert (filled - computed).sum() == stats.kv_reserved_slots
    assert (bs - filled).sum() == stats.kv_internal_frag_slots
    if used.any():
        assert 1 - computed.sum() / (used.sum() * bs) == pytest.approx(1 - stats.kv_token_utilization)
    states = Counter(r.state for r in snap.requests)
    assert (states["running"], states["waiting"], states["swapped"]) == (
        stats.num_requests_running, stats.num_requests_waiting, stats.num_requests_swapped)


def check_against_tables(snap: KVSnapshot, engine: LLMEngine) -> None:
    """Ref counts and owners from the block tables themselves."""
    kv = engine.scheduler.kv
    refs = {False: Counter(), True: Counter()}  # on the CPU or not -> block id -> holders
    for table in kv.tables.values():
        refs[table.on_cpu].update(b.block_id for b in table.held())
    for pool, on_cpu in ((snap.device, False), (snap.cpu, True)):
        assert dict(refs[on_cpu]) == {i: int(pool.ref_count[i]) for i in np.flatnonzero(held(pool))}
        shared = pool.ref_count > 1
        assert np.array_equal(np.isin(pool.state, (SHARED, COW)), shared)
        assert np.array_equal(pool.state == COW, shared & (pool.filled < snap.block_size))
        assert (pool.owner[~held(pool)] == NO_OWNER).all()
    for index, request in enumerate(snap.requests):
        pool = snap.cpu if request.state == "swapped" else snap.device
        expected = {b.block_id for s in engine.scheduler.requests[request.request_id].unfinished_seqs()
                    if s.seq_id in kv.tables for b in kv.tables[s.seq_id].held()}
        assert set(request.block_ids) == expected and len(request.block_ids) == len(expected)
        owners = pool.owner[request.block_ids]
        assert (owners <= index).all()  # owned by the first listed holder
        assert all(b in snap.requests[o].block_ids for b, o in zip(request.block_ids, owners))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_snapshot_numbers_equal_engine_stats_at_every_step(llama_checkpoint, mode: str) -> None:
    # A pool too small for all of them: preemption (swapped requests in swap mode); n=3 forks and a shared
    # 24-token prefix give ref counts > 1 (copy-on-write last blocks included); finished ones leave cached blocks.
    engine = LLMEngine(EngineConfig(model=llama_checkpoint.path, attention_backend="torch", dtype="float32",
                                    num_device_blocks=20, num_cpu_blocks=20, block_size=8, max_model_len=128,
                                    preemption_mode=mode, show_progress=False))
    prefix = list(range(10, 34))

    def add(i: int) -> None:
        engine.add_request(f"r{i}", prefix + [40 + i] * (3 + i), SamplingParams(
            n=3 if i % 2 else 1, max_tokens=12 + 2 * i, ignore_eos=True, seed=i, temperature=1.0))

    add(0)
    engine.step()  # r0's prompt blocks are cached: the others hit them
    for i in range(1, 6):
        add(i)
    seen: set[int] = set()
    request_states: set[str] = set()
    while engine.has_unfinished_requests():
        engine.step()
        snap = engine.kv_snapshot()
        assert snap.stats == engine.stats()
        check_against_stats(snap, snap.stats)
        check_against_tables(snap, engine)
        seen |= set(snap.device.state.tolist()) | set(snap.cpu.state.tolist())
        request_states |= {r.state for r in snap.requests}
    assert {USED, SHARED, COW, CACHED} <= seen
    assert engine.stats().num_preemptions_total > 0 and engine.stats().prefix_cache_hits_total > 0
    assert request_states == ({"running", "waiting", "swapped"} if mode == "swap" else {"running", "waiting"})
    final = engine.kv_snapshot()
    assert not final.requests and not held(final.device).any() and (final.device.state != FREE).any()


def test_contiguous_snapshot_holds_each_run_whole(llama_checkpoint) -> None:
    """An Orca-style run is held whole from admission: its blocks past what the sequence claimed are held
    and empty (the reservation the baseline wastes)."""
    engine = LLMEngine(EngineConfig(model=llama_checkpoint.path, attention_backend="torch", dtype="float32",
                                    num_device_blocks=32, block_size=8, max_model_len=64, show_progress=False,
                                    kv_allocator="contiguous-max", enable_prefix_caching=False))
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i] * (9 + i), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    snap, stats = engine.kv_snapshot(), engine.stats()
    dev = snap.device
    used = dev.state == USED
    assert used.sum() == stats.num_blocks_used == 3 * 8 and (dev.ref_count[used] == 1).all()
    assert dev.computed.sum() == stats.kv_tokens_stored
    for index, request in enumerate(snap.requests):
        run = sorted(request.block_ids)
        assert run == list(range(run[0], run[0] + 8)) and (dev.owner[run] == index).all()
        assert dev.filled[run].tolist() == [8, 1 + index] + [0] * 6  # its prompt (9 + index tokens), computed
