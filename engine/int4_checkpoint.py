"""Reads an AWQ, GPTQ or compressed-tensors pack-quantized checkpoint's 4-bit layers as the engine's form
(engine/int4.py), one tensor at a time: each packed tensor becomes the parameter it fills (``weight`` codes,
``weight_scale``, ``weight_zero``), [out, ...] like every other weight, so the loader's fused-layer and
tensor-parallel slicing applies unchanged. Tensors that only confirm the layout (``g_idx``, ``weight_shape``, a
symmetric checkpoint's zeros) are checked and dropped."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine import int4
from engine.quantization import QuantConfig


@dataclass(frozen=True, slots=True)
class Int4Reader:
    quant: QuantConfig

    def read(self, name: str, f) -> tuple[str, object | None]:
        """(the parameter's name, its source) for checkpoint tensor ``name`` of the open file ``f``; no source
        for a tensor that only confirms the layout."""
        module, _, leaf = name.rpartition(".")
        fmt = self.quant.checkpoint_format
        convert = (_PACK_QUANTIZED if fmt == "pack-quantized" else _AWQ if fmt == "awq" else _GPTQ).get(leaf)
        if convert is None:
            return name, f.get_slice(name)
        param, tensor = convert(self, f.get_tensor(name), name)
        return f"{module}.{param}", None if tensor is None else int4.Converted(tensor)

    def _gptq_weight(self, packed: torch.Tensor, name: str) -> tuple[str, torch.Tensor]:
        return "weight", int4.unpack(packed, 0).t().contiguous()  # [in / 8, out] -> codes [out, in]

    def _gptq_zeros(self, packed: torch.Tensor, name: str) -> tuple[str, torch.Tensor | None]:
        zeros = int4.unpack(packed, 1)  # [groups, out]
        if self.quant.checkpoint_format == "gptq":  # stored as zero - 1, 4 bits wide
            zeros = (zeros + 1) & 0xF
        return self._zeros(zeros.t().contiguous(), name)

    def _awq_weight(self, packed: torch.Tensor, name: str) -> tuple[str, torch.Tensor]:
        return "weight", int4.awq_columns(int4.unpack(packed, 1)).t().contiguous()  # [in, out / 8] -> [out, in]

    def _awq_zeros(self, packed: torch.Tensor, name: str) -> tuple[str, torch.Tensor | None]:
        return self._zeros(int4.awq_columns(int4.unpack(packed, 1)).t().contiguous(), name)

    def _scales(self, scales: torch.Tensor, name: str) -> tuple[str, torch.Tensor]:
        return "weight_scale", scales.float().t().contiguous()  # [groups, out] -> [out, groups]

    def _packed_weight(self, packed: torch.Tensor, name: str) -> tuple[str, torch.Tensor]:
        return "weight", int4.unpack(packed, 1)  # [out, in / 8]: code + 8 -> the unsigned code itself

    def _packed_zeros(self, packed: torch.Tensor, name: str) -> tuple[str, torch.Tensor | None]:
        return self._zeros(int4.unpack(packed, 0), name)  # [out / 8, groups]: zero + 8, as the codes

    def _zeros(self, zeros: torch.Tensor, name: str) -> tuple[str, torch.Tensor | None]:
        """Zero points [out, groups]; a symmetric checkpoint's must all be the implied 8 (then dropped)."""
        if not self.quant.symmetric:
            return "weight_zero", zeros
        if not bool((zeros == int4.SYMMETRIC_ZERO).all()):
            raise ValueError(f"checkpoint tensor {name!r}: zero points other than {int4.SYMMETRIC_ZERO} in a "
                             "checkpoint whose quantization_config says symmetric")
        return "weight_zero", None

    def _g_idx(self, g_idx: torch.Tensor, name: str) -> tuple[str, None]:
        """Each input column's group: only runs of ``group_size`` columns (no activation order) run here."""
        size = self.quant.group_size or len(g_idx)
        if not torch.equal(g_idx.long(), torch.arange(len(g_idx)) // size):
            raise ValueError(f"checkpoint tensor {name!r}: columns out of group order (activation order, desc_act) "
                             "are not supported")
        return "g_idx", None

    def _shape(self, shape: torch.Tensor, name: str) -> tuple[str, None]:
        return "weight_shape", None  # the loader checks the unpacked codes' shape against the layer's


_GPTQ = {"qweight": Int4Reader._gptq_weight, "qzeros": Int4Reader._gptq_zeros, "scales": Int4Reader._scales,
         "g_idx": Int4Reader._g_idx}
_AWQ = {"qweight": Int4Reader._awq_weight, "qzeros": Int4Reader._awq_zeros, "scales": Int4Reader._scales}
_PACK_QUANTIZED = {"weight_packed": Int4Reader._packed_weight, "weight_zero_point": Int4Reader._packed_zeros,
                   "weight_shape": Int4Reader._shape, "weight_g_idx": Int4Reader._g_idx}


def int4_reader(quant: QuantConfig | None) -> Int4Reader | None:
    """The reader for a 4-bit checkpoint, None for any other."""
    return Int4Reader(quant) if quant is not None and quant.method == "int4" and quant.in_checkpoint else None
