"""OPT (the PagedAttention paper's model family): learned positions, LayerNorm, ReLU MLP."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.distributed.parallel_state import TensorParallel
from engine.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from engine.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from engine.models.config import ModelConfig

_POSITION_OFFSET = 2  # OPT's learned position table reserves two leading rows


class OPTAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads, self.head_dim = tp.shard(cfg.num_heads, "num_attention_heads"), cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.hidden_size] * 3, bias, tp)
        self.out_proj = RowParallelLinear(cfg.hidden_size, cfg.hidden_size, bias, tp)
        self.scaling = cfg.head_dim ** -0.5
        # OPT scales q before attention (as HF does), so attention itself uses scale 1.
        self.attn = PagedAttention(self.num_heads, self.num_heads, cfg.head_dim, 1.0)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)
        shape = (-1, self.num_heads, self.head_dim)
        q = (q * self.scaling).view(shape)
        return self.out_proj(self.attn(q, k.view(shape), v.view(shape), meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        bias, affine = cfg.hf.get("enable_bias", True), cfg.hf.get("layer_norm_elementwise_affine", True)
        self.pre_norm = cfg.hf.get("do_layer_norm_before", True)
        self.self_attn = OPTAttention(cfg, bias, tp)
        self.self_attn_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine, bias=affine)
        self.fc1 = ColumnParallelLinear(cfg.hidden_size, [cfg.hf["ffn_dim"]], bias, tp)
        self.fc2 = RowParallelLinear(cfg.hf["ffn_dim"], cfg.hidden_size, bias, tp)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, elementwise_affine=affine, bias=affine)

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self._sublayer(h, self.self_attn_layer_norm, lambda x: self.self_attn(x, meta))
        return self._sublayer(h, self.final_layer_norm, lambda x: self.fc2(F.relu(self.fc1(x))))

    def _sublayer(self, h: torch.Tensor, norm: nn.LayerNorm, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        # Pre-norm for every OPT but opt-350m, which normalises after the residual add.
        if self.pre_norm:
            return h + fn(norm(h))
        return norm(h + fn(h))


class OPTDecoder(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        hf, hidden = cfg.hf, cfg.hidden_size
        proj_dim = hf.get("word_embed_proj_dim") or hidden
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, proj_dim, tp)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings + _POSITION_OFFSET, hidden)
        self.project_in = Linear(proj_dim, hidden, bias=False) if proj_dim != hidden else None
        self.project_out = Linear(hidden, proj_dim, bias=False) if proj_dim != hidden else None
        has_final_norm = hf.get("do_layer_norm_before", True) and not hf.get("_remove_final_layer_norm", False)
        affine = hf.get("layer_norm_elementwise_affine", True)
        self.final_layer_norm = (nn.LayerNorm(hidden, elementwise_affine=affine, bias=affine)
                                 if has_final_norm else None)
        self.layers = nn.ModuleList(OPTDecoderLayer(cfg, tp) for _ in range(cfg.num_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.project_in is not None:
            h = self.project_in(h)
        h = h + self.embed_positions(positions + _POSITION_OFFSET)
        for layer in self.layers:
            h = layer(h, meta)
        if self.final_layer_norm is not None:
            h = self.final_layer_norm(h)
        if self.project_out is not None:
            h = self.project_out(h)
        return h


class OPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.decoder = OPTDecoder(cfg, tp)


class OPTForCausalLM(nn.Module):
    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        if cfg.hf.get("activation_function", "relu") != "relu":
            raise ValueError(f"OPT: unsupported activation_function {cfg.hf['activation_function']!r} (only relu)")
        self.model = OPTModel(cfg, tp)
        proj_dim = cfg.hf.get("word_embed_proj_dim") or cfg.hidden_size
        self.lm_head = ParallelLMHead(proj_dim, cfg.vocab_size, tp)
        self.tie_word_embeddings = cfg.hf.get("tie_word_embeddings", True)

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.decoder.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model.decoder(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor, need_logits: bool = True) -> tuple[torch.Tensor | None,
                                                                                      torch.Tensor | None]:
        """The logits (None on tensor-parallel ranks other than 0, and where ``need_logits`` is False and the
        LM head gave the argmax alone) and their rows' argmax when fused (else None)."""
        return self.lm_head.with_argmax(hidden, need_logits)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.decoder.layers]
