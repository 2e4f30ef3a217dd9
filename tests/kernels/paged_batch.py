"""Builders for the kernel tests: a paged batch laid out like the engine's cache."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from cuda_ext import reference

NUM_LAYERS = 3
LAYER = 1  # a middle layer, so the per-layer views have a non-trivial stride(0) and offset

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]),
]


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor  # [T, Hq, D], a strided slice of a fused qkv tensor
    kv_cache: torch.Tensor  # [num_blocks, num_layers, 2, Hkv, block_size, D]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]  # per sequence, dense [seq_len, Hkv, D]
    values: list[torch.Tensor]
    scale: float

    @property
    def key_cache(self) -> torch.Tensor:
        return self.kv_cache[:, LAYER, 0]

    @property
    def value_cache(self) -> torch.Tensor:
        return self.kv_cache[:, LAYER, 1]

    def attention_args(self, out: torch.Tensor) -> tuple:
        q_lens = self.query_start_loc.diff()
        return (out, self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc, int(q_lens.max()), int(self.seq_lens.max()), self.scale)


def slots_for(table: list[int], positions: range, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def make_batch(seq_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int, head_size: int,
               block_size: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> PagedBatch:
    """Random K/V written into shuffled blocks of a NaN-filled cache, so any read of a
    slot that does not belong to the sequence poisons the result."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + 2
    # Padding past each sequence's blocks holds garbage ids, some out of range.
    tables = torch.randint(-7, 10**6, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    kv_cache = torch.full((num_blocks, NUM_LAYERS, 2, num_kv_heads, block_size, head_size), float("nan"), dtype=dtype)
    keys, values, slots = [], [], []
    for b, (n, used) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[b, :used] = torch.tensor(perm[:used], dtype=torch.int32)
        perm = perm[used:]
        keys.append(torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype))
        values.append(torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype))
        slots += slots_for(tables[b].tolist(), range(n), block_size)
    reference.reshape_and_cache(torch.cat(keys), torch.cat(values), kv_cache[:, LAYER, 0], kv_cache[:, LAYER, 1],
                                torch.tensor(slots, dtype=torch.int64))
    total_q = sum(q_lens)
    qkv = torch.randn(total_q, (num_heads + 2 * num_kv_heads) * head_size, generator=gen).to(dtype)
    query = qkv[:, : num_heads * head_size].view(total_q, num_heads, head_size)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return PagedBatch(query.to(device), kv_cache.to(device), tables.to(device), lens.to(device), starts.to(device),
                      [k.to(device) for k in keys], [v.to(device) for v in values], head_size**-0.5)
