"""Linear layers on a pre-packed weight where the kernels offer it, split across tensor-parallel ranks
Megatron-style: column-parallel (output features; fused stacks such as q|k|v and gate|up split part by part)
and row-parallel (input features, one all-reduce). With one rank both are the plain layer."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from cuda_ext import KernelOps, PackedLinear
from engine.distributed.parallel_state import TensorParallel
from engine.quantization import QuantMethod, dequantize, quantize, quantized_linear


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


_QUANTIZED = {torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3"}  # safetensors' names of the quantized dtypes


class Linear(nn.Linear):
    """nn.Linear that runs on ``packed`` once the model runner packs it (cuda_ext's skinny GEMM on CPU).

    Quantized (engine/quantization.py): ``weight`` holds q (int8 or fp8) and ``weight_scale`` its fp32
    [out_features, 1] scales; otherwise ``weight_scale`` is None."""

    packed: PackedLinear | None = None
    quantizable = True  # False: kept in the model's dtype whatever the quantization (an MoE router)
    quantize_activations = False  # W8A8 (engine/quantized_model.py sets it): x quantized per row to int8

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.register_parameter("weight_scale", None)

    def hold_quantized(self, dtype: torch.dtype) -> None:
        """Room for a quantized checkpoint's q in ``dtype`` and its scales (the loader checks that the checkpoint
        filled every part)."""
        device = self.weight.device
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=dtype, device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty((self.out_features, 1), device=device),
                                         requires_grad=False)

    def quantize(self, method: QuantMethod) -> None:
        """Replaces the loaded weight by its quantized form (an LM head tied to the embedding gets its own)."""
        q, scale = quantize(self.weight.detach(), method)
        self.weight, self.weight_scale = (nn.Parameter(t, requires_grad=False) for t in (q, scale))

    def dequantize(self, dtype: torch.dtype) -> None:
        self.weight = nn.Parameter(dequantize(self.weight, self.weight_scale, dtype), requires_grad=False)
        self.weight_scale = None

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
        """pack_linear's ``scale`` (and ``quantize_activations``) for an int8 layer (the packed kernels take no
        fp8)."""
        if self.weight_scale is None or self.weight.dtype != torch.int8:
            return {}
        return {"scale": self.weight_scale, "quantize_activations": self.quantize_activations}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.unpacked(x, self.bias) if self.packed is None else self.packed(x)

    def unpacked(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_scale is None:
            return F.linear(x, self.weight, bias)
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
        if param in ("bias", "weight_scale"):  # per output feature: every rank holds them all
            return None
        return Shard(1, self.in_features * self.tp.size, self.tp.rank * self.in_features, self.in_features)
