"""The engine's one configuration object (docs/architecture.md §6)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PreemptionMode = Literal["recompute", "swap"]
AttentionBackend = Literal["ext", "torch"]
KVAllocatorName = Literal["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"]


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs; validated in ``__post_init__``.

    ``num_device_blocks`` / ``num_cpu_blocks`` may be left ``None``: the engine
    derives them from ``kv_cache_memory_bytes`` (or ``kv_cache_memory_fraction``
    of available memory) and ``swap_space_bytes`` once the model's per-token KV
    size is known, and stores the resolved values back here.
    """

    model: str | None = None
    tokenizer: str | None = None
    block_size: int = 16
    num_device_blocks: int | None = None
    num_cpu_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.5
    swap_space_bytes: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = "recompute"
    dtype: str = "auto"
    device: str = "cpu"
    attention_backend: AttentionBackend = "ext"
    kv_allocator: KVAllocatorName = "paged"
    seed: int = 0
    num_threads: int | None = None
    show_progress: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_device_blocks", "kv_cache_memory_bytes", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.num_cpu_blocks is not None and self.num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {self.num_cpu_blocks}")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {self.kv_cache_memory_fraction}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.attention_backend not in ("ext", "torch"):
            raise ValueError(f"attention_backend must be 'ext' or 'torch', got {self.attention_backend!r}")
        if self.kv_allocator not in ("paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"):
            raise ValueError(f"unknown kv_allocator {self.kv_allocator!r}")
