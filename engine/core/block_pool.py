"""A pool of physical KV blocks: ref counts, LRU free queue, prefix-hash map."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from engine.core.kv_snapshot import CACHED, COW, FREE, NO_OWNER, SHARED, USED, PoolSnapshot


@dataclass(slots=True, eq=False)
class Block:
    """One physical block. ``num_slots`` counts token slots claimed by its
    owners (written or reserved for this step), ``num_computed`` the slots
    whose K/V is written. All owners of a shared block agree on both because a
    shared block is never written (copy-on-write)."""

    block_id: int
    ref_count: int = 0
    num_slots: int = 0
    num_computed: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None  # compared on a hash hit


class BlockPool:
    """``num_blocks`` blocks of ``block_size`` slots (device or CPU).

    Free blocks sit in one O(1) queue: empty ones at the front (reused first),
    freed blocks that still hold a cached prefix at the back in LRU order. A
    cached block stays findable by hash until ``allocate`` reuses it (lazy
    eviction); a hit on a free cached block takes it out of the queue.
    Also keeps running totals of claimed/computed slots of used blocks so the
    cache manager's stats are O(1).
    """

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"bad pool shape: num_blocks={num_blocks}, block_size={block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}
        self.num_cached_free_blocks = 0
        self.num_used_slots = 0  # sum of num_slots over used blocks
        self.num_computed_slots = 0  # sum of num_computed over used blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self) -> Block:
        """An empty block with ref count 1, evicting its cached prefix if any."""
        if not self._free:
            raise RuntimeError("KV block pool exhausted")
        _, block = self._free.popitem(last=False)
        if block.block_hash is not None:
            self.num_cached_free_blocks -= 1
            if self._cached.get(block.block_hash) is block:
                del self._cached[block.block_hash]
            block.block_hash = block.token_ids = None
        block.ref_count = 1
        block.num_slots = block.num_computed = 0
        return block

    def incref(self, block: Block) -> None:
        """Share ``block`` (fork or prefix hit); revives a free cached block."""
        if block.ref_count == 0:
            del self._free[block.block_id]
            if block.block_hash is not None:
                self.num_cached_free_blocks -= 1
            self.num_used_slots += block.num_slots
            self.num_computed_slots += block.num_computed
        block.ref_count += 1

    def decref(self, block: Block) -> None:
        if block.ref_count <= 0:
            raise RuntimeError(f"double free of block {block.block_id}")
        block.ref_count -= 1
        if block.ref_count:
            return
        self.num_used_slots -= block.num_slots
        self.num_computed_slots -= block.num_computed
        self._free[block.block_id] = block
        if block.block_hash is None:
            self._free.move_to_end(block.block_id, last=False)
        else:
            self.num_cached_free_blocks += 1

    def add_fill(self, block: Block, num_slots: int, num_computed: int) -> None:
        """Grow a used block's claimed and computed slot counts (the hot path)."""
        self.num_used_slots += num_slots
        self.num_computed_slots += num_computed
        block.num_slots += num_slots
        block.num_computed += num_computed

    def set_fill(self, block: Block, num_slots: int, num_computed: int) -> None:
        """Set a used block's claimed and computed slot counts."""
        self.num_used_slots += num_slots - block.num_slots
        self.num_computed_slots += num_computed - block.num_computed
        block.num_slots = num_slots
        block.num_computed = num_computed

    def cached_hashes(self) -> set[bytes]:
        """The hashes a lookup can find now (blocks in use and cached free ones)."""
        return set(self._cached)

    def lookup(self, block_hash: bytes, token_ids: list[int]) -> Block | None:
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def register(self, block: Block, block_hash: bytes, token_ids: list[int]) -> None:
        """Make a full, computed block findable by hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block

    def free_block_ids(self) -> list[int]:
        """Free block ids in reuse order (front first)."""
        return list(self._free)

    def snapshot(self) -> PoolSnapshot:
        """Every block's state, ref count and fill; the owners are left to the cache manager (it knows
        the tables). Three passes over the blocks in C (map, fromiter): ~0.1 us a block."""
        n, blocks = self.num_blocks, self.blocks
        ref, filled, computed = (np.fromiter(map(attrgetter(name), blocks), np.int64, n)
                                 for name in ("ref_count", "num_slots", "num_computed"))
        shared = np.where(filled < self.block_size, COW, SHARED)
        state = np.where(ref == 0, FREE, np.where(ref > 1, shared, USED)).astype(np.uint8)
        state[[b.block_id for b in self._cached.values() if not b.ref_count]] = CACHED
        empty = state == FREE  # a freed block keeps its last counts until reused
        filled[empty] = computed[empty] = 0
        return PoolSnapshot(state=state, ref_count=np.minimum(ref, 0xFFFF).astype(np.uint16),
                            owner=np.full(n, NO_OWNER, np.uint16), filled=filled.astype(np.uint16),
                            computed=computed.astype(np.uint16))
