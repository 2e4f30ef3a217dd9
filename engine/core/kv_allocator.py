"""What the scheduler asks of a KV allocator: the interface and the plain types it speaks
(the scheduler picks the implementation).

Two allocators implement ``KVAllocator``: the paged ``KVCacheManager``
(PagedAttention: blocks on demand, sharing, prefix caching, swap) and the
paper's contiguous baselines in ``engine.baselines`` (Orca: one run of
consecutive blocks reserved per request at admission).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from engine.core.block_pool import Block
from engine.core.kv_snapshot import PoolsSnapshot


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class KVCacheStats:
    """One snapshot; slot counts are in tokens (block_size slots per block).

    Device slots partition exactly: tokens_stored + reserved + internal_frag
    + external_frag + free_slots == num_blocks * block_size. External
    fragmentation is 0 for the paged allocator (any free block serves any
    request); see engine.baselines.contiguous for the baselines' definitions."""

    block_size: int
    num_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_free_blocks: int  # free but still holding a reusable prefix
    num_cpu_blocks: int
    num_cpu_used_blocks: int
    num_tokens_stored: int  # slots holding live K/V (a shared block counted once)
    num_reserved_slots: int  # claimed for this step, K/V not written yet
    num_internal_frag_slots: int  # empty tail slots of partially filled blocks
    num_external_frag_slots: int
    num_free_slots: int
    usage: float  # used blocks / num_blocks
    num_window_released_blocks: int = 0  # ever released behind a sliding window, before their sequence ended

    @property
    def token_utilization(self) -> float:
        """Share of the taken KV memory (used blocks) holding tokens: bytes of K/V over bytes taken."""
        taken = self.num_used_blocks * self.block_size
        return self.num_tokens_stored / taken if taken else 0.0


@dataclass(slots=True, frozen=True)
class SeqSize:
    """A sequence's length now and how long it may grow: what a contiguous
    allocator reserves for.

    ``max_len`` is prompt + max_tokens capped at max_model_len; with
    ``ignore_eos`` (how the benchmark traces are built) that is the request's
    true final length. None when neither bound is known."""

    num_tokens: int
    num_prompt_tokens: int
    max_len: int | None


@dataclass(slots=True, frozen=True)
class Admission:
    """One sequence being admitted."""

    hits: list[Block]  # its prefix-cache hits
    num_tokens: int  # token slots it needs now, hits included
    size: SeqSize


class KVAllocator(Protocol):
    block_size: int
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def num_free_blocks(self) -> int: ...
    def can_swap_out(self, seq_ids: list[int]) -> bool: ...
    def block_ids(self, seq_id: int) -> list[int]: ...
    def find_cached_prefix(self, token_ids: list[int], salt: bytes | None) -> list[Block]: ...
    def admission_error(self, sizes: list[SeqSize]) -> str | None: ...
    def can_admit(self, admissions: list[Admission]) -> bool: ...
    def admit(self, seq_id: int, hits: list[Block], salt: bytes | None, num_query_tokens: int,
              size: SeqSize | None = None) -> None: ...
    def fits_without_counting(self, num_tokens: int, num_seqs: int) -> bool: ...
    def num_new_blocks(self, requests: list[tuple[int, int]]) -> int: ...
    def append(self, seq_id: int, num_new_tokens: int) -> tuple[int, int] | None: ...
    def truncate(self, seq_id: int, num_slots: int) -> None: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def mark_computed(self, seq_id: int, num_computed: int, token_ids: list[int], register: bool = True) -> None: ...
    def num_blocks_of(self, seq_ids: list[int]) -> int: ...
    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]: ...
    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]: ...
    def stats(self) -> KVCacheStats: ...
    def cached_block_hashes(self) -> set[bytes]: ...  # every block a new prompt could hit now
    def snapshot(self, owners: list[list[int]]) -> PoolsSnapshot: ...
