"""RMSNorm with Hugging Face's numerics (normalise in fp32, cast, then scale), optionally fused with the residual add;
Gemma's variant (scale by 1 + weight in fp32, then cast)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import cuda_ext


class RMSNorm(nn.Module):
    # The pure-torch ops until the loader hands the layer the compiled ones.
    ops: cuda_ext.KernelOps = cuda_ext.load_ops("torch")

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x); with ``residual``: ``residual += x`` in place, then norm(residual) (one fused op)."""
        if residual is not None:
            return self.ops.fused_add_rms_norm(residual, x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op, bit-equal to HF's formula in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: scales by ``1 + weight`` (zero-initialised), in fp32 before the cast, as Hugging Face's
    Gemma norm rounds (Llama's casts first, then scales)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma4RMSNorm(nn.Module):
    """Gemma 4's RMSNorm: ``x * (mean(x^2) + eps) ** -0.5`` in fp32 (its pow, not an rsqrt, so the rounding is
    transformers'), scaled by ``weight`` before the cast; without a weight where ``scaled`` is False (its value
    norm)."""

    def __init__(self, size: int, eps: float, scaled: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if scaled else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        normed = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (normed if self.weight is None else normed * self.weight.float()).to(x.dtype)
