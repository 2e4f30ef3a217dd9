"""What the scheduler asks of a KV allocator, and which one a config gets.

Two allocators implement ``KVAllocator``: the paged ``KVCacheManager``
(PagedAttention: blocks on demand, sharing, prefix caching, swap) and the
paper's contiguous baselines in ``engine.baselines`` (Orca: one run of
consecutive blocks reserved per request at admission).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from engine.baselines import ContiguousKVCacheManager
from engine.core.block_pool import Block
from engine.core.kv_cache_manager import KVCacheManager, KVCacheStats
from engine.core.scheduler_config import SchedulerConfig

logger = logging.getLogger(__name__)


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
    @property
    def num_free_cpu_blocks(self) -> int: ...
    def block_ids(self, seq_id: int) -> list[int]: ...
    def find_cached_prefix(self, token_ids: list[int], salt: bytes | None) -> list[Block]: ...
    def admission_error(self, sizes: list[SeqSize]) -> str | None: ...
    def can_admit(self, admissions: list[Admission]) -> bool: ...
    def admit(self, seq_id: int, hits: list[Block], salt: bytes | None, num_query_tokens: int,
              size: SeqSize | None = None) -> None: ...
    def fits_without_counting(self, num_tokens: int, num_seqs: int) -> bool: ...
    def num_new_blocks(self, requests: list[tuple[int, int]]) -> int: ...
    def append(self, seq_id: int, num_new_tokens: int) -> tuple[int, int] | None: ...
    def fork(self, parent_id: int, child_id: int) -> None: ...
    def free(self, seq_id: int) -> None: ...
    def mark_computed(self, seq_id: int, num_computed: int, token_ids: list[int]) -> None: ...
    def num_blocks_of(self, seq_ids: list[int]) -> int: ...
    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]: ...
    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]: ...
    def stats(self) -> KVCacheStats: ...


def make_kv_allocator(config: SchedulerConfig) -> KVAllocator:
    if config.kv_allocator == "paged":
        return KVCacheManager(config.num_device_blocks, config.num_cpu_blocks,
                              config.block_size, config.enable_prefix_caching)
    if config.enable_prefix_caching:
        logger.info("prefix caching is off: the %s allocator shares no blocks (paged only)", config.kv_allocator)
    if config.num_cpu_blocks:
        logger.info("swap space unused: the %s allocator reserves at admission and never preempts",
                    config.kv_allocator)
    if config.max_model_len is None:
        raise ValueError(f"the {config.kv_allocator} allocator needs max_model_len")
    return ContiguousKVCacheManager(config.num_device_blocks, config.block_size, config.kv_allocator,
                                    config.max_model_len)
