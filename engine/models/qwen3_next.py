"""Hybrid decoders: Qwen3-Next and Qwen3.5 (dense and MoE). ``layer_types`` interleaves Gated DeltaNet layers
(engine/layers/gated_delta_net.py: a recurrent state per sequence) with gated full attention (Qwen3's q/k norms,
partial RoPE, and an output gate: q_proj yields each head's query and a gate, the attention output is scaled by
sigmoid(gate)); every norm scales by ``1 + weight`` in fp32 (Gemma's); the MLP is dense, or a Qwen2-MoE-style
sparse block with a sigmoid-gated shared expert. Only the full-attention layers hold K/V in the paged pools."""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel_state import TensorParallel
from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.gated_delta_net import GatedDeltaNet
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import RopeStep, RotaryEmbedding, rope_config
from engine.layers.vocab_parallel import VocabParallelEmbedding
from engine.models.config import ModelConfig
from engine.models.moe import MixtralForCausalLM, MoeForCausalLM


class GatedAttention(nn.Module):
    """Full attention whose q_proj rows hold, per head, its query then its output gate."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.num_kv_heads, self.head_dim = tp.kv_heads(cfg.num_kv_heads), cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        kv_splits, bias = min(cfg.num_kv_heads, tp.size), cfg.hf.get("attention_bias", False)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [2 * q_size, kv_size, kv_size], bias, tp,
                                             [tp.size, kv_splits, kv_splits])
        self.o_proj = RowParallelLinear(q_size, cfg.hidden_size, bias, tp)
        eps = cfg.hf["rms_norm_eps"]
        self.q_norm, self.k_norm = GemmaRMSNorm(cfg.head_dim, eps), GemmaRMSNorm(cfg.head_dim, eps)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5)

    def forward(self, rope: RopeStep, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        query_gate, k, v = self.qkv_proj(x).split([2 * self.num_heads * d, self.num_kv_heads * d,
                                                   self.num_kv_heads * d], dim=-1)
        q, gate = query_gate.view(t, self.num_heads, 2 * d).split([d, d], dim=-1)
        qk = torch.cat((self.q_norm(q), self.k_norm(k.view(t, -1, d))), dim=1)
        rope(qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        out = self.attn(q, k, v.reshape(t, -1, d), meta)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual blocks around the token mixer (``linear_attn`` or ``self_attn``, as the checkpoint
    names it) and the MLP."""

    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel, mlp: nn.Module,
                 split_projections: bool) -> None:
        super().__init__()
        eps, spec = cfg.hf["rms_norm_eps"], cfg.linear_state
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        if layer in spec.layers:
            self.linear_attn = GatedDeltaNet(spec, cfg.hidden_size, eps, tp, split_projections)
        else:
            self.self_attn = GatedAttention(cfg, layer, tp)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = mlp

    def forward(self, rope: RopeStep, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.input_layernorm(h)
        if hasattr(self, "linear_attn"):
            h = h + self.linear_attn(x, meta)
        else:
            h = h + self.self_attn(rope, x, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layers: list[HybridDecoderLayer],
                 tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = rotary
        self.layers = nn.ModuleList(layers)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.hf["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        rope = self.rotary.step(positions, meta)
        for layer in self.layers:
            h = layer(rope, h, meta)
        return self.norm(h)


class Qwen3NextForCausalLM(MoeForCausalLM):
    """Qwen3-Next: in_proj_qkvz / in_proj_ba interleaved per key head; MoE on ``decoder_sparse_step`` layers."""

    split_projections = False

    def build_model(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        if cfg.hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cfg.architecture}: unsupported hidden_act {cfg.hf['hidden_act']!r} (only silu)")
        rotary = RotaryEmbedding(rope_config(cfg.hf, cfg.head_dim, cfg.max_position_embeddings), device, dtype)
        layers = [HybridDecoderLayer(cfg, i, tp, self.build_mlp(cfg, i, tp), self.split_projections)
                  for i in range(cfg.num_layers)]
        return HybridModel(cfg, rotary, layers, tp)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers if hasattr(layer, "self_attn")]

    def state_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if hasattr(layer, "linear_attn")]


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (text), dense or MoE: Qwen3-Next's layers with in_proj_qkv, in_proj_z, in_proj_b and in_proj_a
    apart; its M-RoPE sections coincide with plain RoPE for text (every axis at the token's position)."""

    split_projections = True


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5-MoE: Mixtral's rules, every layer sparse and its top-k weights always renormalised."""

    renormalize = staticmethod(MixtralForCausalLM.renormalize)
    is_sparse = staticmethod(MixtralForCausalLM.is_sparse)
