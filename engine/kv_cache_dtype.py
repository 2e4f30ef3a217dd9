"""The KV cache's element type (``EngineConfig.kv_cache_dtype``), resolved once: what the pools hold and what
one token of K/V costs in them."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Quantized caches store codes with one scale per (token slot, KV head) of K and of V: 2 bytes keep head size 64
# at 1.94x the tokens of bf16 (an fp32 scale would give 1.88x), and bf16 has fp32's range, so no absmax under-
# or overflows; its short mantissa costs nothing, as the codes are the row divided by the stored scale itself.
KV_CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
KV_SCALE_DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class KVCacheDtype:
    """What the KV pools store."""

    dtype: torch.dtype  # the pools' elements: the model's dtype, or int8 / fp8 codes
    quantized: bool  # codes with scales (a scale pool beside each KV pool)

    @classmethod
    def resolve(cls, name: str, model_dtype: torch.dtype) -> KVCacheDtype:
        """"auto": the model's dtype; "int8" / "fp8" (e4m3): quantized."""
        if name == "auto":
            return cls(model_dtype, False)
        return cls(KV_CODE_DTYPES[name], True)

    def token_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int, parts: int = 2) -> int:
        """One token's K and V (``parts`` 2; 1: one tensor read as both, MLA) across the layers: its elements,
        and a quantized cache's scales."""
        scale_bytes = KV_SCALE_DTYPE.itemsize if self.quantized else 0
        return parts * num_layers * num_kv_heads * (head_dim * self.dtype.itemsize + scale_bytes)
