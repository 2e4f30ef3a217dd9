"""The paper's baselines as a real allocator: Orca-style contiguous KV per request.

Each admitted sequence gets one run of consecutive blocks from a buddy
allocator over the device arena (granularity = one block), sized for its whole
future at once, so the runner and kernels see an ordinary block table
``[start, start + 1, ...]``. The reservation policy is the baseline:

- ``contiguous-max`` (Orca-Max): max_model_len tokens, whatever the request.
- ``contiguous-pow2`` (Orca-Pow2): prompt + the true output length rounded up
  to a power of two (at most 2x over-reservation of the output).
- ``contiguous-oracle`` (Orca-Oracle): prompt + the true output length.

"True output length" is the request's ``max_tokens``: the benchmark traces run
with ``ignore_eos`` so every request generates exactly that many tokens.

Slot accounting (in tokens; the fields of ``KVCacheStats``) partitions the arena:

- stored: slots whose K/V is written;
- reserved: slots inside the request's reservation not holding K/V yet;
- internal fragmentation: slots of a run beyond the request's reservation
  (block round-up plus the buddy's power-of-two round-up);
- external fragmentation: free slots that cannot serve the next request
  because they are scattered: all free slots while the run last refused to the
  head-of-line request still fits nowhere although the free blocks add up to
  it; else 0 (nothing blocked, or too little free memory in any layout);
- free: the remaining free slots.

No block is ever shared (like Orca): no prefix caching, no forking (n > 1),
no swapping; the whole reservation is taken at admission, so a running
sequence never needs another block and is never preempted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.baselines.buddy import BuddyAllocator, order_of
from engine.core.kv_allocator import Admission, KVCacheStats, SeqSize, cdiv
from engine.core.kv_snapshot import USED, PoolSnapshot, PoolsSnapshot

if TYPE_CHECKING:
    from engine.core.block_pool import Block

POLICIES = ("contiguous-max", "contiguous-pow2", "contiguous-oracle")


@dataclass(slots=True)
class Run:
    """One sequence's run: blocks [start, start + 2**order), ``reserved_len``
    slots of which are its reservation."""

    start: int
    order: int
    reserved_len: int
    num_slots: int = 0  # claimed (computed + scheduled this step)
    num_computed: int = 0


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


class ContiguousKVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, policy: str, max_model_len: int) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown contiguous policy {policy!r}; one of {POLICIES}")
        self.block_size = block_size
        self.policy = policy
        self.max_model_len = max_model_len
        self.num_blocks = num_blocks
        self.arena = BuddyAllocator(num_blocks)
        self.tables: dict[int, Run] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0  # always 0: nothing is shared
        self._blocked_order: int | None = None  # run order the head-of-line request was refused
        self._sum_reserved = 0  # running totals over tables, so stats() is O(1)
        self._sum_computed = 0

    @property
    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return False  # no swap pool: nothing is ever preempted

    def num_free_blocks(self) -> int:
        return self.arena.num_free_blocks

    def block_ids(self, seq_id: int) -> list[int]:
        run = self.tables[seq_id]
        return list(range(run.start, run.start + cdiv(run.num_slots, self.block_size)))

    # -- admission -----------------------------------------------------------
    def reservation(self, size: SeqSize) -> int:
        """Token slots the policy reserves for a sequence (never less than it holds)."""
        true_len = size.max_len or self.max_model_len
        if self.policy == "contiguous-max":
            wanted = self.max_model_len
        elif self.policy == "contiguous-pow2":
            wanted = min(size.num_prompt_tokens + _next_pow2(true_len - size.num_prompt_tokens), self.max_model_len)
        else:
            wanted = true_len
        return max(wanted, size.num_tokens, 1)

    def _order(self, size: SeqSize) -> int:
        return order_of(cdiv(self.reservation(size), self.block_size))

    def find_cached_prefix(self, token_ids: list[int], salt: bytes | None) -> list[Block]:
        return []

    def admission_error(self, sizes: list[SeqSize]) -> str | None:
        for size in sizes:
            if self._order(size) > self.arena.max_order:
                return (f"reserving {self.reservation(size)} tokens ({self.policy}) needs a run of "
                        f"{1 << self._order(size)} blocks; the largest run of the {self.num_blocks}-block "
                        f"arena is {self.arena.largest_run}")
        return None

    def can_admit(self, admissions: list[Admission]) -> bool:
        """Whether every sequence gets its run now (tried for real, then undone)."""
        taken: list[int] = []
        blocked = None
        for admission in admissions:
            order = self._order(admission.size)
            if not self.arena.can_allocate(order):
                blocked = order
                break
            taken.append(self.arena.allocate(order))
        for start in taken:
            self.arena.free(start)
        self._blocked_order = blocked
        return blocked is None

    def admit(self, seq_id: int, hits: list[Block], salt: bytes | None, num_query_tokens: int,
              size: SeqSize | None = None) -> None:
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a KV run")
        if hits or size is None:
            raise ValueError("a contiguous run is admitted without prefix hits and with the sequence's size")
        order = self._order(size)
        run = Run(self.arena.allocate(order), order, self.reservation(size))
        self.tables[seq_id] = run
        self._sum_reserved += run.reserved_len
        self.prefix_cache_queries += num_query_tokens

    # -- growth: all of it was reserved at admission -------------------------
    def fits_without_counting(self, num_tokens: int, num_seqs: int) -> bool:
        return True

    def num_new_blocks(self, requests: list[tuple[int, int]]) -> int:
        return 0

    def append(self, seq_id: int, num_new_tokens: int) -> None:
        run = self.tables[seq_id]
        target = run.num_computed + num_new_tokens
        if target > run.reserved_len:
            raise RuntimeError(f"sequence {seq_id} outgrew its reservation of {run.reserved_len} tokens")
        run.num_slots = max(run.num_slots, target)

    def truncate(self, seq_id: int, num_slots: int) -> None:
        """Give back claimed slots past ``num_slots``; the reservation stays the run's."""
        run = self.tables[seq_id]
        if not run.num_computed <= num_slots <= run.num_slots:
            raise ValueError(f"sequence {seq_id}: truncate to {num_slots} slots outside "
                             f"[{run.num_computed}, {run.num_slots}]")
        run.num_slots = num_slots

    def fork(self, parent_id: int, child_id: int) -> None:
        raise ValueError(f"{self.policy} shares no blocks: parallel sampling (n > 1) needs the paged allocator")

    def free(self, seq_id: int) -> None:
        run = self.tables.pop(seq_id, None)
        if run is None:
            return
        self.arena.free(run.start)
        self._sum_reserved -= run.reserved_len
        self._sum_computed -= run.num_computed

    def mark_computed(self, seq_id: int, num_computed: int, token_ids: list[int], register: bool = True) -> None:
        run = self.tables[seq_id]
        if num_computed > run.num_slots:
            raise ValueError(f"sequence {seq_id}: {num_computed} computed > {run.num_slots} reserved slots")
        self._sum_computed += num_computed - run.num_computed
        run.num_computed = num_computed

    # -- no swapping: nothing is ever preempted --------------------------------
    def num_blocks_of(self, seq_ids: list[int]) -> int:
        return sum(1 << self.tables[s].order for s in seq_ids)

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        raise RuntimeError(f"{self.policy} does not swap (its swap pool is empty)")

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        raise RuntimeError(f"{self.policy} does not swap (its swap pool is empty)")

    def _scattered(self) -> bool:
        """Would the free blocks hold the run last refused, were they not scattered?"""
        order = self._blocked_order
        return order is not None and self.arena.num_free_blocks >= 1 << order and not self.arena.can_allocate(order)

    def cached_block_hashes(self) -> set[bytes]:
        return set()  # no prefix caching

    def stats(self) -> KVCacheStats:
        bs, arena = self.block_size, self.arena
        used = arena.num_blocks - arena.num_free_blocks
        external = arena.num_free_blocks * bs if self._scattered() else 0
        return KVCacheStats(
            block_size=bs, num_blocks=arena.num_blocks, num_used_blocks=used, num_free_blocks=arena.num_free_blocks,
            num_cached_free_blocks=0, num_cpu_blocks=0, num_cpu_used_blocks=0,
            num_tokens_stored=self._sum_computed, num_reserved_slots=self._sum_reserved - self._sum_computed,
            num_internal_frag_slots=used * bs - self._sum_reserved, num_external_frag_slots=external,
            num_free_slots=arena.num_free_blocks * bs - external,
            usage=used / arena.num_blocks if arena.num_blocks else 0.0)

    def snapshot(self, owners: list[list[int]]) -> PoolsSnapshot:
        """The arena block by block: each run's blocks held once, filled from its start (the blocks past
        what the sequence claimed so far are its reservation: held, empty)."""
        device, bs = PoolSnapshot.empty(self.num_blocks), self.block_size
        for run in self.tables.values():
            span = slice(run.start, run.start + (1 << run.order))
            starts = np.arange(1 << run.order) * bs
            device.state[span], device.ref_count[span] = USED, 1
            device.filled[span] = np.clip(run.num_slots - starts, 0, bs)
            device.computed[span] = np.clip(run.num_computed - starts, 0, bs)
        blocks = [[b for s in seq_ids if s in self.tables
                   for b in range(self.tables[s].start, self.tables[s].start + (1 << self.tables[s].order))]
                  for seq_ids in owners]
        device.set_owners(blocks)
        return PoolsSnapshot(device, PoolSnapshot.empty(0), blocks)
