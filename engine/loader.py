"""Checkpoint folder -> engine model: safetensors tensors copied straight into the (fused) layers; with tensor
parallelism each rank reads only its own slice of each tensor (``checkpoint_shard`` of the layer that owns it)."""
from __future__ import annotations

import glob
import os
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

import cuda_ext
from engine import quantized_model
from engine.distributed.parallel_state import TensorParallel
from engine.int4_checkpoint import Int4Reader, int4_reader
from engine.layers.activation import ActAndMul
from engine.layers.linear import Linear, Shard
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models import model_class
from engine.models.config import ModelConfig
from engine.models.moe import FusedExperts
from engine.mxfp4 import Mxfp4Reader, mxfp4_reader
from engine.quantization import quant_config


def load_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, ops: cuda_ext.KernelOps,
               show_progress: bool = True, tp: TensorParallel | None = None,
               quantization: str | None = None, quantization_group_size: int = 128) -> nn.Module:
    """Build the model (this rank's shard of it) without initialising it (meta device), fill every
    parameter from the checkpoint, then put it on ``ops`` (``use_kernels``). Linear layers are quantized as
    the checkpoint's quantization_config says, or as ``quantization`` asks (engine/quantization.py)."""
    cls = model_class(cfg.architecture)
    files = sorted(glob.glob(os.path.join(cfg.path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model folder {cfg.path!r}")
    with torch.device("meta"):
        model = cls(cfg, device, dtype, tp or TensorParallel())
    model.to(dtype).to_empty(device=device)  # cast while on meta: no full-size copy in the default dtype
    model.tie_weights()
    quant = quant_config(cfg.path, cfg.hf, quantization, quantization_group_size)
    quantized = quantized_model.prepare(model, quant)
    reader = mxfp4_reader(cfg, cls, files, dtype) or int4_reader(quant)
    missing = _unfilled(model, _load_files(model, files, show_progress, reader))
    if missing:
        raise ValueError(f"checkpoint {cfg.path!r} lacks weights for: {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    quantized_model.finish(quantized, quant, dtype)
    use_kernels(model, ops)
    return model.eval()


_FUSED_OP_LAYERS = (RMSNorm, RotaryEmbedding, ActAndMul, FusedExperts)
# One MoE expert's tensor in the per-expert layout checkpoints use: (experts module, expert, projection, tensor).
_EXPERT_TENSOR = re.compile(r"(.+\.experts)\.(\d+)\.(\w+)\.(\w+)")


def use_kernels(model: nn.Module, ops: cuda_ext.KernelOps) -> None:
    """Hands ``ops`` to the fused-op layers, packs every linear layer for ``ops``' GEMM, then lets each decoder
    layer that can run as one compiled call ``fuse``. Part of the load, so the KV pool is sized after the
    packed copies exist; the unpacked weight of a packed layer is then released (left on the meta device,
    shape intact), unless another module shares it (tied embeddings)."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    for layer in model.modules():
        if isinstance(layer, _FUSED_OP_LAYERS):
            layer.ops = ops
        if isinstance(layer, Linear):
            layer.pack(ops)
            if layer.packed is not None and uses[id(layer.weight)] == 1:
                layer.weight = nn.Parameter(layer.weight.to("meta"), requires_grad=False)
    for layer in model.modules():
        if hasattr(layer, "fuse"):
            layer.fuse(ops)


def _load_files(model: nn.Module, files: list[str], show_progress: bool, reader: Mxfp4Reader | Int4Reader | None
                ) -> dict[str, set]:
    """Fills the parameters; returns, per parameter filled, the parts that were (None: the whole tensor).
    ``reader`` reads a checkpoint's packed tensors in the form the model holds: an MXFP4 checkpoint's blocks and
    scales as one dequantized tensor, a 4-bit checkpoint's layers as the engine's int4 form."""
    params = dict(model.named_parameters())
    modules = dict(model.named_modules())
    names = _Names(params, packed=getattr(model, "packed_modules", {}),
                   renames=getattr(model, "checkpoint_renames", {}), experts=getattr(model, "expert_parts", {}),
                   unused=getattr(model, "unused_checkpoint_weight", None))
    loaded: dict[str, set] = defaultdict(set)
    with tqdm(total=_count_tensors(files), desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    name, src = reader.read(name, f) if reader else (name, f.get_slice(name))
                    target = names.target(name) if src is not None else None
                    if target is not None:
                        _copy_weight(target, src, params, modules, name)
                        loaded[target[0]].add(target[1])
                    bar.update(1)
    return loaded


def _unfilled(model: nn.Module, loaded: dict[str, set]) -> list[str]:
    """The parameters no checkpoint tensor filled, and the parts of the others that none did: a fused layer's
    projection (a checkpoint without k_proj) or one expert's (without expert 3's down_proj). Either would
    leave uninitialised memory in the model and no error."""
    packed, experts = getattr(model, "packed_modules", {}), getattr(model, "expert_parts", {})
    missing = []
    for name, param in model.named_parameters():
        parts = loaded.get(name)
        if parts is None:
            missing.append(name)
        elif None not in parts:
            missing.extend(tensor for part, tensor in _parts(name, param, packed, experts) if part not in parts)
    return missing


def _parts(name: str, param: nn.Parameter, packed: dict[str, tuple[str, int]],
           experts: dict[str, tuple[str, int]]) -> list[tuple[int | tuple[int, int], str]]:
    """Each part a parameter is filled from when the checkpoint stores them apart, with that checkpoint
    tensor's name (in the model's module names, which ``checkpoint_renames`` may have changed)."""
    module, _, attr = name.rpartition(".")
    if module.endswith(".experts"):  # FusedExperts' stacked w13 / w2: [num_experts, ...]
        return [((e, i), f"{module}.{e}.{part}.weight") for e in range(param.shape[0])
                for part, (stacked, i) in experts.items() if stacked == attr]
    parts = quantized_model.checkpoint_modules(module, packed)  # a fused layer's, in index order
    return [(i, f"{part}.{attr}") for i, part in enumerate(parts)] if len(parts) > 1 else []


def _count_tensors(files: list[str]) -> int:
    total = 0
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:  # reads only the header
            total += len(f.keys())
    return total


@dataclass(frozen=True, slots=True)
class _Names:
    """Checkpoint names -> the model's parameters: the model class's ``checkpoint_renames`` first, then its
    ``packed_modules`` (parts of a fused layer) and ``expert_parts`` (MoE experts stacked in one parameter)."""

    params: dict
    packed: dict[str, tuple[str, int]]
    renames: dict[str, str]
    experts: dict[str, tuple[str, int]]
    unused: Callable[[str], bool] | None = None  # the model class's: weights the checkpoint has for other uses

    def target(self, name: str) -> tuple[str, int | tuple[int, int] | None] | None:
        """(parameter name, its part: a shard index, (expert, shard index) or None); None = not ours (e.g. rotary
        buffers)."""
        for candidate in (name, "model." + name):
            for old, new in self.renames.items():
                candidate = candidate.replace(old, new)
            found = self._expert(candidate, name) or self._packed(candidate)
            if found is not None:
                return found
            if candidate in self.params:
                return candidate, None
        if name.endswith("rotary_emb.inv_freq") or (self.unused is not None and self.unused(name)):
            return None
        raise ValueError(f"checkpoint weight {name!r} matches no parameter of the model")

    def _packed(self, candidate: str) -> tuple[str, int] | None:
        for part, (fused, shard) in self.packed.items():
            fused_name = candidate.replace(f".{part}.", f".{fused}.")
            if fused_name != candidate and fused_name in self.params:
                return fused_name, shard
        return None

    def _expert(self, candidate: str, name: str) -> tuple[str, tuple[int, int]] | None:
        match = _EXPERT_TENSOR.fullmatch(candidate)
        if match is None or match[3] not in self.experts:
            return None
        stacked, shard = self.experts[match[3]]
        if f"{match[1]}.{stacked}" not in self.params:
            return None
        if match[4] != "weight":
            raise ValueError(f"checkpoint tensor {name!r}: quantized or biased MoE experts are not supported (the "
                             "experts run unquantized in the model's dtype; dense layers may be quantized)")
        return f"{match[1]}.{stacked}", (int(match[2]), shard)


def _copy_weight(target: tuple[str, int | tuple[int, int] | None], src, params: dict, modules: dict, name: str) -> None:
    """Copy this rank's part of checkpoint tensor ``name`` (a safetensors slice: nothing else is read): one
    shard, or one per part where the checkpoint stores a fused layer's parts stacked (``fused_checkpoint_shards``)."""
    param_name, part = target
    module_name, _, attr = param_name.rpartition(".")
    module = modules[module_name]
    fused = getattr(module, "fused_checkpoint_shards", None)
    shards = fused(attr) if fused is not None and part is None else None
    if shards is None:
        shard_of = getattr(module, "checkpoint_shard", None)
        shards = [shard_of(attr, part) if shard_of is not None else None]
    for shard in shards:
        _copy_shard(shard, src, params[param_name].data, module, name, attr)


def _copy_shard(shard: Shard | None, src, dest: torch.Tensor, module: nn.Module, name: str, attr: str) -> None:
    if shard is None:
        expected, index = list(dest.shape), slice(None)
    else:
        if shard.select is not None:
            dest = dest[shard.select]
        dest = dest.narrow(shard.dim, shard.dest_start, shard.size)
        expected = [shard.total if d == shard.dim else n for d, n in enumerate(dest.shape)]
        index = (slice(None),) * shard.dim + (slice(shard.start, shard.start + shard.size),)
    reshaped = module.checkpoint_tensor(name, attr, src, expected) if hasattr(module, "checkpoint_tensor") else None
    if reshaped is not None:  # a tensor the module reads in another shape (a per-tensor quantization scale)
        src = reshaped
    elif src.get_shape() != expected:
        raise ValueError(f"shape mismatch for {name!r}: checkpoint has {tuple(src.get_shape())}, "
                         f"model expects {tuple(expected)} (does config.json match the weights?)")
    dest.copy_(src[index])
