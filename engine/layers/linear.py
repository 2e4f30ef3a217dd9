"""Linear layers on a pre-packed weight where the kernels offer it, split across tensor-parallel ranks
Megatron-style: column-parallel (output features; fused stacks such as q|k|v and gate|up split part by part)
and row-parallel (input features, one all-reduce). With one rank both are the plain layer."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from cuda_ext import KernelOps, PackedLinear
from engine import int4
from engine.distributed.parallel_state import TensorParallel
from engine.quantization import QuantConfig, dequantize, quantize, quantized_linear


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's part of one checkpoint tensor, ``total`` long along ``dim``: ``[start, start + size)``,
    copied into the parameter at ``[dest_start, dest_start + size)`` along the same dim (the loader reads only
    that slice); of the parameter's entry ``select`` along its first dim where it stacks tensors (MoE experts)."""

    dim: int
    total: int
    start: int
    size: int
    dest_start: int = 0
    select: int | None = None


# safetensors' names of the quantized dtypes (uint8: 4-bit codes, converted from a checkpoint's packing at read)
_QUANTIZED = {torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3", torch.uint8: "U8"}


class Linear(nn.Linear):
    """nn.Linear that runs on ``packed`` once the model runner packs it (cuda_ext's skinny GEMM on CPU).

    Quantized (engine/quantization.py): ``weight`` holds q (int8 or fp8) and ``weight_scale`` its fp32
    [out_features, 1] scales, or 4-bit codes (uint8) with [out_features, groups] scales and, asymmetric,
    ``weight_zero`` (engine/int4.py); otherwise ``weight_scale`` (and ``weight_zero``) is None."""

    packed: PackedLinear | None = None
    quantizable = True  # False: kept in the model's dtype whatever the quantization (an MoE router)
    quantize_activations = False  # W8A8 (engine/quantized_model.py sets it): x quantized per row to int8

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_parameter("weight_scale", None)
        self.register_parameter("weight_zero", None)
        self.int4_group_size: int | None = None  # int4 layers: input columns per scale

    def hold_quantized(self, quant: QuantConfig, name: str) -> None:
        """Room for a quantized checkpoint's q and its scales (int4: and zero points), as ``quant`` stores layer
        ``name`` (the loader checks that the checkpoint filled every part)."""
        device, groups = self.weight.device, 1
        if quant.method == "int4":
            groups = quant.groups(self.in_features, name)
            self.int4_group_size = self.in_features // groups
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=quant.weight_dtype, device=device),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty((self.out_features, groups), device=device), requires_grad=False)
        if quant.method == "int4" and not quant.symmetric:
            self.weight_zero = nn.Parameter(torch.empty((self.out_features, groups), dtype=torch.uint8, device=device),
                                            requires_grad=False)

    def quantize(self, quant: QuantConfig, name: str) -> None:
        """Replaces the loaded weight by its quantized form (an LM head tied to the embedding gets its own)."""
        weight = self.weight.detach()
        if quant.method == "int4":
            self.int4_group_size = self.in_features // quant.groups(self.in_features, name)
            q, scale, zero = int4.quantize(weight, self.int4_group_size, quant.symmetric)
            self.weight_zero = None if zero is None else nn.Parameter(zero, requires_grad=False)
        else:
            q, scale = quantize(weight, quant.method)
        self.weight, self.weight_scale = (nn.Parameter(t, requires_grad=False) for t in (q, scale))

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the quantized one stands for, in ``dtype``."""
        if self.weight.dtype == torch.uint8:
            return int4.dequantize(self.weight, self.weight_scale, self.weight_zero, dtype)
        return dequantize(self.weight, self.weight_scale, dtype)

    def dequantize(self, dtype: torch.dtype) -> None:
        self.weight = nn.Parameter(self.dequantized_weight(dtype), requires_grad=False)
        self.weight_scale = self.weight_zero = None

    def checkpoint_tensor(self, name: str, param: str, src, expected: list[int]) -> torch.Tensor | None:
        """A scale checkpoints store in another shape than ``expected`` ([rows, 1]): one per tensor (widened to
        every row), or [rows]; None: the loader copies ``src`` (a safetensors slice) as it is."""
        stored = src.get_dtype() if param == "weight" and src.get_dtype() in _QUANTIZED.values() else None
        if param == "weight" and stored != (None if self.weight_scale is None else _QUANTIZED[self.weight.dtype]):
            raise ValueError(f"checkpoint weight {name!r} is {stored or src.get_dtype()}, but config.json's "
                             "quantization_config " + (f"quantizes it to {self.weight.dtype}" if self.weight_scale
                                                       is not None else "does not quantize it (none, or ignored)"))
        if param != "weight_scale":
            return None
        shape = src.get_shape()
        if shape in ([], [1]):
            return src[...].reshape(1, 1).expand(expected)
        return src[:].view(-1, 1) if shape == expected[:1] else None

    def pack(self, ops: KernelOps) -> None:
        self.packed = ops.pack_linear(self.weight, self.bias, **self._scale())

    def _scale(self) -> dict:
        """pack_linear's ``scale`` (and ``quantize_activations``) for an int8 layer, ``scale`` and ``zero`` for a
        4-bit one (the packed kernels take no fp8)."""
        if self.weight_scale is not None and self.weight.dtype == torch.uint8:
            return {"scale": self.weight_scale, "zero": self.weight_zero}
        if self.weight_scale is None or self.weight.dtype != torch.int8:
            return {}
        return {"scale": self.weight_scale, "quantize_activations": self.quantize_activations}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unpacked(x, self.bias) if self.packed is None else self.packed(x)

    def unpacked(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_scale is None:
            return F.linear(x, self.weight, bias)
        if self.weight.dtype == torch.uint8:
            return F.linear(x, self.dequantized_weight(x.dtype), bias)
        return quantized_linear(x, self.weight, self.weight_scale, bias, self.quantize_activations)


class ColumnParallelLinear(Linear):
    """Output features split across ranks; one matmul for a fused stack of ``part_sizes`` (full sizes).

    Part ``i`` is cut into ``part_splits[i]`` equal slices (default: one per rank); rank ``r`` holds slice
    ``r * part_splits[i] // tp.size``, so a part with fewer slices than ranks is replicated (KV heads when
    ``num_kv_heads < tp``, as vLLM does). Its slices sit one after another in the output rows."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool, tp: TensorParallel,
                 part_splits: list[int] | None = None) -> None:
        splits = part_splits or [tp.size] * len(part_sizes)
        local = [tp.shard(size, "the output size of a column-parallel layer", n) for size, n in zip(part_sizes, splits)]
        super().__init__(in_features, sum(local), bias=bias)
        self.tp, self.part_splits, self.local_sizes = tp, splits, local

    def checkpoint_shard(self, param: str, part: int | None) -> Shard:
        i = part or 0
        size = self.local_sizes[i]
        start = self.tp.rank * self.part_splits[i] // self.tp.size * size
        return Shard(dim=0, total=size * self.part_splits[i], start=start, size=size,
                     dest_start=sum(self.local_sizes[:i]))

    def fused_checkpoint_shards(self, param: str) -> list[Shard] | None:
        """This rank's slice of each part of a checkpoint tensor that stores the parts already stacked (Phi-3's
        qkv_proj and gate_up_proj): split part by part, as separate tensors would be; None with one part."""
        if len(self.local_sizes) == 1:
            return None
        full = [size * n for size, n in zip(self.local_sizes, self.part_splits)]
        shards = [self.checkpoint_shard(param, i) for i in range(len(full))]
        return [replace(shard, total=sum(full), start=sum(full[:i]) + shard.start) for i, shard in enumerate(shards)]


class RowParallelLinear(Linear):
    """Input features split across ranks: each computes a partial sum, one all-reduce adds them up, then the
    (replicated) bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__(tp.shard(in_features, "the input size of a row-parallel layer"), out_features, bias=bias)
        self.tp = tp

    def pack(self, ops: KernelOps) -> None:
        self.packed = ops.pack_linear(self.weight, self.bias if self.tp.size == 1 else None, **self._scale())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return super().forward(x)
        y = self.tp.all_reduce(self.unpacked(x, None) if self.packed is None else self.packed(x))
        return y if self.bias is None else y + self.bias

    def checkpoint_shard(self, param: str, part: int | None) -> Shard | None:
        if param in ("weight_scale", "weight_zero") and self.weight_scale.shape[1] > 1:  # int4 groups: split too
            groups = self.weight_scale.shape[1]
            return Shard(1, groups * self.tp.size, self.tp.rank * groups, groups)
        if param in ("bias", "weight_scale", "weight_zero"):  # per output feature: every rank holds them all
            return None
        return Shard(1, self.in_features * self.tp.size, self.tp.rank * self.in_features, self.in_features)
