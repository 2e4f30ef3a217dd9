import pytest

from engine.core import kv_cache_manager
from engine.core.kv_cache_manager import KVCacheManager

from .helpers import check_kv_invariants

BS = 4


def _manager(num_blocks: int = 16, num_cpu: int = 0, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, num_cpu, BS, caching)


def _prefill(kv: KVCacheManager, seq_id: int, tokens: list[int], salt: bytes | None = None) -> list[int]:
    """Admit with prefix lookup, compute the rest, return the block table."""
    hits = kv.find_cached_prefix(tokens, salt)
    kv.admit(seq_id, hits, salt, len(tokens))
    kv.append(seq_id, len(tokens) - len(hits) * BS)
    kv.mark_computed(seq_id, len(tokens), tokens)
    check_kv_invariants(kv)
    return kv.block_ids(seq_id)


def _refs(kv: KVCacheManager, ids: list[int]) -> list[int]:
    return [kv.device_pool.blocks[i].ref_count for i in ids]


def test_prefill_without_hit_takes_fresh_blocks():
    kv = _manager()
    assert _prefill(kv, 0, list(range(10))) == [0, 1, 2]
    stats = kv.stats()
    assert (stats.num_used_blocks, stats.num_tokens_stored, stats.num_internal_frag_slots) == (3, 10, 2)
    assert stats.num_reserved_slots == 0 and stats.usage == 3 / 16


def test_prefill_with_prefix_hit_shares_full_blocks():
    kv = _manager()
    _prefill(kv, 0, list(range(10)))
    table = _prefill(kv, 1, list(range(8)) + [99, 98, 97])
    assert table == [0, 1, 3]
    assert _refs(kv, [0, 1, 2, 3]) == [2, 2, 1, 1]
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (21, 8)
    assert kv.stats().num_tokens_stored == 10 + 3  # shared blocks counted once


def test_last_prompt_token_is_always_recomputed():
    kv = _manager()
    _prefill(kv, 0, list(range(8)))
    assert [b.block_id for b in kv.find_cached_prefix(list(range(8)), None)] == [0]
    assert _prefill(kv, 1, list(range(8))) == [0, 2]


def test_salt_and_parent_chain_isolate_prefixes():
    kv = _manager()
    _prefill(kv, 0, list(range(12)), salt=b"a")
    assert kv.find_cached_prefix(list(range(12)), b"b") == []
    assert len(kv.find_cached_prefix(list(range(12)), b"a")) == 2
    # Block 1's tokens after a different block 0 must not match.
    assert kv.find_cached_prefix([7, 7, 7, 7] + list(range(4, 12)), b"a") == []


def test_hash_collision_is_caught_by_token_comparison(monkeypatch):
    monkeypatch.setattr(kv_cache_manager, "hash_block", lambda parent, tokens, salt=None: b"x" * 32)
    kv = _manager()
    _prefill(kv, 0, [1, 2, 3, 4, 5])
    assert kv.find_cached_prefix([9, 9, 9, 9, 5], None) == []
    assert len(kv.find_cached_prefix([1, 2, 3, 4, 5], None)) == 1


def test_new_request_hit_at_lru_front_is_not_the_block_evicted():
    kv = _manager(num_blocks=3)
    c_tokens = [50, 51, 52, 53]
    _prefill(kv, 0, c_tokens + [54])  # blocks [0, 1]; only block 0 is full (cached)
    kv.free(0)  # empty block 1 goes to the front, cached block 0 to the back
    assert _prefill(kv, 1, list(range(8))) == [1, 2]
    kv.free(1)  # tail first: 2 then 1, both cached
    assert kv.device_pool.free_block_ids() == [0, 2, 1]  # C's block is least recently used
    assert kv.stats().num_cached_free_blocks == 3
    table = _prefill(kv, 2, c_tokens + [77, 78])
    assert table == [0, 2]  # the hit is revived; the next LRU block is evicted instead
    assert kv.device_pool.blocks[2].block_hash is None
    assert len(kv.find_cached_prefix(list(range(8)) + [0], None)) == 1  # block 1 still cached


def test_decode_allocates_a_block_only_when_crossing_a_boundary():
    kv = _manager()
    tokens = list(range(4))
    _prefill(kv, 0, tokens)
    sizes = []
    for t in range(10):
        tokens.append(100 + t)
        assert kv.append(0, 1) is None
        kv.mark_computed(0, len(tokens), tokens)
        sizes.append(len(kv.block_ids(0)))
    assert sizes == [2, 2, 2, 2, 3, 3, 3, 3, 4, 4]
    check_kv_invariants(kv)


def test_fork_then_append_copies_on_write_exactly_once():
    kv = _manager()
    tokens = list(range(6))
    parent_table = _prefill(kv, 0, tokens)
    kv.fork(0, 1)
    assert kv.block_ids(1) == parent_table and _refs(kv, parent_table) == [2, 2]
    copy = kv.append(0, 1)
    assert copy == (parent_table[1], 2)
    assert kv.block_ids(0) == [parent_table[0], 2]
    assert kv.append(1, 1) is None  # now the only owner: written in place
    assert kv.block_ids(1) == parent_table
    assert _refs(kv, [parent_table[0], parent_table[1], 2]) == [2, 1, 1]
    check_kv_invariants(kv)


def test_fork_of_full_last_block_needs_no_copy():
    kv = _manager()
    _prefill(kv, 0, list(range(8)))
    kv.fork(0, 1)
    assert kv.num_new_blocks([(0, 1), (1, 1)]) == 2
    assert kv.append(0, 1) is None and kv.append(1, 1) is None
    assert kv.block_ids(0)[:2] == kv.block_ids(1)[:2] and kv.block_ids(0)[2] != kv.block_ids(1)[2]


def test_num_new_blocks_counts_the_last_sibling_as_in_place():
    kv = _manager()
    _prefill(kv, 0, list(range(6)))
    kv.fork(0, 1)
    kv.fork(0, 2)
    assert kv.num_new_blocks([(0, 1), (1, 1), (2, 1)]) == 2
    free = kv.num_free_blocks
    copies = [kv.append(s, 1) for s in (0, 1, 2)]
    assert free - kv.num_free_blocks == 2 and copies[2] is None


def test_fork_with_reserved_slots_is_refused():
    kv = _manager()
    _prefill(kv, 0, list(range(5)))
    kv.append(0, 1)
    with pytest.raises(ValueError, match="between steps"):
        kv.fork(0, 1)
    with pytest.raises(ValueError, match="reserved"):
        kv.mark_computed(0, 7, list(range(7)))


def test_swap_out_and_in_move_each_shared_block_once():
    kv = _manager(num_blocks=8, num_cpu=8)
    table = _prefill(kv, 0, list(range(6)))
    kv.fork(0, 1)
    assert kv.num_blocks_of([0, 1]) == 2
    out = kv.swap_out([0, 1])
    assert [d for d, _ in out] == table
    cpu_ids = [c for _, c in out]
    assert kv.block_ids(0) == kv.block_ids(1) == cpu_ids
    assert kv.num_free_blocks == 8 and kv.stats().num_cpu_used_blocks == 2
    assert [kv.cpu_pool.blocks[c].ref_count for c in cpu_ids] == [2, 2]
    check_kv_invariants(kv)
    back = kv.swap_in([0, 1])
    assert [c for c, _ in back] == cpu_ids
    assert kv.block_ids(0) == kv.block_ids(1) == [d for _, d in back]
    assert kv.stats().num_cpu_used_blocks == 0 and kv.num_free_blocks == 6
    check_kv_invariants(kv)


def test_swap_without_room_is_refused():
    kv = _manager(num_blocks=4, num_cpu=1)
    _prefill(kv, 0, list(range(6)))
    with pytest.raises(RuntimeError, match="swap"):
        kv.swap_out([0])


def test_cpu_pool_never_exceeds_device_pool():
    assert _manager(num_blocks=4, num_cpu=100).cpu_pool.num_blocks == 4


def test_reserved_slots_show_in_stats_until_computed():
    kv = _manager()
    kv.admit(0, [], None, 6)
    kv.append(0, 6)
    stats = kv.stats()
    assert (stats.num_reserved_slots, stats.num_tokens_stored, stats.num_internal_frag_slots) == (6, 0, 2)
    kv.mark_computed(0, 6, list(range(6)))
    assert kv.stats().num_reserved_slots == 0 and kv.stats().num_tokens_stored == 6


def test_free_returns_every_block():
    kv = _manager()
    _prefill(kv, 0, list(range(13)))
    kv.fork(0, 1)
    kv.append(1, 1)
    kv.free(0)
    kv.free(1)
    kv.free(1)  # freeing twice is harmless: the table is gone
    check_kv_invariants(kv)
    assert kv.stats().num_free_blocks == 16 and kv.stats().num_tokens_stored == 0


def _decode(kv: KVCacheManager, seq_id: int, tokens: list[int], count: int) -> None:
    """``count`` decode steps of one token each, ``tokens`` growing."""
    for _ in range(count):
        tokens.append(len(tokens))
        kv.append(seq_id, 1)
        kv.mark_computed(seq_id, len(tokens), tokens)
        check_kv_invariants(kv)


def test_blocks_behind_the_window_are_released_as_the_sequence_advances():
    kv = KVCacheManager(16, 0, BS, enable_caching=False, sliding_window=6)
    tokens = list(range(9))
    _prefill(kv, 0, tokens)
    # The next token (position 9) sees keys 4..9: block 0 (tokens 0-3) is behind every window.
    assert kv.block_ids(0) == [0, 1, 2] and kv.tables[0].num_released == 1
    assert kv.block_ids(0)[0] == 0 and kv.tables[0].blocks[0] is None
    assert kv.num_free_blocks == 14 and kv.stats().num_window_released_blocks == 1
    _decode(kv, 0, tokens, 11)  # 20 tokens: position 20 sees 15..20, blocks 0-2 released
    assert kv.tables[0].num_released == 3 and kv.stats().num_used_blocks == 2  # tokens 12-19
    assert kv.stats().num_tokens_stored == 20 - 3 * BS
    kv.free(0)
    assert kv.num_free_blocks == 16 and kv.stats().num_window_released_blocks == 3


def test_the_last_block_stays_however_small_the_window():
    kv = KVCacheManager(16, 0, BS, enable_caching=False, sliding_window=1)
    _prefill(kv, 0, list(range(8)))  # two full blocks; the next token sees only itself
    assert kv.tables[0].num_released == 1 and kv.tables[0].blocks[1] is not None
    kv.append(0, 1)  # the next token still gets a fresh block
    assert len(kv.block_ids(0)) == 3
    check_kv_invariants(kv)


def test_a_released_block_still_serves_prefix_hits():
    kv = KVCacheManager(16, 0, BS, enable_caching=True, sliding_window=4)
    prompt = list(range(13))
    _prefill(kv, 0, prompt)  # position 13 sees 10..13: blocks 0 and 1 released, still cached
    assert kv.tables[0].num_released == 2 and kv.stats().num_cached_free_blocks == 2
    hits = kv.find_cached_prefix(prompt, None)
    assert [b.block_id for b in hits] == [0, 1, 2]


def test_fork_and_swap_keep_released_blocks_released():
    kv = KVCacheManager(16, 16, BS, enable_caching=False, sliding_window=5)
    tokens = list(range(10))
    _prefill(kv, 0, tokens)  # position 10 sees 6..10: block 0 released
    kv.fork(0, 1)
    assert kv.tables[1].num_released == 1 and kv.num_blocks_of([0, 1]) == 2
    out = kv.swap_out([0, 1])
    assert len(out) == 2 and kv.block_ids(0)[0] == 0 and kv.tables[0].blocks[0] is None
    check_kv_invariants(kv)
    kv.swap_in([0, 1])
    assert kv.tables[0].num_released == 1 and kv.num_free_blocks == 14
    check_kv_invariants(kv)
    _decode(kv, 1, tokens, 2)  # the child moves on alone: position 12 sees 8..12
    assert kv.tables[1].num_released == 2 and kv.tables[0].num_released == 1
    assert kv.num_free_blocks == 13  # the parent's blocks 1-2, the child's copy of block 2
    kv.free(0)
    kv.free(1)
    assert kv.num_free_blocks == 16


# -- truncate: a speculative step's rejected tokens roll back ----------------------------------------------------
def _speculate(kv: KVCacheManager, seq_id: int, tokens: list[int], drafts: list[int], accepted: int) -> None:
    """One verification step of ``drafts`` after ``tokens`` (the last one sampled, without K/V): K/V is written
    for the last token and every draft, ``accepted`` drafts are kept and the rest rolled back."""
    kv.append(seq_id, 1 + len(drafts))
    final = tokens + drafts[:accepted]
    kv.truncate(seq_id, len(final))
    kv.mark_computed(seq_id, len(final), final)
    check_kv_invariants(kv)


def test_truncate_returns_blocks_only_rejected_drafts_filled():
    kv = _manager()
    tokens = list(range(7))
    _prefill(kv, 0, tokens[:6])
    free = kv.num_free_blocks
    kv.append(0, 1 + 5)  # slots up to 12: a third block
    assert kv.num_free_blocks == free - 1 and kv.stats().num_reserved_slots == 6
    kv.truncate(0, 7)
    kv.mark_computed(0, 7, tokens)
    assert kv.num_free_blocks == free and len(kv.block_ids(0)) == 2
    stats = kv.stats()
    assert (stats.num_tokens_stored, stats.num_reserved_slots, stats.num_internal_frag_slots) == (7, 0, 1)
    check_kv_invariants(kv)


def test_only_accepted_tokens_are_hashed():
    kv = _manager()
    tokens = list(range(7))
    _prefill(kv, 0, tokens[:6])
    _speculate(kv, 0, tokens, [50, 51, 52, 53, 54], accepted=0)  # the drafts filled block 1: not registered
    assert len(kv.find_cached_prefix(tokens[:7] + [50, 99], None)) == 1
    _speculate(kv, 0, tokens + [60], [61, 62, 63], accepted=2)  # 10 final tokens: block 1 is full and final
    assert len(kv.find_cached_prefix(tokens + [60, 61, 62, 99], None)) == 2
    assert len(kv.find_cached_prefix(tokens + [50, 51, 52, 99], None)) == 1


def test_truncate_after_copy_on_write_leaves_the_shared_block_alone():
    kv = _manager()
    parent_table = _prefill(kv, 0, list(range(6)))
    kv.fork(0, 1)
    assert kv.append(1, 1 + 4) == (parent_table[1], 2)  # the child writes into its own copy
    kv.truncate(1, 7)
    kv.mark_computed(1, 7, list(range(6)) + [9])
    assert kv.block_ids(1) == [parent_table[0], 2] and kv.block_ids(0) == parent_table
    assert _refs(kv, parent_table) == [2, 1]
    assert kv.device_pool.blocks[parent_table[1]].num_slots == 2  # the parent's fill is untouched
    check_kv_invariants(kv)
    kv.free(0)
    kv.free(1)
    assert kv.num_free_blocks == 16


def test_truncate_never_drops_computed_or_unclaimed_slots():
    kv = _manager()
    _prefill(kv, 0, list(range(6)))
    kv.append(0, 3)
    with pytest.raises(ValueError, match="truncate"):
        kv.truncate(0, 5)  # below the computed tokens
    with pytest.raises(ValueError, match="truncate"):
        kv.truncate(0, 10)  # beyond the claimed slots
