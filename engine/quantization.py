"""Quantized linear weights: the format a checkpoint's ``quantization_config`` describes (compressed-tensors int8,
fp8 and 4-bit pack-quantized, the ``fp8`` method, AWQ and GPTQ), or int8/fp8/int4 made at load
(``EngineConfig.quantization``), and the helpers that quantize and dequantize them.

4-bit weights (engine/int4.py) are grouped along the input, symmetric or with a zero point per group.

Every 8-bit scheme is symmetric, per output channel (or per tensor, widened to per channel at load):
``weight = q * weight_scale`` with q int8 or float8_e4m3fn [out, in] and weight_scale fp32 [out, 1]. int8 layers
may also quantize their input per row at run time (W8A8: dynamic per-token int8 activations, the scheme
llm-compressor's W8A8 checkpoints are calibrated for)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch

from cuda_ext import reference

QuantMethod = Literal["int8", "fp8", "int4"]
# EngineConfig.quantization's values: (weight format, whether int8 activations are quantized per row too).
LOAD_SCHEMES: dict[str, tuple[QuantMethod, bool]] = {"int8": ("int8", False), "w8a8": ("int8", True),
                                                     "fp8": ("fp8", False), "int4": ("int4", False),
                                                     "int4-asym": ("int4", False)}
WEIGHT_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}
INT4_GROUP_SIZES = (32, 64, 128)  # --quantization int4's choices (a checkpoint may use any, or one per row)
_QMAX = {"int8": 127.0, "fp8": torch.finfo(torch.float8_e4m3fn).max}
# compressed-tensors formats that store one plain int8 / fp8 tensor per weight (pack-quantized packs int32s).
_CT_FORMATS = {"int": ("int-quantized", "naive-quantized"), "float": ("float-quantized", "naive-quantized")}


@dataclass(frozen=True, slots=True)
class QuantConfig:
    method: QuantMethod
    in_checkpoint: bool  # the checkpoint stores q and weight_scale; else the loaded weights are quantized
    ignore: tuple[str, ...] = ()  # modules kept unquantized: checkpoint names, or "re:" + a regex
    activations: bool = False  # int8 layers quantize their input per row (W8A8); the LM head never does
    group_size: int | None = None  # int4: input columns per scale (None: one group per row)
    symmetric: bool = True  # int4: False = a zero point per group
    checkpoint_format: str | None = None  # int4 checkpoints: "gptq", "gptq_v2", "awq" or "pack-quantized"

    @property
    def weight_dtype(self) -> torch.dtype:
        return WEIGHT_DTYPES[self.method]

    @property
    def scheme(self) -> str:
        """Its name among EngineConfig.quantization's values."""
        if self.method == "int4":
            return "int4" if self.symmetric else "int4-asym"
        return "w8a8" if self.activations else self.method

    def fits(self, in_features: int) -> bool:
        """Whether int4's group size divides a layer's rows (always, for the 8-bit schemes)."""
        return self.group_size is None or in_features % self.group_size == 0

    def groups(self, in_features: int, layer: str) -> int:
        """How many int4 groups a layer's rows have; a size that does not divide them is a ValueError."""
        if self.group_size is None:
            return 1
        if in_features % self.group_size:
            raise ValueError(f"int4 group size {self.group_size} does not divide {layer}'s {in_features} input "
                             "features (choose another quantization group size)")
        return in_features // self.group_size

    def ignores(self, module_names: list[str]) -> bool:
        """Whether the layer whose checkpoint modules are ``module_names`` (a fused layer's parts) stays
        unquantized; parts that disagree cannot share one weight."""
        ignored = {any(_matches(name, pattern) for pattern in self.ignore) for name in module_names}
        if len(ignored) > 1:
            raise ValueError(f"quantization_config.ignore lists some of {module_names} but not all: their "
                             "weights are fused into one layer here")
        return ignored.pop()


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def quant_config(path: str, hf: dict, requested: str | None, group_size: int = 128) -> QuantConfig | None:
    """The checkpoint's quantization (config.json ``quantization_config``), or ``requested`` (a LOAD_SCHEMES key;
    int4 in groups of ``group_size``) made at load from an unquantized checkpoint; None for neither. A config
    this engine cannot run is a ValueError naming its field."""
    raw = hf.get("quantization_config")
    # MXFP4 quantizes experts only, dequantized at load (engine/mxfp4.py): the linear layers are as if unquantized.
    if raw is None or raw.get("quant_method") == "mxfp4":
        if requested is None:
            return None
        method, activations = LOAD_SCHEMES[requested]
        if method == "int4":
            return QuantConfig("int4", False, group_size=group_size, symmetric=requested == "int4")
        # W8A8 leaves the LM head as it is, as llm-compressor does: the widest layer, whose logits pick the
        # tokens, keeps its exact inputs and the fused argmax of the model's dtype.
        return QuantConfig(method, in_checkpoint=False, ignore=("lm_head",) if activations else (),
                           activations=activations)
    where = f"{path}/config.json: quantization_config"
    method = raw.get("quant_method")
    if method == "compressed-tensors":
        config = _compressed_tensors(where, raw)
    elif method == "fp8":
        config = _fp8_method(where, raw)
    elif method == "gptq":
        config = _gptq(where, raw)
    elif method == "awq":
        config = _awq(where, raw)
    else:
        raise ValueError(f"{where}.quant_method {method!r} is not supported (compressed-tensors int8/fp8/int4, "
                         "fp8, gptq, awq; mxfp4 for gpt-oss's experts)")
    if requested not in (None, config.scheme):
        raise ValueError(f"quantization={requested!r}, but {where} describes {config.scheme}")
    return config


def _compressed_tensors(where: str, raw: dict) -> QuantConfig:
    groups = raw.get("config_groups") or {}
    if len(groups) != 1:
        raise ValueError(f"{where}.config_groups: exactly one group is supported, got {len(groups)}")
    name, group = next(iter(groups.items()))
    at = f"{where}.config_groups.{name}"
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{at}.targets must be ['Linear'], got {group.get('targets')!r}")
    weights = group.get("weights") or {}
    kind = weights.get("type")
    _require(at + ".weights.type", kind, ("int", "float"))
    if kind == "int" and weights.get("num_bits") == 4:
        return _compressed_tensors_w4a16(where, at, raw, group)
    _require(at + ".weights.num_bits", weights.get("num_bits"), (8,))
    _require(at + ".weights.symmetric", weights.get("symmetric"), (True,))
    _require(at + ".weights.strategy", weights.get("strategy"), ("channel", "tensor"))
    _require(at + ".weights.group_size", weights.get("group_size"), (None, -1))
    _require(at + ".weights.dynamic", weights.get("dynamic", False), (False,))
    _require(at + ".format", group.get("format") or raw.get("format"), _CT_FORMATS[kind])
    int8_activations = _int8_activations(at + ".input_activations", group.get("input_activations"))
    _require(where + ".kv_cache_scheme", raw.get("kv_cache_scheme"), (None,))
    return QuantConfig("int8" if kind == "int" else "fp8", True, tuple(raw.get("ignore") or ()),
                       activations=kind == "int" and int8_activations)


def _int8_activations(at: str, activations: dict | None) -> bool:
    """Whether the layers quantize their input per row to int8 (W8A8). Only dynamic schemes run (no
    input_scale tensors); fp8 activations stay in the model's dtype off the GPU, where _scaled_mm quantizes
    them per row anyway."""
    if activations is None:
        return False
    _require(at + ".dynamic", activations.get("dynamic"), (True,))
    if activations.get("type") != "int":
        return False
    _require(at + ".num_bits", activations.get("num_bits"), (8,))
    _require(at + ".symmetric", activations.get("symmetric"), (True,))
    _require(at + ".strategy", activations.get("strategy"), ("token",))
    return True


def _fp8_method(where: str, raw: dict) -> QuantConfig:
    _require(where + ".fmt", raw.get("fmt", "e4m3"), ("e4m3",))
    _require(where + ".activation_scheme", raw.get("activation_scheme", "dynamic"), ("dynamic",))
    _require(where + ".weight_block_size", raw.get("weight_block_size"), (None,))
    ignore = raw.get("ignored_layers") or raw.get("modules_to_not_convert") or ()
    return QuantConfig("fp8", True, tuple(ignore))


def _compressed_tensors_w4a16(where: str, at: str, raw: dict, group: dict) -> QuantConfig:
    """W4A16: 4-bit weights packed eight to an int32 (engine/int4.py), per group or per channel."""
    weights = group["weights"]
    strategy = weights.get("strategy")
    _require(at + ".weights.strategy", strategy, ("group", "channel"))
    _require(at + ".weights.dynamic", weights.get("dynamic", False), (False,))
    _require(at + ".weights.actorder", weights.get("actorder"), (None, "weight"))
    _require(at + ".format", group.get("format") or raw.get("format"), ("pack-quantized",))
    _require(at + ".input_activations", group.get("input_activations"), (None,))
    _require(where + ".kv_cache_scheme", raw.get("kv_cache_scheme"), (None,))
    group_size = _group_size(at + ".weights.group_size", weights.get("group_size")) if strategy == "group" else None
    return QuantConfig("int4", True, tuple(raw.get("ignore") or ()), group_size=group_size,
                       symmetric=_flag(at + ".weights.symmetric", weights.get("symmetric")),
                       checkpoint_format="pack-quantized")


def _gptq(where: str, raw: dict) -> QuantConfig:
    """AutoGPTQ / GPTQModel checkpoints (``qweight`` / ``qzeros`` / ``scales`` / ``g_idx``); activation order
    (``desc_act``) is not supported: its groups are not runs of columns."""
    _require(where + ".bits", raw.get("bits"), (4,))
    _require(where + ".desc_act", raw.get("desc_act", False), (False,))
    fmt = raw.get("checkpoint_format", "gptq")
    _require(where + ".checkpoint_format", fmt, ("gptq", "gptq_v2"))
    ignore = ("lm_head",) if not raw.get("lm_head") else ()
    return QuantConfig("int4", True, ignore + tuple(raw.get("modules_to_not_convert") or ()),
                       group_size=_group_size(where + ".group_size", raw.get("group_size")),
                       symmetric=_flag(where + ".sym", raw.get("sym", True)), checkpoint_format=fmt)


def _awq(where: str, raw: dict) -> QuantConfig:
    """AutoAWQ's GEMM checkpoints (``qweight`` / ``qzeros`` / ``scales``), always with zero points."""
    _require(where + ".bits", raw.get("bits", raw.get("w_bit")), (4,))
    _require(where + ".version", raw.get("version", "gemm").lower(), ("gemm",))
    _require(where + ".zero_point", raw.get("zero_point", True), (True,))
    group_size = _group_size(where + ".group_size", raw.get("group_size", raw.get("q_group_size")))
    return QuantConfig("int4", True, ("lm_head",) + tuple(raw.get("modules_to_not_convert") or ()),
                       group_size=group_size, symmetric=False, checkpoint_format="awq")


def _group_size(field: str, value) -> int | None:
    """A checkpoint's int4 group size; -1: one group per row (None)."""
    if value == -1:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 8 or value % 8:
        raise ValueError(f"{field} = {value!r} is not supported (a positive multiple of 8, or -1)")
    return value


def _flag(field: str, value) -> bool:
    _require(field, value, (True, False))
    return value


def _require(field: str, value, allowed: tuple) -> None:
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        raise ValueError(f"{field} = {value!r} is not supported (supported: {', '.join(map(repr, allowed))})")


def quantize(weight: torch.Tensor, method: QuantMethod) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, weight_scale [out, 1] fp32): symmetric per-output-channel absmax, q = round(weight / scale)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / _QMAX[method]).clamp(min=torch.finfo(torch.float32).tiny)
    q = w / scale
    q = q.round().clamp(-127, 127) if method == "int8" else q.clamp(-_QMAX[method], _QMAX[method])
    return q.to(WEIGHT_DTYPES[method]), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale (fp32 math), as ``dtype``."""
    return (q.float() * scale.float()).to(dtype)


def quantized_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                     activations: bool = False) -> torch.Tensor:
    """x @ (q * scale).T + bias where no packed kernel runs it (GPUs, the reference backend, CPUs without
    VNNI): fp8 through ``torch._scaled_mm`` on GPUs with fp8 tensor cores (compute capability 8.9+; x quantised
    per row, the weight scales per column), else the weight dequantised for one matmul; ``activations``: x
    first rounded to its per-row int8 grid, as skinny_linear_w8a8 reads it."""
    if q.dtype == torch.float8_e4m3fn and _scaled_mm_runs(x, q):
        return _fp8_matmul(x, q, scale, bias)
    if activations:
        rows, t = reference.quantize_rows(x.reshape(-1, x.shape[-1]))
        x = (rows.float() * t).to(x.dtype).view(x.shape)
    return torch.nn.functional.linear(x, dequantize(q, scale, x.dtype), bias)


def _scaled_mm_runs(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Row-wise scaled fp8 GEMMs: fp8 tensor cores, bf16 output, both weight dims multiples of 16."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and q.shape[0] % 16 == 0 and q.shape[1] % 16 == 0
            and torch.cuda.get_device_capability(x.device) >= (8, 9))


def _fp8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize(rows, "fp8")
    y = torch._scaled_mm(x_q, q.t(), scale_a=x_scale, scale_b=scale.float().view(1, -1), bias=bias,
                         out_dtype=x.dtype)
    return y.view(*x.shape[:-1], q.shape[0])
