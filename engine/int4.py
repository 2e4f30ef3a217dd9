"""4-bit weights: the engine's own form, made at load (``--quantization int4`` / ``int4-asym``) or read from AWQ,
GPTQ and compressed-tensors pack-quantized checkpoints.

The engine's form, per linear layer [out, in] with groups of ``group_size`` input columns:
``weight`` uint8 [out, in] codes 0..15, ``weight_scale`` fp32 [out, in / group_size], and for asymmetric weights
``weight_zero`` uint8 [out, in / group_size] (symmetric ones have none: their zero is 8):
``w = (code - zero) * scale``, exact in fp32.

How the hub formats store a layer (each value 4 bits, eight to an int32, the first in the lowest bits):
- GPTQ: ``qweight`` int32 [in / 8, out] packed along in; ``qzeros`` int32 [groups, out / 8] packed along out;
  ``scales`` [groups, out]; ``g_idx`` [in]. The original ("gptq") format stores zero - 1, "gptq_v2" the zero.
- AWQ (GEMM): ``qweight`` int32 [in, out / 8] and ``qzeros`` [groups, out / 8], both packed along out in the
  order 0, 2, 4, 6, 1, 3, 5, 7 (nibble i holds column AWQ_ORDER[i]); ``scales`` [groups, out].
- compressed-tensors pack-quantized: ``weight_packed`` int32 [out, in / 8] of code + 8 for signed codes -8..7,
  ``weight_scale`` [out, groups], ``weight_zero_point`` int32 [out / 8, groups] (asymmetric; packed along out,
  zero + 8), ``weight_shape`` [2], ``weight_g_idx`` [in] (activation order)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cuda_ext import reference

BITS = 4
PACK = 32 // BITS  # values per int32
SYMMETRIC_ZERO = 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_COLUMNS = [AWQ_ORDER.index(c) for c in range(PACK)]  # column c sits in nibble _AWQ_COLUMNS[c]


def quantize(weight: torch.Tensor, group_size: int, symmetric: bool
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(codes uint8 [out, in], scale fp32 [out, groups], zero uint8 [out, groups] or None for symmetric): per
    group of ``group_size`` input columns, round-to-nearest on the group's absmax (symmetric: codes 1..15 around
    8) or its min..max range (asymmetric: 0..15, the zero rounded onto the grid)."""
    out, cols = weight.shape
    w = weight.float().reshape(out, cols // group_size, group_size)
    tiny = torch.finfo(torch.float32).tiny
    if symmetric:
        scale = (w.abs().amax(-1) / 7).clamp(min=tiny)
        codes = (w / scale.unsqueeze(-1)).round().clamp(-7, 7) + SYMMETRIC_ZERO
        zero = None
    else:
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scale = ((high - low) / 15).clamp(min=tiny)
        zero = (-low / scale).round().clamp(0, 15)
        codes = ((w / scale.unsqueeze(-1)).round() + zero.unsqueeze(-1)).clamp(0, 15)
        zero = zero.to(torch.uint8)
    return codes.to(torch.uint8).reshape(out, cols), scale, zero


dequantize = reference.dequantize_w4  # (codes - zero) * scale per group (fp32 math), as the dtype asked


def unpack(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 -> uint8 codes 0..15, eight per int32 along ``dim`` (0 or 1), the lowest nibble first."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32)
    moved = packed.movedim(dim, -1)
    codes = (moved.unsqueeze(-1) >> shifts) & 0xF
    return codes.flatten(-2).movedim(-1, dim).to(torch.uint8)


def pack(codes: torch.Tensor, dim: int) -> torch.Tensor:
    """``unpack``'s inverse: uint8 codes 0..15 -> int32, eight per int32 along ``dim``."""
    moved = codes.movedim(dim, -1).to(torch.int64)
    grouped = moved.reshape(*moved.shape[:-1], -1, PACK) << torch.arange(0, 32, BITS)
    words = grouped.sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).movedim(-1, dim)


def awq_columns(codes: torch.Tensor) -> torch.Tensor:
    """Codes unpacked from an AWQ tensor (nibble order along the last dim) -> column order."""
    return codes.reshape(*codes.shape[:-1], -1, PACK)[..., _AWQ_COLUMNS].flatten(-2)


def awq_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``awq_columns``' inverse: column order -> AWQ's nibble order along the last dim."""
    return codes.reshape(*codes.shape[:-1], -1, PACK)[..., list(AWQ_ORDER)].flatten(-2)


@dataclass(frozen=True, slots=True)
class Converted:
    """A checkpoint tensor converted to the engine's form, behind the safetensors slice interface the loader
    reads through."""

    tensor: torch.Tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return {torch.uint8: "U8", torch.float32: "F32"}.get(self.tensor.dtype, str(self.tensor.dtype))

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]
