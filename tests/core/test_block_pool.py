import pytest

from engine.core.block_pool import BlockPool
from engine.core.prefix_hash import ROOT_HASH, hash_block


def _cache(pool: BlockPool, block, tokens: list[int]) -> bytes:
    h = hash_block(ROOT_HASH, tokens)
    pool.register(block, h, tokens)
    return h


def test_fresh_pool_allocates_in_id_order():
    pool = BlockPool(4, block_size=4)
    assert [pool.allocate().block_id for _ in range(4)] == [0, 1, 2, 3]
    assert pool.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="exhausted"):
        pool.allocate()


def test_freed_cached_blocks_are_evicted_in_lru_order_and_lazily():
    pool = BlockPool(4, block_size=4)
    blocks = [pool.allocate() for _ in range(4)]
    hashes = [_cache(pool, b, [i] * 4) for i, b in enumerate(blocks)]
    for i in (2, 0, 3, 1):
        pool.decref(blocks[i])
    assert pool.num_cached_free_blocks == 4
    # Still findable while free: eviction happens only when a block is reused.
    assert pool.lookup(hashes[1], [1] * 4) is blocks[1]
    assert pool.allocate() is blocks[2]
    assert pool.lookup(hashes[2], [2] * 4) is None
    assert pool.lookup(hashes[0], [0] * 4) is blocks[0]
    assert [pool.allocate().block_id for _ in range(3)] == [0, 3, 1]
    assert pool.num_cached_free_blocks == 0


def test_empty_free_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3, block_size=4)
    a, b, c = (pool.allocate() for _ in range(3))
    _cache(pool, a, [1, 2, 3, 4])
    pool.decref(a)
    pool.decref(b)  # holds nothing reusable
    pool.decref(c)
    assert pool.free_block_ids() == [c.block_id, b.block_id, a.block_id]


def test_hit_on_free_cached_block_revives_it():
    pool = BlockPool(2, block_size=4)
    a, b = pool.allocate(), pool.allocate()
    h = _cache(pool, a, [5, 6, 7, 8])
    pool.decref(a)
    pool.decref(b)
    hit = pool.lookup(h, [5, 6, 7, 8])
    pool.incref(hit)
    assert hit.ref_count == 1 and pool.num_cached_free_blocks == 0
    assert pool.allocate() is b  # the hit block is out of the free queue
    with pytest.raises(RuntimeError):
        pool.allocate()


def test_lookup_compares_token_ids_and_first_writer_wins():
    pool = BlockPool(2, block_size=2)
    a, b = pool.allocate(), pool.allocate()
    h = hash_block(ROOT_HASH, [1, 2])
    pool.register(a, h, [1, 2])
    pool.register(b, h, [1, 2])
    assert pool.lookup(h, [1, 2]) is a and b.block_hash is None
    assert pool.lookup(h, [1, 3]) is None  # same key, other tokens: a collision is a miss


def test_double_free_is_an_error():
    pool = BlockPool(1)
    block = pool.allocate()
    pool.decref(block)
    with pytest.raises(RuntimeError, match="double free"):
        pool.decref(block)


def test_caching_disabled_never_registers():
    pool = BlockPool(1, block_size=2, enable_caching=False)
    block = pool.allocate()
    h = hash_block(ROOT_HASH, [1, 2])
    pool.register(block, h, [1, 2])
    assert pool.lookup(h, [1, 2]) is None


def test_hash_chains_parent_and_salt():
    first = hash_block(ROOT_HASH, [1, 2])
    assert hash_block(first, [3, 4]) != hash_block(hash_block(ROOT_HASH, [9, 9]), [3, 4])
    assert hash_block(ROOT_HASH, [1, 2], b"tenant-a") != hash_block(ROOT_HASH, [1, 2], b"tenant-b")
    assert hash_block(ROOT_HASH, [1, 2], b"") == hash_block(ROOT_HASH, [1, 2])
    assert len(first) == 32
