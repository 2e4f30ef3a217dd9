"""Linear layers on a pre-packed weight where the kernels offer it, split across tensor-parallel ranks
Megatron-style: column-parallel (output features; fused stacks such as q|k|v and gate|up split part by part)
and row-parallel (input features, one all-reduce). With one rank both are the plain layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cuda_ext import KernelOps, PackedLinear
from engine.distributed.parallel_state import TensorParallel


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's part of one checkpoint tensor, ``total`` long along ``dim``: ``[start, start + size)``,
    copied into the parameter at ``[dest_start, dest_start + size)`` along the same dim (the loader reads only
    that slice)."""

    dim: int
    total: int
    start: int
    size: int
    dest_start: int = 0


class Linear(nn.Linear):
    """nn.Linear that runs on ``packed`` once the model runner packs it (cuda_ext's skinny GEMM on CPU)."""

    packed: PackedLinear | None = None

    def pack(self, ops: KernelOps) -> None:
        self.packed = ops.pack_linear(self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) if self.packed is None else self.packed(x)


class ColumnParallelLinear(Linear):
    """Output features split across ranks; one matmul for a fused stack of ``part_sizes`` (full sizes).

    Part ``i`` is cut into ``part_splits[i]`` equal slices (default: one per rank); rank ``r`` holds slice
    ``r * part_splits[i] // tp.size``, so a part with fewer slices than ranks is replicated (KV heads when
    ``num_kv_heads < tp``, as vLLM does). Its slices sit one after another in the output rows."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool, tp: TensorParallel,
                 part_splits: list[int] | None = None) -> None:
        splits = part_splits or [tp.size] * len(part_sizes)
        local = [tp.shard(size, "the output size of a column-parallel layer", n) for size, n in zip(part_sizes, splits)]
        super().__init__(in_features, sum(local), bias=bias)
        self.tp, self.part_splits, self.local_sizes = tp, splits, local

    def checkpoint_shard(self, param: str, part: int | None) -> Shard:
        i = part or 0
        size = self.local_sizes[i]
        start = self.tp.rank * self.part_splits[i] // self.tp.size * size
        return Shard(0, size * self.part_splits[i], start, size, sum(self.local_sizes[:i]))


class RowParallelLinear(Linear):
    """Input features split across ranks: each computes a partial sum, one all-reduce adds them up, then the
    (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(tp.shard(in_features, "the input size of a row-parallel layer"), out_features, bias=bias)
        self.tp = tp

    def pack(self, ops: KernelOps) -> None:
        self.packed = ops.pack_linear(self.weight, self.bias if self.tp.size == 1 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(F.linear(x, self.weight) if self.packed is None else self.packed(x))
        return y if self.bias is None else y + self.bias

    def checkpoint_shard(self, param: str, part: int | None) -> Shard | None:
        if param == "bias":
            return None
        return Shard(1, self.in_features * self.tp.size, self.tp.rank * self.in_features, self.in_features)
