"""The recurrent-state slots beside the block pool (engine/core/state_cache.py), through the KV cache manager's
primitives: admission, fork, free, swap, and snapshots bound to block hashes for prefix hits."""
from __future__ import annotations

import pytest

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.state_cache import StateCache, StateMove, StateStep

BS = 4


def manager(num_slots: int = 3, num_snapshots: int = 2, num_cpu_slots: int = 2) -> KVCacheManager:
    return KVCacheManager(32, 16, BS, enable_caching=True,
                          state=StateCache(num_slots, num_snapshots, num_cpu_slots, BS))


def prefill(kv: KVCacheManager, seq_id: int, tokens: list[int]) -> StateStep:
    """Admit ``tokens`` (with whatever prefix hit), run them as one step, mark them computed."""
    hits = kv.find_cached_prefix(tokens, None)
    kv.admit(seq_id, hits, None, len(tokens))
    start = len(hits) * BS
    kv.append(seq_id, len(tokens) - start)
    step = kv.state.step(seq_id, start, len(tokens) - start, len(tokens))
    kv.mark_computed(seq_id, len(tokens), tokens)
    return step


def test_a_sequence_holds_one_slot_from_admission_to_free() -> None:
    kv = manager()
    step = prefill(kv, 1, list(range(3)))
    assert step == StateStep(slot=0) and kv.state.slot_of == {1: 0}
    kv.free(1)
    assert kv.state.stats().num_used_slots == 0 and kv.state.take_moves() == []


def test_a_fork_copies_the_parents_state() -> None:
    kv = manager()
    prefill(kv, 1, list(range(3)))
    kv.state.take_moves()
    kv.fork(1, 2)
    assert kv.state.take_moves() == [StateMove("copy", 0, 1)]


def test_swap_moves_the_state_with_the_blocks() -> None:
    kv = manager(num_cpu_slots=1)
    prefill(kv, 1, list(range(3)))
    prefill(kv, 2, list(range(50, 53)))
    kv.state.take_moves()
    assert kv.can_swap_out([1]) and not kv.can_swap_out([1, 2])  # one CPU state slot
    kv.swap_out([1])
    prefill(kv, 3, list(range(60, 63)))  # takes the freed device slot 0
    kv.swap_in([1])
    assert kv.state.take_moves() == [StateMove("swap_out", 0, 0), StateMove("swap_in", 0, 2)]
    assert kv.state.slot_of == {2: 1, 3: 0, 1: 2}


def test_a_prefix_hit_restores_the_snapshot_at_its_last_block() -> None:
    """A 10-token prompt saves its state at token 8 (the last block boundary below its last token): the same
    prompt again hits 2 blocks and starts from that snapshot."""
    kv = manager()
    prompt = list(range(10))
    step = prefill(kv, 1, prompt)
    assert step == StateStep(slot=0, save_slot=3, save_at=8)
    kv.free(1)
    kv.state.take_moves()
    assert len(kv.find_cached_prefix(prompt, None)) == 2
    again = prefill(kv, 2, prompt)
    assert again.save_slot == -1  # nothing new to save: it starts at the boundary
    assert kv.state.take_moves() == [StateMove("copy", 3, 0)]
    assert kv.state.snapshot_hits == 1


def test_a_hit_is_cut_back_to_a_block_with_a_snapshot() -> None:
    """Blocks cached without a snapshot at their end are no hit: the state there is unknown."""
    kv = manager()
    prefill(kv, 1, list(range(10)))  # snapshot at 8 only; block 1 (tokens 4..7) cached too
    longer = list(range(8)) + [99, 98, 97]  # shares blocks 0 and 1, diverges in block 2
    assert len(kv.find_cached_prefix(longer, None)) == 2
    other = list(range(4)) + [77] * 7  # shares only block 0: cached, but no snapshot at token 4
    assert kv.find_cached_prefix(other, None) == []


def test_snapshots_are_bounded_and_least_recently_used_go_first() -> None:
    kv = manager(num_snapshots=2)
    prompts = [[p] * 6 for p in (1, 2, 3)]
    for i, prompt in enumerate(prompts[:2]):
        prefill(kv, i, prompt)
        kv.free(i)
    assert kv.find_cached_prefix(prompts[0], None)  # touching prompt 0's snapshot keeps it
    prefill(kv, 10, prompts[0])
    kv.free(10)
    prefill(kv, 11, prompts[2])  # evicts prompt 1's snapshot, the least recently used
    kv.free(11)
    assert kv.find_cached_prefix(prompts[0], None) and kv.find_cached_prefix(prompts[2], None)
    assert kv.find_cached_prefix(prompts[1], None) == []
    assert kv.state.stats().num_used_snapshots == 2


def test_an_aborted_step_frees_the_snapshot_it_was_writing() -> None:
    kv = manager(num_snapshots=1)
    prompt = list(range(10))
    kv.admit(1, [], None, len(prompt))
    kv.append(1, len(prompt))
    assert kv.state.step(1, 0, len(prompt), len(prompt)).save_slot == 3
    kv.free(1)  # aborted before the step was marked computed
    assert kv.find_cached_prefix(prompt, None) == []
    assert kv.state.stats().num_used_snapshots == 0


def test_running_out_of_slots_is_an_error_not_a_corruption() -> None:
    kv = manager(num_slots=1)
    prefill(kv, 1, [1, 2])
    with pytest.raises(RuntimeError, match="all 1 state slots are taken"):
        prefill(kv, 2, [3, 4])
