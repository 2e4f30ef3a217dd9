"""Gemma 2 and Gemma 3 (text) decoders on Llama's attention and gated MLP: GeGLU, Gemma's ``1 + weight`` RMSNorm
before and after both blocks, embeddings scaled by sqrt(hidden_size), the attention scale from
``query_pre_attn_scalar``, a tied LM head. Gemma 2 soft-caps the attention scores and the final logits and
alternates sliding-window and global layers; Gemma 3 adds q/k norms and gives its local layers their own RoPE base."""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel_state import TensorParallel
from engine.layers.activation import GeluTanhAndMul
from engine.layers.attention import AttentionMetadata
from engine.layers.norm import GemmaRMSNorm
from engine.layers.rotary import RopeConfig, RopeStep, RotaryEmbedding, rope_config
from engine.layers.vocab_parallel import VocabParallelEmbedding
from engine.models.config import ModelConfig
from engine.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP


class GemmaDecoderLayer(nn.Module):
    """Each block's output is normalised before it joins the residual stream (no fused add: Gemma's norm scales
    in fp32 before the cast, the fused op after it)."""

    def __init__(self, cfg: ModelConfig, layer: int, qk_norm: bool, tp: TensorParallel) -> None:
        super().__init__()
        eps, size = cfg.hf["rms_norm_eps"], cfg.hidden_size
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = LlamaAttention(cfg, layer, cfg.hf.get("attention_bias", False), qk_norm, tp,
                                        scale=cfg.hf.get("query_pre_attn_scalar", 256) ** -0.5,
                                        softcap=cfg.hf.get("attn_logit_softcapping") or 0.0, norm=GemmaRMSNorm)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = LlamaMLP(cfg, tp, GeluTanhAndMul)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, rope: RopeStep, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(h), meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    """``rotaries``: the global layers' RoPE table first; the sliding-window layers take the last one."""

    def __init__(self, cfg: ModelConfig, rotaries: list[RotaryEmbedding], qk_norm: bool, tp: TensorParallel,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.embed_scale = in_dtype(cfg.hidden_size ** 0.5, dtype)
        self.rotaries = nn.ModuleList(rotaries)
        windows = cfg.layer_windows or (0,) * cfg.num_layers
        self.layer_rope = [len(rotaries) - 1 if window else 0 for window in windows]
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, i, qk_norm, tp) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.hf["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.decode(self.embed_tokens(input_ids) * self.embed_scale, positions, meta)

    def decode(self, h: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The layers and the final norm over the step's input embeddings ``h``."""
        ropes = [rotary.step(positions, meta) for rotary in self.rotaries]
        for layer, rope in zip(self.layers, self.layer_rope):
            h = layer(ropes[rope], h, meta)
        return self.norm(h)


class Gemma2ForCausalLM(LlamaForCausalLM):
    tied_by_default = True

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__(cfg, device, dtype, tp)
        self.final_softcap = cfg.hf.get("final_logit_softcapping") or 0.0

    def build_model(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        check_runnable(cfg)
        ropes = self.rope_configs(cfg.hf, cfg.head_dim, cfg.max_position_embeddings)
        rotaries = [RotaryEmbedding(rope, device, dtype) for rope in ropes]
        return GemmaModel(cfg, rotaries, self.qk_norm, tp, dtype)

    @staticmethod
    def rope_configs(hf: dict, head_dim: int, max_position: int) -> list[RopeConfig]:
        """The global layers' RoPE, then the local ones' where they differ."""
        return [rope_config(hf, head_dim, max_position)]

    def compute_logits(self, hidden: torch.Tensor, need_logits: bool = True) -> tuple[torch.Tensor | None,
                                                                                      torch.Tensor | None]:
        if not self.final_softcap:
            return super().compute_logits(hidden, need_logits)
        # The argmax is taken of the capped logits: tanh may round two close logits to one value.
        logits = self.lm_head(hidden)
        return (None if logits is None else torch.tanh(logits / self.final_softcap) * self.final_softcap), None


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True

    @staticmethod
    def rope_configs(hf: dict, head_dim: int, max_position: int) -> list[RopeConfig]:
        """transformers 5 writes ``rope_parameters`` per layer type; older configs ``rope_theta`` and
        ``rope_scaling`` for the global layers, ``rope_local_base_freq`` for the local ones."""
        params = hf.get("rope_parameters")
        if isinstance(params, dict) and "full_attention" in params:
            kinds = [hf | {"rope_parameters": params[kind]} for kind in ("full_attention", "sliding_attention")]
        else:
            kinds = [hf | {"rope_theta": hf.get("rope_theta", 1_000_000.0)},
                     hf | {"rope_theta": hf.get("rope_local_base_freq", 10_000.0), "rope_scaling": None}]
        return [rope_config(kind, head_dim, max_position) for kind in kinds]


def in_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to the model dtype, as transformers scales embeddings (sqrt(3072) = 55.4256 becomes 55.5
    in bf16)."""
    return torch.tensor(value, device="cpu").to(dtype).item()


# use_bidirectional_attention values that leave text causal ("vision": Gemma 4's image tokens only).
_CAUSAL = (None, False, "vision")


def check_runnable(cfg: ModelConfig) -> None:
    act = cfg.hf.get("hidden_activation") or cfg.hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"{cfg.path}/config.json: unsupported hidden_activation {act!r} for {cfg.architecture} "
                         "(only gelu_pytorch_tanh)")
    if cfg.hf.get("use_bidirectional_attention") not in _CAUSAL:
        raise ValueError(f"{cfg.path}/config.json: use_bidirectional_attention is not supported (causal only)")
