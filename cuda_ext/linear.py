"""Linear layers on a weight packed once at load, for the skinny GEMM op (csrc/cpu/skinny_gemm.cpp).

    packed = cuda_ext.pack_linear(weight, bias)  # None where the op does not apply: keep F.linear
    y = packed(x)                                # x @ weight.T + bias
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch


@dataclass(slots=True, frozen=True)
class PackedLinear:
    """``y = x @ weight.T + bias`` through ``torch.ops.pagedserve.skinny_linear``."""

    packed: torch.Tensor  # from pack_linear_weight (panel layout: cuda_ext/README.md)
    bias: torch.Tensor | None
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        y = torch.ops.pagedserve.skinny_linear(rows, self.packed, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def with_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(self(x).float(), each row's argmax)`` for 2-D ``x``, the argmax taken inside the GEMM and the
        logits written in fp32 there (the LM head's greedy tokens and sampler input without a second pass
        over the logits; bf16 layers give their bf16-rounded values); ``(self(x), None)`` for other inputs."""
        if x.dim() != 2:
            return self(x), None
        return torch.ops.pagedserve.skinny_linear_argmax(x, self.packed, self.bias, self.out_features)


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear | None:
    """The packed form of a CPU linear layer in a dtype the compiled op supports (fp32; bf16 on
    AVX512-BF16 CPUs without AMX), else None. The compiled ops must be loaded.

    The fp32 op beats MKL's sgemm at every row count measured here (1 to 2048 rows, 2-3x), not just
    decode batches, so it serves prefill too. bf16 stays on F.linear where the CPU has AMX: oneDNN's
    AMX kernels ran Qwen2-0.5B's layers 3-7x faster than this op at 16 and 64 rows (tied at 4)."""
    if weight.device.type != "cpu" or not torch.ops.pagedserve.skinny_linear_supports(weight.dtype):
        return None
    if weight.dtype == torch.bfloat16 and has_amx_bf16():
        return None
    packed = torch.ops.pagedserve.pack_linear_weight(weight.detach())
    return PackedLinear(packed, None if bias is None else bias.detach(), weight.shape[0])


@cache
def has_amx_bf16() -> bool:
    """Whether the CPU has AMX bf16 tiles (Linux: the kernel's CPU flags; elsewhere assumed not)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_bf16" in line for line in f)
    except OSError:
        return False


def keep_unpacked(weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``pack_linear`` of the reference backend: it keeps F.linear."""
    return None
