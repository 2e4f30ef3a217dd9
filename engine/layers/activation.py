"""Gated activations over a fused gate/up projection."""
from __future__ import annotations

import torch
from torch import nn

import cuda_ext


class ActAndMul(nn.Module):
    """``act(gate) * up`` where ``x = [gate | up]`` on the last dim (x: [tokens, 2 * d]), one fused op."""

    # The pure-torch ops until the loader hands the layer the compiled ones.
    ops: cuda_ext.KernelOps = cuda_ext.load_ops("torch")


class SiluAndMul(ActAndMul):
    """SwiGLU (Llama family)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.silu_and_mul(x)


class GeluTanhAndMul(ActAndMul):
    """GeGLU with the tanh-approximated GELU (Gemma's ``gelu_pytorch_tanh``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.gelu_tanh_and_mul(x)
