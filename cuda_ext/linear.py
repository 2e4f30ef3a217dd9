"""Linear layers on a weight packed once at load, for the skinny GEMM op (csrc/cpu/skinny_gemm.cpp).

    packed = cuda_ext.pack_linear(weight, bias)  # None where the op does not apply: keep F.linear
    y = packed(x)                                # x @ weight.T + bias
    idx = packed.argmax(x)                       # argmax(x @ weight.T + bias) per row, without the logits
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class ArgmaxScreen:
    """An fp32 layer's bf16 copy and error bounds, for ``skinny_argmax_screened``: each row's argmax at bf16
    speed, exactly the fp32 one (the columns the bounds cannot rule out are recomputed in fp32)."""

    weight: torch.Tensor  # the fp32 weight, row-major: the survivors' logits are recomputed from it
    screen: torch.Tensor  # pack_argmax_screen's panels
    bounds: torch.Tensor  # the error bound's per-column terms


@dataclass(slots=True, frozen=True)
class PackedLinear:
    """``y = x @ weight.T + bias`` through ``torch.ops.pagedserve.skinny_linear``."""

    packed: torch.Tensor  # from pack_linear_weight (panel layout: cuda_ext/README.md)
    bias: torch.Tensor | None
    out_features: int
    screen: ArgmaxScreen | None = None  # an fp32 LM head's, where the CPU has AVX512-BF16

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

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of ``self(x)`` for 2-D ``x``, the one ``with_argmax`` gives, without the logits:
        screened where the layer has a screen (1.8-2.4x faster for a 32k-vocabulary fp32 LM head)."""
        s = self.screen
        if s is not None and x.dtype == s.weight.dtype:
            return torch.ops.pagedserve.skinny_argmax_screened(x, s.weight, s.screen, s.bounds, self.bias)
        return self.with_argmax(x)[1]


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None, screen_argmax: bool = False) -> PackedLinear | None:
    """The packed form of a CPU linear layer in a dtype the compiled op supports (fp32; bf16 on
    AVX512-BF16 CPUs), else None. The compiled ops must be loaded. ``screen_argmax`` (LM heads): an fp32
    layer also gets an ArgmaxScreen where the CPU has AVX512-BF16 (16 bits more per weight, and the fp32
    weight is kept row-major).

    The fp32 op beats MKL's sgemm at every row count measured here (1 to 2048 rows, 2-3x), not just
    decode batches, so it serves prefill too. bf16 runs on AMX tiles from 2 rows where the CPU has them
    (csrc/cpu/skinny_amx.h), on vdpbf16ps below that and elsewhere."""
    if weight.device.type != "cpu" or not torch.ops.pagedserve.skinny_linear_supports(weight.dtype):
        return None
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    screen = None
    if screen_argmax and torch.ops.pagedserve.argmax_screen_supports(weight.dtype):
        weight = weight.contiguous()
        screen = ArgmaxScreen(weight, *torch.ops.pagedserve.pack_argmax_screen(weight, bias))
    return PackedLinear(torch.ops.pagedserve.pack_linear_weight(weight), bias, weight.shape[0], screen)


def keep_unpacked(weight: torch.Tensor, bias: torch.Tensor | None, screen_argmax: bool = False) -> None:
    """``pack_linear`` of the reference backend: it keeps F.linear."""
    return None
