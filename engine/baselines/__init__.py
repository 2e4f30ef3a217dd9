"""The paper's contiguous KV baselines (Orca), behind the scheduler's ``KVAllocator`` interface."""
from engine.baselines.contiguous import ContiguousKVCacheManager

__all__ = ["ContiguousKVCacheManager"]
