"""MXFP4 weights, as gpt-oss's checkpoints store their experts (``quantization_config.quant_method: mxfp4``):
tensor ``NAME`` [..., out, in] is saved as ``NAME_blocks`` [..., out, in / 32, 16] (uint8: 32 FP4 E2M1 codes per
block, two per byte, the low nibble first) and ``NAME_scales`` [..., out, in / 32] (uint8 E8M0: the block's
scale is 2 ** (byte - 127)). The engine dequantizes them at load, on CPU, into the model's dtype (no 4-bit GEMM;
docs/engine.md gives the memory it costs), and only where the model class lists the tensor (``mxfp4_tensors``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from safetensors import safe_open

from engine.models.config import ModelConfig

BLOCK = 32  # values per scale
_CHUNK = 1 << 20  # blocks dequantized at once: 32M values
# E2M1 codes 0..15: the sign is bit 3, then two exponent bits and one mantissa bit.
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_VALUES = torch.tensor(_MAGNITUDES + tuple(-v for v in _MAGNITUDES))


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``blocks`` [..., G, 16] and ``scales`` [..., G] (uint8) -> [..., G * 32] in ``dtype``; a chunk of blocks at a
    time, so the index and fp32 temporaries stay small beside the result (a whole gpt-oss-20b projection at once
    would need several GB of them)."""
    flat_blocks, flat_scales = blocks.reshape(-1, BLOCK // 2), scales.reshape(-1)
    out = torch.empty(len(flat_scales), BLOCK, dtype=dtype)
    for start in range(0, len(flat_scales), _CHUNK):
        b, s = flat_blocks[start:start + _CHUNK], flat_scales[start:start + _CHUNK]
        codes = torch.stack((b & 0x0F, b >> 4), dim=-1).flatten(1).long()  # [n, 32]: the low nibble first
        # Exact in fp32 and bf16 (as transformers dequantizes): 2-bit significands times powers of two.
        out[start:start + _CHUNK] = FP4_VALUES[codes] * torch.exp2(s.float() - 127).unsqueeze(-1)
    return out.view(*scales.shape[:-1], -1)


@dataclass(frozen=True, slots=True)
class Dense:
    """A tensor read and converted already, behind the safetensors slice interface the loader reads through."""

    tensor: torch.Tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


@dataclass(frozen=True, slots=True)
class Mxfp4Reader:
    """Reads each ``NAME_blocks`` / ``NAME_scales`` pair as the one tensor ``NAME`` an unquantized checkpoint
    stores (transformers' layout for gpt-oss: the last two dims swapped, [..., in, out]), wherever the pair's
    halves lie in a sharded checkpoint; other tensors as they are."""

    files: dict[str, str]  # checkpoint tensor -> the safetensors file that holds it
    allowed: tuple[str, ...]  # name endings the model dequantizes (its expert projections)
    dtype: torch.dtype

    def read(self, name: str, f) -> tuple[str, object | None]:
        """(name, its source) for tensor ``name`` of the open file ``f``; no source for a scales tensor (read with
        its blocks)."""
        base, _, part = name.rpartition("_")
        if part not in ("blocks", "scales"):
            return name, f.get_slice(name)
        if not base.endswith(self.allowed):
            raise ValueError(f"checkpoint tensor {name!r}: MXFP4 (quantization_config mxfp4) is supported for the "
                             f"tensors ending in {', '.join(self.allowed)} only")
        return (name, None) if part == "scales" else (base, Dense(self._dequantized(base, f.get_tensor(name))))

    def _dequantized(self, base: str, blocks: torch.Tensor) -> torch.Tensor:
        scales_name = base + "_scales"
        if scales_name not in self.files:
            raise ValueError(f"checkpoint tensor {base + '_blocks'!r} has no {scales_name!r}")
        with safe_open(self.files[scales_name], framework="pt", device="cpu") as f:
            scales = f.get_tensor(scales_name)
        if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
            raise ValueError(f"checkpoint tensors {base!r}_blocks / _scales: expected uint8 [..., G, {BLOCK // 2}] "
                             f"and [..., G], got {blocks.dtype} {tuple(blocks.shape)} and {tuple(scales.shape)}")
        return dequantize(blocks, scales, self.dtype).transpose(-1, -2)


def mxfp4_reader(cfg: ModelConfig, model_cls: type, files: list[str], dtype: torch.dtype) -> Mxfp4Reader | None:
    """The reader for a checkpoint whose config.json says ``quant_method: mxfp4``, None for any other; a model
    class without MXFP4 tensors (``mxfp4_tensors``: every family but gpt-oss) refuses it."""
    if (cfg.hf.get("quantization_config") or {}).get("quant_method") != "mxfp4":
        return None
    allowed = getattr(model_cls, "mxfp4_tensors", ())
    if not allowed:
        raise ValueError(f"{cfg.path}/config.json: quantization_config.quant_method 'mxfp4' is supported for "
                         f"gpt-oss's experts only, not {cfg.architecture}")
    index = {}
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:  # reads only the header
            index.update(dict.fromkeys(f.keys(), file))
    return Mxfp4Reader(index, allowed, dtype)
