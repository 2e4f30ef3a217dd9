"""Rotary position embedding (neox / Hugging Face ``rotate_half`` layout)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

import cuda_ext


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, with the scalings Llama-family checkpoints use."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, llama3)")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; ``rotary(positions, x)`` rotates x in place (one op per call)."""

    # The pure-torch op until the loader hands the layer the compiled ones.
    ops: cuda_ext.KernelOps = cuda_ext.load_ops("torch")

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None,
                 device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        # Plain attributes on an explicit device: the model is built on "meta"
        # and these tables are derived state, not weights. One half each: the
        # neox layout repeats the angles over both halves of a head.
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device="cpu"), inv_freq)
        self.cos = freqs.cos().to(device, dtype)
        self.sin = freqs.sin().to(device, dtype)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> None:
        """Rotates x [T, H, D] (e.g. the q|k view of a fused projection) in place by token t's position,
        Hugging Face's ``x * cos + rotate_half(x) * sin`` with its rounding."""
        self.ops.rotary_embedding(x, positions, self.cos, self.sin)


@dataclass(slots=True, frozen=True)
class RopeStep:
    """One step's rotary for every layer: ``rope(x)`` rotates x [T, H, D] in place at the step's positions."""

    rotary: RotaryEmbedding
    positions: torch.Tensor

    def __call__(self, x: torch.Tensor) -> None:
        self.rotary(self.positions, x)
