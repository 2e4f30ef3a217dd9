"""What the engine needs to know about a checkpoint, read from its ``config.json``."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from engine.models.layer_kv import LayerKV, gemma4_layer_kv, mla_layer_kv, uniform_layer_kv
from engine.models.layer_state import LinearStateSpec, linear_state_spec
from engine.multimodal.config import lift_text_config

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Gemma (and gpt-oss) checkpoints written before transformers listed ``layer_types``: every n-th layer is global,
# the others slide (Gemma 3 may say its n as ``sliding_window_pattern``).
_GLOBAL_EVERY = {"gemma2": 2, "gemma3_text": 6, "gemma4_text": 6, "gpt_oss": 2}
# Where model families keep their context length, in order of preference.
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


@dataclass(slots=True)
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: torch.dtype  # the checkpoint's own dtype
    eos_token_ids: list[int]
    hf: dict  # the raw config.json, for family-specific fields
    layer_windows: tuple[int, ...] = ()  # each layer's sliding window (0: full attention); () = all full
    layer_kv: tuple[LayerKV, ...] = ()  # each layer's K/V shape and source where they differ; () = all alike
    # A hybrid model's recurrent layers (engine/models/layer_state.py); its K/V layers are then only the
    # full-attention ones, in order. None: every layer attends.
    linear_state: LinearStateSpec | None = None

    @property
    def sliding_window(self) -> int | None:
        """The window of the checkpoint's windowed layers; None when every layer attends to its whole context."""
        return max(self.layer_windows, default=0) or None

    @property
    def kv_window(self) -> int:
        """How far back any layer sees (0: some layer sees the whole context): keys further back can be freed."""
        return 0 if not self.layer_windows or 0 in self.layer_windows else max(self.layer_windows)

    def kv_layers(self) -> tuple[LayerKV, ...]:
        """Each layer's K/V shape and the layer whose blocks it reads (engine/models/layer_kv.py)."""
        return self.layer_kv or uniform_layer_kv(self.num_layers, self.num_kv_heads, self.head_dim)


def read_model_config(path: str) -> ModelConfig:
    """Parse ``path/config.json``; clear errors for a missing or odd folder."""
    hf = _read_config_json(path)
    archs = hf.get("architectures") or []
    if len(archs) != 1:
        raise ValueError(f"{path}/config.json: expected exactly one entry in 'architectures', got {archs}")
    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    context, windows = context_length(path, hf), _layer_windows(path, hf)
    linear_state = linear_state_spec(path, hf)
    if max(windows, default=0) > context:
        raise ValueError(f"{path}/config.json: sliding_window={max(windows)} exceeds the context it slides over "
                         f"(max_position_embeddings={context})")
    return ModelConfig(
        path=path, architecture=archs[0], vocab_size=hf["vocab_size"], hidden_size=hidden, num_heads=num_heads,
        num_layers=hf["num_hidden_layers"], num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden // num_heads, max_position_embeddings=context,
        dtype=_DTYPES.get(hf.get("dtype") or hf.get("torch_dtype") or "float32", torch.float32),
        eos_token_ids=_eos_ids(path, hf), hf=hf, layer_windows=windows,
        layer_kv=_layer_kv(path, hf, windows, linear_state), linear_state=linear_state)


def _layer_kv(path: str, hf: dict, windows: tuple[int, ...], linear_state: LinearStateSpec | None
              ) -> tuple[LayerKV, ...]:
    """The layers' K/V where they are not all alike: Gemma 4's, multi-head latent attention's (``kv_lora_rank``),
    a hybrid model's (its full-attention layers only)."""
    if linear_state is not None:
        heads = hf["num_attention_heads"]
        return uniform_layer_kv(hf["num_hidden_layers"] - len(linear_state.layers),
                                hf.get("num_key_value_heads") or heads, hf.get("head_dim") or hf["hidden_size"] // heads)
    if hf.get("model_type") == "gemma4_text":
        return gemma4_layer_kv(path, hf, windows)
    return mla_layer_kv(path, hf) if "kv_lora_rank" in hf else ()


def _layer_windows(path: str, hf: dict) -> tuple[int, ...]:
    """Each layer's sliding window as transformers decides it: ``layer_types`` where the config lists them,
    else Qwen2/Qwen3's ``use_sliding_window`` from layer ``max_window_layers`` on, else Gemma's every-n-th-layer
    global pattern, else ``sliding_window`` on every layer (Mistral)."""
    window, layers = hf.get("sliding_window"), hf["num_hidden_layers"]
    if window is None or window == 0:  # transformers writes 0 for a Qwen2-MoE without use_sliding_window
        return (0,) * layers
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"{path}/config.json: sliding_window must be a positive integer or null, got {window!r}")
    if isinstance(hf.get("layer_types"), list):
        if len(hf["layer_types"]) != layers:
            raise ValueError(f"{path}/config.json: layer_types lists {len(hf['layer_types'])} layers, "
                             f"num_hidden_layers is {layers}")
        return tuple(window if kind == "sliding_attention" else 0 for kind in hf["layer_types"])
    if "use_sliding_window" in hf:
        first = hf.get("max_window_layers", 0) if hf["use_sliding_window"] else layers
        return tuple(window if i >= first else 0 for i in range(layers))
    every = hf.get("sliding_window_pattern") or _GLOBAL_EVERY.get(hf.get("model_type"))
    if every:
        return tuple(0 if (i + 1) % every == 0 else window for i in range(layers))
    return (window,) * layers


def context_length(path: str, hf: dict | None = None) -> int:
    """The checkpoint's context length, from its config.json (read here unless given as ``hf``):
    the engine's rule and the gateway's, which reads no weights."""
    hf = _read_config_json(path) if hf is None else hf
    for key in _CONTEXT_KEYS:
        if isinstance(hf.get(key), int):
            return hf[key]
    raise ValueError(f"{path}/config.json names no context length (none of {', '.join(_CONTEXT_KEYS)})")


def _read_config_json(path: str) -> dict:
    """config.json; a multimodal checkpoint's (``text_config``) as its text model's settings."""
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"no config.json in model folder {path!r} (expected a Hugging Face checkpoint folder)")
    with open(config_file, encoding="utf-8") as f:
        return lift_text_config(json.load(f))


def _eos_ids(path: str, hf: dict) -> list[int]:
    """Union of config.json's and generation_config.json's eos ids (checkpoints disagree)."""
    ids = _as_list(hf.get("eos_token_id"))
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            ids += _as_list(json.load(f).get("eos_token_id"))
    return sorted(set(ids))


def _as_list(value: int | list[int] | None) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: str) -> torch.dtype:
    """``auto`` = the checkpoint's dtype, but bf16 instead of fp16 on CPU (fp16 matmuls are slow there)."""
    if name == "auto":
        return torch.bfloat16 if checkpoint_dtype == torch.float16 and device == "cpu" else checkpoint_dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {name!r}")
    return _DTYPES[name]
