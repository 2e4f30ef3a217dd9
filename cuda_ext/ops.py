"""The four KV-cache ops, the fused layer ops and the linear-layer packer behind one object, compiled or pure-torch."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cuda_ext import reference
from cuda_ext.linear import PackedLinear, keep_unpacked, pack_linear

# The head sizes the compiled paged attention supports, read from the one list the kernels expand.
HEAD_SIZES = tuple(int(d) for d in re.findall(r"X\((\d+)\)", next(
    line for line in (Path(__file__).parent / "csrc" / "head_sizes.h").read_text().splitlines()
    if line.startswith("#define PAGEDSERVE_HEAD_SIZES(X)")).partition(")")[2]))


@dataclass(slots=True, frozen=True)
class KernelOps:
    """reshape_and_cache, paged_attention, copy_blocks, swap_blocks, and the fused layer ops
    fused_add_rms_norm, rotary_embedding, silu_and_mul, gelu_tanh_and_mul, greedy sampling's row_argmax,
    structured output's apply_token_bitmask and masked_row_argmax, MoE's grouped expert GEMM fused_moe,
    Gated DeltaNet's gated_delta_rule and causal_conv1d over state slots (signatures in cuda_ext.reference),
    and
    pack_linear: (weight, bias, screen_argmax=False) -> the layer on the skinny GEMM op, or None to keep
    F.linear;
    llama_decoder_layer: a whole Llama-family layer on packed weights in one call (CPU), or None."""

    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., None]
    copy_blocks: Callable[..., None]
    swap_blocks: Callable[..., None]
    fused_add_rms_norm: Callable[..., torch.Tensor]
    rotary_embedding: Callable[..., None]
    silu_and_mul: Callable[..., torch.Tensor]
    gelu_tanh_and_mul: Callable[..., torch.Tensor]
    row_argmax: Callable[[torch.Tensor], torch.Tensor]
    apply_token_bitmask: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    masked_row_argmax: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    fused_moe: Callable[..., torch.Tensor]
    gated_delta_rule: Callable[..., torch.Tensor]
    causal_conv1d: Callable[..., torch.Tensor]
    pack_linear: Callable[..., PackedLinear | None]
    llama_decoder_layer: Callable[..., torch.Tensor] | None


ATTENTION_KERNELS = {"simple": "paged_attention", "split": "paged_attention_split"}


def load_ops(backend: str = "ext", attention_kernel: str = "simple") -> KernelOps:
    """"ext": the compiled torch.ops.pagedserve ops (built on first use); "torch": the reference.
    attention_kernel picks paged_attention's op: "simple", or "split" (the flash-decoding CUDA kernels; the
    CPU kernel on the CPU, the reference's model of the split arithmetic under "torch")."""
    if attention_kernel not in ATTENTION_KERNELS:
        raise ValueError(f"unknown attention_kernel {attention_kernel!r}: expected one of {', '.join(ATTENTION_KERNELS)}")
    if backend == "torch":
        module = reference
    elif backend == "ext":
        from cuda_ext.build import build  # imported here: `python -m cuda_ext.build` runs it as __main__

        build()
        module = torch.ops.pagedserve
    else:
        raise ValueError(f"unknown kernel backend {backend!r}: expected 'ext' or 'torch'")
    return KernelOps(
        reshape_and_cache=module.reshape_and_cache,
        paged_attention=getattr(module, ATTENTION_KERNELS[attention_kernel]),
        copy_blocks=module.copy_blocks,
        swap_blocks=module.swap_blocks,
        fused_add_rms_norm=module.fused_add_rms_norm,
        rotary_embedding=module.rotary_embedding,
        silu_and_mul=module.silu_and_mul,
        gelu_tanh_and_mul=module.gelu_tanh_and_mul,
        row_argmax=module.row_argmax,
        apply_token_bitmask=module.apply_token_bitmask,
        masked_row_argmax=module.masked_row_argmax,
        fused_moe=module.fused_moe,
        gated_delta_rule=module.gated_delta_rule,
        causal_conv1d=module.causal_conv1d,
        pack_linear=pack_linear if backend == "ext" else keep_unpacked,
        llama_decoder_layer=module.llama_decoder_layer if backend == "ext" else None,
    )


def is_built() -> bool:
    """True once the compiled ops are loaded into this process."""
    return hasattr(torch.ops.pagedserve, "paged_attention")
