"""Output projection to vocabulary logits."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LMHead(nn.Module):
    """``weight`` is [vocab, hidden] as in the checkpoint (and possibly tied to the embedding).

    On CPU in fp32 a [hidden, vocab] copy is kept too: for the tall, thin logits
    GEMM with few rows (decode batches) it runs 1.3-3x faster there, and this
    matmul dominates small models' step time.
    """

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self.weight_t: torch.Tensor | None = None

    def finalize(self) -> None:
        """Called once the weights are loaded."""
        w = self.weight.data
        self.weight_t = w.t().contiguous() if w.device.type == "cpu" and w.dtype == torch.float32 else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.weight_t is not None:
            return hidden @ self.weight_t
        return F.linear(hidden, self.weight)
