"""A linear layer whose output rows are several checkpoint matrices stacked (q|k|v, gate|up)."""
from __future__ import annotations

from torch import nn


class FusedLinear(nn.Linear):
    """One matmul instead of several; the loader copies shard ``i`` of the
    checkpoint into output rows ``[sum(shard_sizes[:i]), sum(shard_sizes[:i+1]))``."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = shard_sizes

    def shard_offset(self, shard: int) -> tuple[int, int]:
        start = sum(self.shard_sizes[:shard])
        return start, self.shard_sizes[shard]
