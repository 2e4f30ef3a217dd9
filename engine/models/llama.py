"""Llama family decoder: Llama 2/3, Mistral (no sliding window), Qwen2 (qkv bias), Qwen3 (q/k RMSNorm)."""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from engine.layers.activation import SiluAndMul
from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.distributed.parallel_state import TensorParallel
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from engine.models.config import ModelConfig

Rope = Callable[[torch.Tensor], None]  # rotates [T, H, D] in place at this step's positions, for every layer


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv_bias: bool, qk_norm: bool, tp: TensorParallel) -> None:
        super().__init__()
        # This rank's heads: its share of the query heads, and of the KV heads (or one replicated KV head).
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads, self.head_dim = tp.kv_heads(cfg.num_kv_heads), cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        kv_splits = min(cfg.num_kv_heads, tp.size)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_size, kv_size, kv_size], qkv_bias, tp,
                                             [tp.size, kv_splits, kv_splits])
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, cfg.hf.get("attention_bias", False), tp)
        eps = cfg.hf["rms_norm_eps"]
        self.q_norm = RMSNorm(cfg.head_dim, eps) if qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, eps) if qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5)

    def forward(self, rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # Heads stay views of the fused projection; rotary runs once over q and k together.
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)
        qk, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        rope(qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        inter, bias = cfg.hf["intermediate_size"], cfg.hf.get("mlp_bias", False)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], bias, tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias, tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv_bias: bool, qk_norm: bool, tp: TensorParallel) -> None:
        super().__init__()
        eps = cfg.hf["rms_norm_eps"]
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = LlamaAttention(cfg, qkv_bias, qk_norm, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(self, rope: Rope, h: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added): each norm adds the
        pending output into the residual in place, fused with the normalisation."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h = self.input_layernorm(h, residual)
        h = self.self_attn(rope, h, meta)
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = rotary
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, qkv_bias, qk_norm, tp) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.hf["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None
        rope = partial(self.rotary, positions)
        for layer in self.layers:
            h, residual = layer(rope, h, residual, meta)
        return self.norm(h, residual)


class LlamaForCausalLM(nn.Module):
    """Module names follow the Hugging Face checkpoint, so loading is a rename at most."""

    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    qkv_bias = False
    qk_norm = False

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        if cfg.hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cfg.architecture}: unsupported hidden_act {cfg.hf['hidden_act']!r} (only silu)")
        theta, scaling = _rope_params(cfg.hf)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, theta, scaling, device, dtype)
        qkv_bias = self.qkv_bias or cfg.hf.get("attention_bias", False)
        self.model = LlamaModel(cfg, rotary, qkv_bias, self.qk_norm, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.tie_word_embeddings = cfg.hf.get("tie_word_embeddings", False)

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, need_logits: bool = True) -> tuple[torch.Tensor | None,
                                                                                      torch.Tensor | None]:
        """The logits (None on tensor-parallel ranks other than 0, and where ``need_logits`` is False and the
        LM head gave the argmax alone) and their rows' argmax when fused (else None)."""
        return self.lm_head.with_argmax(hidden, need_logits)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


def _rope_params(hf: dict) -> tuple[float, dict | None]:
    """transformers 5 writes ``rope_parameters``; older checkpoints ``rope_theta`` + ``rope_scaling``."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        scaling = params if params.get("rope_type", "default") != "default" else None
        return float(params["rope_theta"]), scaling
    return float(hf.get("rope_theta", 10000.0)), hf.get("rope_scaling")
