"""Linear layers: one on a pre-packed weight where the kernels offer it, and fused stacks (q|k|v, gate|up)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cuda_ext import PackedLinear


class Linear(nn.Linear):
    """nn.Linear that runs on ``packed`` once the model runner sets it (cuda_ext's skinny GEMM on CPU)."""

    packed: PackedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias) if self.packed is None else self.packed(x)


class FusedLinear(Linear):
    """One matmul instead of several; the loader copies shard ``i`` of the
    checkpoint into output rows ``[sum(shard_sizes[:i]), sum(shard_sizes[:i+1]))``."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def shard_offset(self, shard: int) -> tuple[int, int]:
        start = sum(self.shard_sizes[:shard])
        return start, self.shard_sizes[shard]
