"""Embedding and LM head split by vocabulary rows across tensor-parallel ranks. The vocabulary is padded to a
multiple of the ranks; padded rows are never looked up and their logits are cut off after the gather."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cuda_ext import KernelOps

from engine.distributed.parallel_state import TensorParallel
from engine.layers.linear import Linear, Shard


def _vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, Shard]:
    """(rows per rank, this rank's rows of the checkpoint's ``[vocab_size, dim]`` tensor)."""
    rows = -(-vocab_size // tp.size)
    start = tp.rank * rows
    return rows, Shard(0, vocab_size, start, max(0, min(rows, vocab_size - start)))


class VocabParallelEmbedding(nn.Embedding):
    """Each rank looks up the ids in its rows, zeroes the others, and one all-reduce sums the ranks."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        rows, shard = _vocab_shard(vocab_size, tp)
        super().__init__(rows, dim)
        self.tp, self.shard = tp, shard

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(input_ids)
        local = input_ids - self.shard.start
        outside = (local < 0) | (local >= self.num_embeddings)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(outside.unsqueeze(-1), 0))

    def checkpoint_shard(self, param: str, part: int | None) -> Shard:
        return self.shard


class ParallelLMHead(Linear):
    """Each rank computes the logits of its vocabulary rows; they are gathered on rank 0 only (the one that
    samples), so ``forward`` returns None on the other ranks."""

    def __init__(self, dim: int, vocab_size: int, tp: TensorParallel) -> None:
        rows, shard = _vocab_shard(vocab_size, tp)
        super().__init__(dim, rows, bias=False)
        self.tp, self.shard, self.vocab_size = tp, shard, vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.tp.size == 1:
            return super().forward(x)
        logits = self.tp.gather_last_dim(super().forward(x))
        return None if logits is None else logits[..., :self.vocab_size]

    def pack(self, ops: KernelOps) -> None:
        self.packed = ops.pack_linear(self.weight, self.bias, screen_argmax=self.tp.size == 1, **self._scale())

    def with_argmax(self, x: torch.Tensor, need_logits: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(logits, each row's argmax)``, the argmax fused into the packed GEMM where it can be (one rank;
        the logits then come out in fp32), else None: the sampler then takes it from the logits. Without
        ``need_logits`` the packed layer gives the argmax alone, ``(None, argmax)``, where it can."""
        if self.tp.size == 1 and self.packed is not None:
            return (None, self.packed.argmax(x)) if not need_logits else self.packed.with_argmax(x)
        return self(x), None

    def checkpoint_shard(self, param: str, part: int | None) -> Shard:
        return self.shard
