"""Per-sequence block tables over a device pool and a CPU swap pool.

The three primitives of the paper: ``fork`` (share all blocks, ref+1),
``append`` (claim slots for new tokens; a new block only when the last one is
full; copy-on-write when the last block is shared) and ``free``; ``truncate``
rolls back a speculative step's rejected slots. Plus prefix
cache lookup at admission, hash registration of newly-full computed blocks,
and whole-sequence swap between the pools. With a sliding window, blocks wholly
behind it are released as the sequence advances (``None`` in the table). A hybrid
model's recurrent state slots (``state``, engine/core/state_cache.py) follow each
sequence through the same primitives.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.block_pool import Block, BlockPool
from engine.core.kv_allocator import Admission, KVCacheStats, SeqSize, cdiv
from engine.core.kv_snapshot import PoolsSnapshot
from engine.core.prefix_hash import ROOT_HASH, block_key, hash_block
from engine.core.state_cache import StateCache


@dataclass(slots=True)
class BlockTable:
    """One sequence's logical -> physical map: block j holds tokens [j*bs, (j+1)*bs); the first
    ``num_released`` are None, released behind the sliding window."""

    blocks: list[Block | None]
    block_ids: list[int]  # mirrors ``blocks`` (0 for a released block: the kernels never read it); for the runner
    salt: bytes | None  # extra prefix-hash key
    num_slots: int = 0  # claimed token slots (computed + reserved)
    num_computed: int = 0
    num_hashed: int = 0  # leading blocks whose chain hash is known
    last_hash: bytes = ROOT_HASH  # chain hash of block num_hashed - 1
    on_cpu: bool = False
    num_released: int = 0

    def held(self) -> list[Block]:
        return self.blocks[self.num_released:]


class KVCacheManager:
    def __init__(self, num_device_blocks: int, num_cpu_blocks: int, block_size: int,
                 enable_caching: bool, sliding_window: int = 0, state: StateCache | None = None) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        # No layer sees a key further back than this (0: some layer sees the whole context).
        self.sliding_window = sliding_window
        self.num_released_blocks = 0  # released behind the window, ever (KVCacheStats)
        self.device_pool = BlockPool(num_device_blocks, block_size, enable_caching)
        self.num_blocks = num_device_blocks
        # Swap space beyond the device pool could never be swapped back in whole.
        self.cpu_pool = BlockPool(min(num_cpu_blocks, num_device_blocks), block_size, enable_caching=False)
        self.tables: dict[int, BlockTable] = {}
        self.prefix_cache_queries = 0  # tokens looked up at admission
        self.prefix_cache_hits = 0  # of which served from the cache
        self.state = state  # a hybrid model's per-sequence state slots; None for attention-only models

    @property
    def num_free_blocks(self) -> int:
        return self.device_pool.num_free_blocks

    def block_ids(self, seq_id: int) -> list[int]:
        return list(self.tables[seq_id].block_ids)

    # -- admission -----------------------------------------------------------
    def find_cached_prefix(self, token_ids: list[int], salt: bytes | None) -> list[Block]:
        """Cached blocks matching the leading full blocks of ``token_ids``;
        never the block of the last token (its logits must be computed)."""
        hits: list[Block] = []
        if not self.enable_caching:
            return hits
        bs = self.block_size
        parent = ROOT_HASH
        for start in range(0, (len(token_ids) - 1) // bs * bs, bs):
            chunk = token_ids[start:start + bs]
            parent = hash_block(parent, chunk, block_key(salt, start, start + bs))  # images: their hashes join
            block = self.device_pool.lookup(parent, chunk)
            if block is None:
                break
            hits.append(block)
        if self.state is not None:  # a hit must end where a state snapshot restores the recurrent layers
            while hits and not self.state.has_snapshot(hits[-1].block_hash):
                hits.pop()
        return hits

    def can_admit(self, admissions: list[Admission]) -> bool:
        """Whether the free blocks cover admitting these sequences: their new blocks
        plus the cached blocks revived from the free queue (counted once)."""
        new = 0
        revived: set[int] = set()
        for a in admissions:
            new += cdiv(a.num_tokens, self.block_size) - len(a.hits)
            revived.update(b.block_id for b in a.hits if b.ref_count == 0)
        return new + len(revived) <= self.device_pool.num_free_blocks

    def admission_error(self, sizes: list[SeqSize]) -> str | None:
        """Why these sequences could never be admitted together, if so."""
        blocks = sum(cdiv(size.num_tokens, self.block_size) for size in sizes)
        if blocks > self.num_blocks:
            return f"needs {blocks} KV blocks, the pool has {self.num_blocks}"
        return None

    def admit(self, seq_id: int, hits: list[Block], salt: bytes | None, num_query_tokens: int,
              size: SeqSize | None = None) -> None:
        """New table holding the prefix-cache hits (call ``append`` next).
        ``size`` is for contiguous allocators: paged blocks come on demand."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        for block in hits:
            self.device_pool.incref(block)
        num_cached = len(hits) * self.block_size
        self.tables[seq_id] = BlockTable(blocks=list(hits), block_ids=[b.block_id for b in hits], salt=salt,
                                         num_slots=num_cached, num_computed=num_cached, num_hashed=len(hits),
                                         last_hash=hits[-1].block_hash if hits else ROOT_HASH)
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_cached
        if self.state is not None:
            self.state.allocate(seq_id, hits[-1].block_hash if hits else None)

    # -- the three primitives ----------------------------------------------
    def fits_without_counting(self, num_tokens: int, num_seqs: int) -> bool:
        """Conservative test, without counting blocks, that ``num_new_blocks`` for ``num_tokens`` new
        tokens over ``num_seqs`` sequences is free: per sequence at most one spilled block and one copy."""
        return num_tokens // self.block_size + 2 * num_seqs <= self.device_pool.num_free_blocks

    def num_new_blocks(self, requests: list[tuple[int, int]]) -> int:
        """Exact device blocks that ``append`` of each (seq_id, num_new_tokens)
        in order will allocate, copy-on-write copies included."""
        bs = self.block_size
        total = 0
        refs_left: dict[int, int] | None = None  # shared last blocks: refs not yet copied away
        for seq_id, num_new in requests:
            table = self.tables[seq_id]
            target = table.num_computed + num_new
            start = table.num_slots
            if target <= start:
                continue
            total += cdiv(target, bs) - len(table.blocks)
            if start % bs and table.blocks[-1].ref_count > 1:
                last = table.blocks[-1]
                refs_left = refs_left or {}
                refs = refs_left.get(last.block_id, last.ref_count)
                if refs > 1:
                    total += 1
                    refs_left[last.block_id] = refs - 1
        return total

    def append(self, seq_id: int, num_new_tokens: int) -> tuple[int, int] | None:
        """Claim slots for the next ``num_new_tokens`` tokens; returns the
        (src, dst) copy-on-write copy when the last block was shared."""
        table = self.tables[seq_id]
        bs = self.block_size
        start = table.num_slots
        target = table.num_computed + num_new_tokens
        if target <= start:
            return None
        copy = self._copy_on_write(table) if start % bs and table.blocks[-1].ref_count > 1 else None
        pool = self.device_pool
        blocks = table.blocks
        if start % bs and target <= len(blocks) * bs:  # fits in the last block: the decode hot path
            pool.add_fill(blocks[-1], target - start, 0)
            table.num_slots = target
            return copy
        while len(blocks) * bs < target:
            block = pool.allocate()
            blocks.append(block)
            table.block_ids.append(block.block_id)
        for j in range(start // bs, cdiv(target, bs)):
            block = blocks[j]
            pool.set_fill(block, min(bs, target - j * bs), block.num_computed)
        table.num_slots = target
        return copy

    def truncate(self, seq_id: int, num_slots: int) -> None:
        """Give back the claimed slots past ``num_slots`` (a speculative step's rejected tokens); blocks left
        empty return to the pool. Only reserved slots go: computed (hence possibly hashed) ones are final, and
        the slots given back were claimed by ``append`` in blocks this sequence alone holds (copy-on-write)."""
        table = self.tables[seq_id]
        if not table.num_computed <= num_slots <= table.num_slots:
            raise ValueError(f"sequence {seq_id}: truncate to {num_slots} slots outside "
                             f"[{table.num_computed}, {table.num_slots}]")
        bs, pool = self.block_size, self.device_pool
        keep = cdiv(num_slots, bs)
        while len(table.blocks) > keep:
            block = table.blocks.pop()
            table.block_ids.pop()
            pool.set_fill(block, 0, 0)
            pool.decref(block)
        if num_slots % bs:
            last = table.blocks[-1]
            pool.set_fill(last, num_slots % bs, last.num_computed)
        table.num_slots = num_slots

    def _copy_on_write(self, table: BlockTable) -> tuple[int, int]:
        old = table.blocks[-1]
        new = self.device_pool.allocate()
        self.device_pool.set_fill(new, old.num_slots, old.num_computed)
        table.blocks[-1] = new
        table.block_ids[-1] = new.block_id
        self.device_pool.decref(old)
        return old.block_id, new.block_id

    def fork(self, parent_id: int, child_id: int) -> None:
        """``child_id`` shares every block of ``parent_id``."""
        parent = self.tables[parent_id]
        if child_id in self.tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        if parent.on_cpu or parent.num_slots != parent.num_computed:
            raise ValueError("fork a running sequence only once its K/V is computed (between steps)")
        for block in parent.held():
            self.device_pool.incref(block)
        self.tables[child_id] = BlockTable(blocks=list(parent.blocks), block_ids=list(parent.block_ids),
                                           salt=parent.salt, num_slots=parent.num_slots,
                                           num_computed=parent.num_computed, num_hashed=parent.num_hashed,
                                           last_hash=parent.last_hash, num_released=parent.num_released)
        if self.state is not None:
            self.state.fork(parent_id, child_id)

    def free(self, seq_id: int) -> None:
        """Release a sequence's blocks and state slot (no-op when it holds none)."""
        if self.state is not None:
            self.state.free(seq_id)
        table = self.tables.pop(seq_id, None)
        if table is None:
            return
        pool = self.cpu_pool if table.on_cpu else self.device_pool
        # Tail first: the deepest (least shareable) prefix blocks get evicted first.
        for block in reversed(table.held()):
            pool.decref(block)

    # -- after the forward pass ---------------------------------------------
    def mark_computed(self, seq_id: int, num_computed: int, token_ids: list[int], register: bool = True) -> None:
        """K/V of the first ``num_computed`` tokens is written; newly full blocks get their chain hash
        registered for prefix caching (unless not ``register``: a later call registers them)."""
        table = self.tables[seq_id]
        if num_computed > table.num_slots:
            raise ValueError(f"sequence {seq_id}: {num_computed} computed > {table.num_slots} reserved slots")
        bs = self.block_size
        pool = self.device_pool
        done = table.num_computed
        if done % bs and num_computed <= cdiv(done, bs) * bs:  # stays in one block: the decode hot path
            pool.add_fill(table.blocks[done // bs], 0, num_computed - done)
        else:
            for j in range(done // bs, cdiv(num_computed, bs)):
                block = table.blocks[j]
                pool.set_fill(block, block.num_slots, min(bs, num_computed - j * bs))
        table.num_computed = num_computed
        if self.enable_caching and register:
            if self.state is not None and (boundary := self.state.saving_boundary(seq_id)) is not None:
                self._register_full_blocks(table, token_ids, boundary)  # the snapshot's block, by its hash
                self.state.commit_save(seq_id, table.last_hash)
            self._register_full_blocks(table, token_ids)
        if self.sliding_window:
            self._release_behind_window(table)

    def _register_full_blocks(self, table: BlockTable, token_ids: list[int], limit: int | None = None) -> None:
        bs = self.block_size
        end = table.num_computed if limit is None else min(limit, table.num_computed)
        while (table.num_hashed + 1) * bs <= end:
            start = table.num_hashed * bs
            chunk = token_ids[start:start + bs]
            table.last_hash = hash_block(table.last_hash, chunk, block_key(table.salt, start, start + bs))
            self.device_pool.register(table.blocks[table.num_hashed], table.last_hash, chunk)
            table.num_hashed += 1

    def _release_behind_window(self, table: BlockTable) -> None:
        """Frees the blocks wholly before the window of the next token (at position ``num_computed``), which
        sees keys from ``num_computed - sliding_window + 1`` on; the last block always stays (appends go there).
        A released prefix-cached block stays reusable, as any freed one does."""
        end = min((table.num_computed - self.sliding_window + 1) // self.block_size, len(table.blocks) - 1)
        for j in range(table.num_released, end):
            self.device_pool.decref(table.blocks[j])
            table.blocks[j], table.block_ids[j] = None, 0
        if end > table.num_released:
            self.num_released_blocks += end - table.num_released
            table.num_released = end

    # -- swapping -----------------------------------------------------------
    def num_blocks_of(self, seq_ids: list[int]) -> int:
        """Distinct blocks held by these sequences (what swapping them moves)."""
        return len({b.block_id for s in seq_ids for b in self.tables[s].held()})

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        """Whether the CPU pool (and the CPU state slots) can take these sequences."""
        state_fits = self.state is None or self.state.can_swap_out(seq_ids)
        return state_fits and self.num_blocks_of(seq_ids) <= self.cpu_pool.num_free_blocks

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the sequences' blocks (and states) to the CPU pool: (device, cpu) block pairs."""
        if self.state is not None:
            self.state.swap_out(seq_ids)
        return self._move(seq_ids, self.device_pool, self.cpu_pool)

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the sequences' blocks (and states) back to the device: (cpu, device) block pairs."""
        if self.state is not None:
            self.state.swap_in(seq_ids)
        return self._move(seq_ids, self.cpu_pool, self.device_pool)

    def _move(self, seq_ids: list[int], src: BlockPool, dst: BlockPool) -> list[tuple[int, int]]:
        if self.num_blocks_of(seq_ids) > dst.num_free_blocks:
            raise RuntimeError("not enough free blocks to swap")
        mapping: dict[int, Block] = {}  # a block shared within the group moves once
        for seq_id in seq_ids:
            table = self.tables[seq_id]
            moved: list[Block | None] = [None] * table.num_released
            for block in table.held():
                target = mapping.get(block.block_id)
                if target is None:
                    target = mapping[block.block_id] = dst.allocate()
                    dst.set_fill(target, block.num_slots, block.num_computed)
                else:
                    dst.incref(target)
                moved.append(target)
            for block in reversed(table.held()):
                src.decref(block)
            table.blocks = moved
            table.block_ids = [0 if b is None else b.block_id for b in moved]
            table.on_cpu = dst is self.cpu_pool
        return [(src_id, block.block_id) for src_id, block in mapping.items()]

    def cached_block_hashes(self) -> set[bytes]:
        return self.device_pool.cached_hashes()

    def stats(self) -> KVCacheStats:
        dev, cpu, bs = self.device_pool, self.cpu_pool, self.block_size
        used = dev.num_blocks - dev.num_free_blocks
        return KVCacheStats(
            block_size=bs, num_blocks=dev.num_blocks, num_used_blocks=used,
            num_free_blocks=dev.num_free_blocks, num_cached_free_blocks=dev.num_cached_free_blocks,
            num_cpu_blocks=cpu.num_blocks, num_cpu_used_blocks=cpu.num_blocks - cpu.num_free_blocks,
            num_tokens_stored=dev.num_computed_slots,
            num_reserved_slots=dev.num_used_slots - dev.num_computed_slots,
            num_internal_frag_slots=used * bs - dev.num_used_slots, num_external_frag_slots=0,
            num_free_slots=dev.num_free_blocks * bs, usage=used / dev.num_blocks if dev.num_blocks else 0.0,
            num_window_released_blocks=self.num_released_blocks)

    def snapshot(self, owners: list[list[int]]) -> PoolsSnapshot:
        """Both pools block by block; ``owners[i]`` the sequence ids of owner i (a request), whose blocks
        are listed and who owns each block it holds first."""
        device, cpu = self.device_pool.snapshot(), self.cpu_pool.snapshot()
        blocks, on_cpu = [], []
        for seq_ids in owners:
            tables = [self.tables[s] for s in seq_ids if s in self.tables]
            blocks.append(list(dict.fromkeys(b.block_id for t in tables for b in t.held())))
            on_cpu.append(any(t.on_cpu for t in tables))  # a group is swapped whole
        device.set_owners([[] if c else ids for ids, c in zip(blocks, on_cpu)])
        cpu.set_owners([ids if c else [] for ids, c in zip(blocks, on_cpu)])
        return PoolsSnapshot(device, cpu, blocks)
