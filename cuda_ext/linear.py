"""Linear layers on a weight packed once at load, for the skinny GEMM op (csrc/cpu/skinny_gemm.cpp).

    packed = cuda_ext.pack_linear(weight, bias)  # None where the op does not apply: keep F.linear
    packed = cuda_ext.pack_linear(q, bias, scale=scale)  # int8 q [out, in], y = x @ (q * scale[:, None]).T
    packed = cuda_ext.pack_linear(q, bias, scale=scale, quantize_activations=True)  # x int8 per row too (VNNI)
    packed = cuda_ext.pack_linear(codes, bias, scale=scale, zero=zero)  # 4-bit codes (uint8), per-group scales
    y = packed(x)                                # x @ weight.T + bias
    idx = packed.argmax(x)                       # argmax(x @ weight.T + bias) per row, without the logits
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class ArgmaxScreen:
    """A lower-precision copy of a layer and its error bounds, for ``skinny_argmax_screened``: each row's argmax
    exactly as the layer's fused argmax gives it, from a cheaper pass (the columns the bounds cannot rule out
    are recomputed exactly). fp32 layers: a bf16 copy (16 bits more per weight). bf16 layers: an int8 copy
    (8 bits more per weight), used up to 4 rows, where streaming half the bytes beats the bf16 GEMM."""

    weight: torch.Tensor  # what the survivors are recomputed from: the fp32 weight row-major, or the bf16 panels
    screen: torch.Tensor  # pack_argmax_screen's panels
    bounds: torch.Tensor  # the error bound's per-column terms


@dataclass(slots=True, frozen=True)
class PackedLinear:
    """``y = x @ weight.T + bias`` through ``torch.ops.pagedserve.skinny_linear``; int8 layers (``scale`` set):
    ``y = x @ (weight * scale[:, None]).T + bias`` through ``skinny_linear_w8``, or with x quantized per row
    (``col_offset`` set) through ``skinny_linear_w8a8``."""

    packed: torch.Tensor  # from pack_linear_weight (panel layout: cuda_ext/README.md)
    bias: torch.Tensor | None
    out_features: int
    screen: ArgmaxScreen | None = None  # an fp32 LM head's, where the CPU has AVX512-BF16
    scale: torch.Tensor | None = None  # int8 layers: fp32 [out_features]; 4-bit: [panels, groups, 64]
    col_offset: torch.Tensor | None = None  # W8A8 layers: 128 * each column's sum of q (pack_linear_weight_w8a8)
    w4_offset: torch.Tensor | None = None  # 4-bit layers: zero * scale per panel and group (pack_linear_weight_w4)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.w4_offset is not None:
            y = torch.ops.pagedserve.skinny_linear_w4(rows, self.packed, self.scale, self.w4_offset, self.bias,
                                                      self.out_features)
        elif self.scale is None:
            y = torch.ops.pagedserve.skinny_linear(rows, self.packed, self.bias, self.out_features)
        elif self.col_offset is not None:
            y = torch.ops.pagedserve.skinny_linear_w8a8(rows, self.packed, self.scale, self.col_offset, self.bias,
                                                        self.out_features)
        else:
            y = torch.ops.pagedserve.skinny_linear_w8(rows, self.packed, self.scale, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)

    def with_argmax(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(self(x).float(), each row's argmax)`` for 2-D ``x``, the argmax taken inside the GEMM and the
        logits written in fp32 there (the LM head's greedy tokens and sampler input without a second pass
        over the logits; bf16 layers give their bf16-rounded values); ``(self(x), None)`` for other inputs."""
        if x.dim() != 2 or self.col_offset is not None:
            return self(x), None
        if self.w4_offset is not None:  # no fused argmax: taken from the logits, exact all the same
            logits = self(x).float()
            return logits, logits.argmax(-1)
        if self.scale is not None:
            return torch.ops.pagedserve.skinny_linear_w8_argmax(x, self.packed, self.scale, self.bias,
                                                                self.out_features)
        return torch.ops.pagedserve.skinny_linear_argmax(x, self.packed, self.bias, self.out_features)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's argmax of ``self(x)`` for 2-D ``x``, the one ``with_argmax`` gives, without the logits:
        screened where the layer has a screen (1.8-2.4x faster for a 32k-vocabulary fp32 LM head; 1.3-1.6x
        for Qwen2-0.5B's bf16 one at 1-4 rows)."""
        s = self.screen
        if s is not None and x.dtype == s.weight.dtype:
            return torch.ops.pagedserve.skinny_argmax_screened(x, s.weight, s.screen, s.bounds, self.bias)
        return self.with_argmax(x)[1]


def pack_linear(weight: torch.Tensor, bias: torch.Tensor | None, screen_argmax: bool = False,
                scale: torch.Tensor | None = None, quantize_activations: bool = False,
                zero: torch.Tensor | None = None) -> PackedLinear | None:
    """The packed form of a CPU linear layer in a dtype the compiled op supports (fp32; bf16 on
    AVX512-BF16 CPUs; an int8 ``weight`` with its per-output-channel ``scale``, for fp32 or bf16 activations,
    on any CPU, with ``quantize_activations`` the activations quantized per row where the CPU has
    AVX512-VNNI; uint8 4-bit codes with [out, groups] ``scale`` and ``zero`` (None: symmetric) on AVX-512
    CPUs), else None. The compiled ops must be loaded. ``screen_argmax`` (LM heads): the layer
    also gets an ArgmaxScreen where the CPU supports one for its dtype (fp32: AVX512-BF16, and the fp32 weight
    is kept row-major; bf16: AVX512-VNNI too, without AMX).

    The fp32 op beats MKL's sgemm at every row count measured here (1 to 2048 rows, 2-3x), not just
    decode batches, so it serves prefill too. bf16 runs on AMX tiles from 2 rows where the CPU has them
    (csrc/cpu/skinny_amx.h), on vdpbf16ps below that and elsewhere."""
    if weight.dtype == torch.uint8:
        return _pack_w4(weight.detach(), None if bias is None else bias.detach(), scale, zero)
    if weight.device.type != "cpu":
        return None
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    if scale is not None:
        scale = scale.detach().reshape(-1).float().contiguous()
        if quantize_activations:  # without VNNI: None, so F.linear runs the same arithmetic (fake-quantized x)
            if not torch.ops.pagedserve.skinny_linear_w8a8_supports():
                return None
            packed, col_offset = torch.ops.pagedserve.pack_linear_weight_w8a8(weight)
            return PackedLinear(packed, bias, weight.shape[0], scale=scale, col_offset=col_offset)
        return PackedLinear(torch.ops.pagedserve.pack_linear_weight(weight), bias, weight.shape[0], scale=scale)
    if not torch.ops.pagedserve.skinny_linear_supports(weight.dtype):
        return None
    packed, screen = torch.ops.pagedserve.pack_linear_weight(weight), None
    if screen_argmax and torch.ops.pagedserve.argmax_screen_supports(weight.dtype):
        weight = weight.contiguous()
        source = weight if weight.dtype == torch.float32 else packed
        screen = ArgmaxScreen(source, *torch.ops.pagedserve.pack_argmax_screen(weight, bias))
    return PackedLinear(packed, bias, weight.shape[0], screen)


def _pack_w4(codes: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor,
             zero: torch.Tensor | None) -> PackedLinear | None:
    """The 4-bit layer on skinny_linear_w4: packed on the host (one layout for the CPU and CUDA kernels), then
    moved to the layer's device; None on a CPU without AVX-512."""
    device = codes.device
    if device.type == "cpu" and not torch.ops.pagedserve.skinny_linear_w4_supports():
        return None
    packed = torch.ops.pagedserve.pack_linear_weight_w4(codes.cpu(), scale.detach().cpu(),
                                                        None if zero is None else zero.detach().cpu())
    packed, scales, offsets = (t.to(device) for t in packed)
    return PackedLinear(packed, bias, codes.shape[0], scale=scales, w4_offset=offsets)


def keep_unpacked(weight: torch.Tensor, bias: torch.Tensor | None, screen_argmax: bool = False,
                  scale: torch.Tensor | None = None, quantize_activations: bool = False,
                  zero: torch.Tensor | None = None) -> None:
    """``pack_linear`` of the reference backend: it keeps F.linear."""
    return None
