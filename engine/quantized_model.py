"""A QuantConfig applied to a model's linear layers, around the checkpoint load (engine/loader.py):
``prepare`` before it (room for a quantized checkpoint's q and scales), ``finish`` after it (the loaded weights
quantized, or the checkpoint's scales checked; fp8 dequantized where no kernel runs it)."""
from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from engine.layers.linear import Linear
from engine.layers.vocab_parallel import ParallelLMHead
from engine.quantization import QuantConfig

logger = logging.getLogger(__name__)


def prepare(model: nn.Module, quant: QuantConfig | None) -> dict[str, Linear]:
    """The layers ``quant`` quantizes, by module name (none without it); for a quantized checkpoint each gets
    room for its q and scales. A checkpoint's LM head tied to the embedding stays as the embedding is, and so
    do layers marked not ``quantizable`` (MoE routers)."""
    if quant is None:
        return {}
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    layers = {name: layer for name, layer in model.named_modules() if isinstance(layer, Linear) and layer.quantizable
              and not quant.ignores(checkpoint_modules(name, packed))
              and not (quant.in_checkpoint and uses[id(layer.weight)] > 1)}
    for name, layer in layers.items():
        if quant.in_checkpoint:
            layer.hold_quantized(quant, name)
        # The LM head keeps its input exact: its logits pick the tokens.
        layer.quantize_activations = quant.activations and not isinstance(layer, ParallelLMHead)
    return layers


def checkpoint_modules(name: str, packed: dict[str, tuple[str, int]]) -> list[str]:
    """The checkpoint's modules behind the engine's module ``name``: a fused layer's parts, in order."""
    parent, _, leaf = name.rpartition(".")
    parts = sorted((index, part) for part, (fused, index) in packed.items() if fused == leaf)
    return [f"{parent}.{part}" if parent else part for _, part in parts] or [name]


def finish(layers: dict[str, Linear], quant: QuantConfig | None, dtype: torch.dtype) -> None:
    """After the load: quantizes the loaded weights (made at load, unless the checkpoint holds them quantized);
    fp8 weights off the GPU are then dequantized to ``dtype`` (the CPU kernels run int8 only)."""
    if quant is None:
        return
    if not quant.in_checkpoint:
        # int4 made at load: a layer whose input size the group size does not divide (the demo model's 688-wide
        # down projection at 128) keeps the model's dtype, as llama.cpp falls back for such tensors.
        kept = [name for name, layer in layers.items() if not quant.fits(layer.in_features)]
        if kept:
            logger.info("int4 group size %d does not divide the input size of %s: kept in %s", quant.group_size,
                        ", ".join(kept), dtype)
        for name, layer in layers.items():
            if name not in kept:
                layer.quantize(quant, name)
    cpu = [layer for layer in layers.values() if not layer.weight.is_cuda]
    if quant.method == "fp8" and cpu:
        logger.info("fp8 weights of %d linear layers dequantized to %s at load (CPU: the skinny GEMM runs int8 "
                    "weights only)", len(cpu), dtype)
        for layer in cpu:
            layer.dequantize(dtype)
