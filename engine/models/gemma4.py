"""Gemma 4 (text, ``Gemma4ForCausalLM``) on Gemma's layer order (a norm before and after both blocks, GeGLU,
embeddings scaled by sqrt(hidden_size), final logit soft-capping). New here: Gemma 4's weighted RMSNorm, q/k norms
and an unweighted value norm with attention scale 1; global layers with their own head size, proportional RoPE
and (``attention_k_eq_v``) values taken from the key projection; per-layer input embeddings added after each
layer's MLP; a learned per-layer output scale; cross-layer KV sharing: the last ``num_kv_shared_layers``
layers attend over an earlier layer's blocks (engine/models/layer_kv.py) and compute no K/V of their own; and
(``enable_moe_block``, Gemma 4 26B-A4B) a sparse MoE beside every layer's dense MLP: routed from the residual
stream, its GELU-tanh experts run through ``fused_moe``, both outputs normalised apart, then summed."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel_state import TensorParallel
from engine.layers.activation import GeluTanhAndMul
from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from engine.layers.norm import Gemma4RMSNorm
from engine.layers.rotary import RopeStep, RotaryEmbedding, rope_config
from engine.layers.vocab_parallel import VocabParallelEmbedding
from engine.models.config import ModelConfig
from engine.models.gemma import Gemma2ForCausalLM, check_runnable, in_dtype
from engine.models.llama import LlamaMLP
from engine.models.moe import Router, Routing, StackedExperts


class Gemma4Attention(nn.Module):
    """Projections by the layer's kind: q|k|v fused; q and k apart where the values are the keys' projection
    (``attention_k_eq_v``, global layers); q alone where the layer reads another layer's K/V."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        kv, window = cfg.kv_layers()[layer], _windows(cfg)[layer]
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads, self.head_dim = tp.kv_heads(kv.num_kv_heads), kv.head_dim
        q_size, kv_size = cfg.num_heads * kv.head_dim, kv.num_kv_heads * kv.head_dim
        bias, eps, kv_splits = cfg.hf.get("attention_bias", False), cfg.hf["rms_norm_eps"], min(kv.num_kv_heads, tp.size)
        shared, k_eq_v = kv.source != layer, bool(cfg.hf.get("attention_k_eq_v")) and not window
        self.qkv_proj = None if shared or k_eq_v else ColumnParallelLinear(
            cfg.hidden_size, [q_size, kv_size, kv_size], bias, tp, [tp.size, kv_splits, kv_splits])
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, [q_size], bias, tp) if self.qkv_proj is None else None
        self.k_proj = (ColumnParallelLinear(cfg.hidden_size, [kv_size], bias, tp, [kv_splits])
                       if k_eq_v and not shared else None)
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, bias, tp)
        self.q_norm = Gemma4RMSNorm(kv.head_dim, eps)
        self.k_norm = None if shared else Gemma4RMSNorm(kv.head_dim, eps)
        self.v_norm = None if shared else Gemma4RMSNorm(kv.head_dim, eps, scaled=False)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, kv.head_dim, 1.0, window)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q [T, H, D], and k, v [T, Hkv, D] as projected (None in a layer that shares K/V)."""
        t, d = x.shape[0], self.head_dim
        if self.qkv_proj is not None:
            return self.qkv_proj(x).view(t, -1, d).split([self.num_heads, self.num_kv_heads, self.num_kv_heads], 1)
        k = None if self.k_proj is None else self.k_proj(x).view(t, -1, d)
        return self.q_proj(x).view(t, -1, d), k, k

    def forward(self, rope: RopeStep, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.project(x)
        if k is None:  # the source layer has written this step's K/V already
            q = self.q_norm(q)
            rope(q)
            return self.o_proj(self.attn.attend(q, meta))
        qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        rope(qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, self.v_norm(v), meta))


class Gemma4Router(nn.Module):
    """Scores the residual stream: normalised without a weight, scaled by ``scale`` / sqrt(hidden_size); a
    softmax, the top k renormalised, each weight then times its expert's ``per_expert_scale``."""

    def __init__(self, cfg: ModelConfig, routing: Routing) -> None:
        super().__init__()
        self.routing, self.root = routing, cfg.hidden_size ** -0.5
        self.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.hf["rms_norm_eps"], scaled=False)
        self.scale = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.proj = Router(cfg.hidden_size, routing.num_experts)
        self.per_expert_scale = nn.Parameter(torch.ones(routing.num_experts), requires_grad=False)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.routing.route(self.proj(self.norm(h) * self.scale * self.root))
        return weights * self.per_expert_scale[ids], ids


class Gemma4DecoderLayer(nn.Module):
    """Module names as transformers': the MoE's (router, experts, the extra norms) sit on the layer itself."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        eps, size, hf = cfg.hf["rms_norm_eps"], cfg.hidden_size, cfg.hf
        self.input_layernorm = Gemma4RMSNorm(size, eps)
        self.self_attn = Gemma4Attention(cfg, layer, tp)
        self.post_attention_layernorm = Gemma4RMSNorm(size, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(size, eps)
        # A layer sharing K/V gets an MLP twice as wide under use_double_wide_mlp.
        wide = 2 if hf.get("use_double_wide_mlp") and cfg.kv_layers()[layer].source != layer else 1
        self.mlp = LlamaMLP(cfg, tp, GeluTanhAndMul, hf["intermediate_size"] * wide)
        self.post_feedforward_layernorm = Gemma4RMSNorm(size, eps)
        self.has_moe = bool(hf.get("enable_moe_block"))
        if self.has_moe:
            self.router = Gemma4Router(cfg, Routing(hf["num_experts"], hf["top_k_experts"], renormalize=True,
                                                    weights_in_model_dtype=False))
            self.experts = StackedExperts(hf["num_experts"], size, hf["moe_intermediate_size"],
                                          "moe_intermediate_size", tp, activation="gelu_tanh")
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(size, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(size, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(size, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1), requires_grad=False)
        per_layer = hf.get("hidden_size_per_layer_input") or 0
        self.has_per_layer_input = bool(per_layer)
        if per_layer:
            self.per_layer_input_gate = Linear(size, per_layer, bias=False)
            self.per_layer_projection = Linear(per_layer, size, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(size, eps)

    def forward(self, rope: RopeStep, h: torch.Tensor, per_layer_input: torch.Tensor | None,
                meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(h), meta))
        h = h + self.post_feedforward_layernorm(self.feed_forward(h))
        if per_layer_input is not None:  # the layer's per-layer input, gated by the residual stream
            gate = F.gelu(self.per_layer_input_gate(h), approximate="tanh")
            h = h + self.post_per_layer_input_norm(self.per_layer_projection(gate * per_layer_input))
        return h * self.layer_scalar

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The dense MLP's output; with the MoE, it and the experts' (routed from ``h``), each normalised, summed."""
        dense = self.mlp(self.pre_feedforward_layernorm(h))
        if not self.has_moe:
            return dense
        weights, ids = self.router(h)
        routed = self.experts(self.pre_feedforward_layernorm_2(h), weights, ids)
        return self.post_feedforward_layernorm_1(dense) + self.post_feedforward_layernorm_2(routed)


class Gemma4Model(nn.Module):
    """``rotaries``: one table per (layer kind, head size); ``layer_rope``: each layer's."""

    def __init__(self, cfg: ModelConfig, rotaries: list[RotaryEmbedding], layer_rope: list[int], tp: TensorParallel,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.embed_scale = in_dtype(cfg.hidden_size ** 0.5, dtype)
        self.rotaries, self.layer_rope = nn.ModuleList(rotaries), layer_rope
        self.layers = nn.ModuleList(Gemma4DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = Gemma4RMSNorm(cfg.hidden_size, cfg.hf["rms_norm_eps"])
        self.per_layer = cfg.hf.get("hidden_size_per_layer_input") or 0
        if self.per_layer:
            width = cfg.num_layers * self.per_layer  # every layer's slice, side by side
            self.embed_tokens_per_layer = VocabParallelEmbedding(cfg.hf["vocab_size_per_layer_input"], width, tp)
            self.per_layer_embed_scale = in_dtype(self.per_layer ** 0.5, dtype)
            self.per_layer_model_projection = Linear(cfg.hidden_size, width, bias=False)
            self.per_layer_projection_norm = Gemma4RMSNorm(self.per_layer, cfg.hf["rms_norm_eps"])

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[T, layers, per_layer]: each token's own per-layer embedding and the normalised projection of its
        embedding ``h``, added and scaled by 1/sqrt(2), as transformers combines them."""
        shape = (len(input_ids), len(self.layers), self.per_layer)
        own = (self.embed_tokens_per_layer(input_ids) * self.per_layer_embed_scale).view(shape)
        projected = self.per_layer_model_projection(h) * h.shape[-1] ** -0.5
        return (self.per_layer_projection_norm(projected.view(shape)) + own) * 2 ** -0.5

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids) * self.embed_scale
        per_layer = self.per_layer_inputs(input_ids, h) if self.per_layer else None
        ropes = [rotary.step(positions, meta) for rotary in self.rotaries]
        for i, (layer, rope) in enumerate(zip(self.layers, self.layer_rope)):
            h = layer(ropes[rope], h, None if per_layer is None else per_layer[:, i], meta)
        return self.norm(h)


class Gemma4ForCausalLM(Gemma2ForCausalLM):
    checkpoint_renames = {".experts.gate_up_proj": ".experts.w13", ".experts.down_proj": ".experts.w2"}

    def build_model(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        _check_config(cfg)
        # fused_moe sizes its expert groups on the host: no CUDA graphs.
        self.graph_capturable = not cfg.hf.get("enable_moe_block")
        rotaries, layer_rope = _rotaries(cfg, device, dtype)
        return Gemma4Model(cfg, rotaries, layer_rope, tp, dtype)


class Gemma4ForConditionalGeneration(Gemma4ForCausalLM):
    """The hub's multimodal Gemma 4 checkpoints run as text models: config.json's ``text_config`` (read as the
    model's settings: engine/models/config.py), the language model's weights from under
    ``model.language_model``; the vision and audio towers' weights left unread."""

    checkpoint_renames = {"model.language_model.": "model.", **Gemma4ForCausalLM.checkpoint_renames}

    @staticmethod
    def unused_checkpoint_weight(name: str) -> bool:
        return name.startswith(_MULTIMODAL_PARTS)


_MULTIMODAL_PARTS = ("model.vision_tower.", "model.embed_vision.", "model.audio_tower.", "model.embed_audio.")


def _rotaries(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> tuple[list[RotaryEmbedding], list[int]]:
    """``rope_parameters`` per layer kind, at the head size of the layers of that kind (global layers: proportional
    RoPE over their own head size)."""
    params = cfg.hf.get("rope_parameters") or {}
    keys = [("sliding_attention" if window else "full_attention", kv.head_dim)
            for window, kv in zip(_windows(cfg), cfg.kv_layers())]
    tables = list(dict.fromkeys(keys))
    for kind, _ in tables:
        if not isinstance(params.get(kind), dict):
            raise ValueError(f"{cfg.path}/config.json: rope_parameters lacks the {kind!r} layers' entry")
    rotaries = [RotaryEmbedding(rope_config(cfg.hf | {"rope_parameters": params[kind]}, head_dim,
                                            cfg.max_position_embeddings), device, dtype) for kind, head_dim in tables]
    return rotaries, [tables.index(key) for key in keys]


def _check_config(cfg: ModelConfig) -> None:
    check_runnable(cfg)
    hf = cfg.hf
    if hf.get("hidden_size_per_layer_input") and hf.get("vocab_size_per_layer_input", 0) < cfg.vocab_size:
        raise ValueError(f"{cfg.path}/config.json: vocab_size_per_layer_input={hf.get('vocab_size_per_layer_input')} "
                         f"must cover the vocabulary (vocab_size={cfg.vocab_size})")
    if hf.get("enable_moe_block"):
        _check_moe(cfg.path, hf)


def _check_moe(path: str, hf: dict) -> None:
    for field in ("num_experts", "moe_intermediate_size"):
        value = hf.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{path}/config.json: enable_moe_block needs {field} a positive integer, got {value!r}")
    top_k = hf.get("top_k_experts")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 0 < top_k <= hf["num_experts"]:
        raise ValueError(f"{path}/config.json: top_k_experts={top_k!r} must be an integer in "
                         f"[1, num_experts={hf['num_experts']}]")


def _windows(cfg: ModelConfig) -> tuple[int, ...]:
    return cfg.layer_windows or (0,) * cfg.num_layers
