"""Gated activation over a fused gate/up projection."""
from __future__ import annotations

import torch
from torch import nn

import cuda_ext


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where ``x = [gate | up]`` on the last dim (x: [tokens, 2 * d])."""

    # The pure-torch op until the loader hands the layer the compiled ones.
    ops: cuda_ext.KernelOps = cuda_ext.load_ops("torch")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)
