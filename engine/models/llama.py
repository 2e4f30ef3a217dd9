"""Llama family decoder: Llama 2/3, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), Phi-3 / Phi-4-mini
(checkpoints with q|k|v and gate|up stored fused, partial rotary, LongRoPE); per-layer sliding windows as
``ModelConfig.layer_windows`` gives them."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from cuda_ext import KernelOps
from cuda_ext.linear import PackedLinear
from engine.layers.activation import ActAndMul, SiluAndMul
from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.distributed.parallel_state import TensorParallel
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear, Shard
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RopeStep, RotaryEmbedding, rope_config
from engine.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from engine.models.config import ModelConfig


class LlamaAttention(nn.Module):
    """``scale`` defaults to head_dim ** -0.5; Gemma passes its own, a logit ``softcap`` and its q/k ``norm``;
    gpt-oss ``sinks`` (a logit per head, checkpoint ``self_attn.sinks``)."""

    def __init__(self, cfg: ModelConfig, layer: int, qkv_bias: bool, qk_norm: bool, tp: TensorParallel, *,
                 scale: float | None = None, softcap: float = 0.0, norm: type[nn.Module] = RMSNorm,
                 sinks: bool = False) -> None:
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
        self.q_norm = norm(cfg.head_dim, eps) if qk_norm else None
        self.k_norm = norm(cfg.head_dim, eps) if qk_norm else None
        window = cfg.layer_windows[layer] if cfg.layer_windows else 0
        sink_shard = Shard(0, cfg.num_heads, tp.rank * self.num_heads, self.num_heads) if sinks else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, cfg.head_dim,
                                   cfg.head_dim ** -0.5 if scale is None else scale, window, softcap, sink_shard)

    def forward(self, rope: RopeStep, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
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
    """``intermediate`` defaults to config.json's intermediate_size (MoE families pass their shared expert's)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, act: type[ActAndMul] = SiluAndMul,
                 intermediate: int | None = None) -> None:
        super().__init__()
        inter, bias = intermediate or cfg.hf["intermediate_size"], cfg.hf.get("mlp_bias", False)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], bias, tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias, tp)
        self.act = act()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


@dataclass(slots=True, frozen=True)
class FusedLayer:
    """A decoder layer as one ``llama_decoder_layer`` call on its packed weights: the ops of
    ``LlamaDecoderLayer.forward`` in the same order (bit-identical), without the Python between them."""

    op: Callable[..., torch.Tensor]
    weights: list[torch.Tensor]  # input norm, packed qkv, packed o, post-attention norm, packed gate_up, down
    optional: list[torch.Tensor | None]  # the qkv, o, gate_up and down biases, the q and k norms (Qwen3), then
    # for W8A8 layers each linear's scale and column offsets
    sizes: list[int]  # heads, KV heads, head size, then each linear's output features
    attn: PagedAttention  # the model runner binds its KV cache views after the load
    eps: float

    def __call__(self, rope: RopeStep, h: torch.Tensor, residual: torch.Tensor | None,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:  # the first layer: its input is the residual stream, normalised without an add
            residual, h = h, None
        a = self.attn
        out = self.op(residual, h, self.weights, self.optional, self.sizes, rope.positions, rope.rotary.cos,
                      rope.rotary.sin, a.k_cache, a.v_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                      meta.query_start_loc, meta.max_query_len, meta.max_seq_len, self.eps, a.scale,
                      a.sliding_window, key_scale=a.k_scale, value_scale=a.v_scale)
        return out, residual


class LlamaDecoderLayer(nn.Module):
    """``mlp()`` builds the gated MLP, or an MoE family's sparse block (engine/models/moe.py), after the
    attention, so a shape error names the attention's field first."""

    fused: FusedLayer | None = None

    def __init__(self, cfg: ModelConfig, layer: int, qkv_bias: bool, qk_norm: bool, tp: TensorParallel,
                 mlp: Callable[[], nn.Module], sinks: bool = False) -> None:
        super().__init__()
        eps = cfg.hf["rms_norm_eps"]
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = LlamaAttention(cfg, layer, qkv_bias, qk_norm, tp, sinks=sinks)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = mlp()

    def forward(self, rope: RopeStep, h: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it is added): each norm adds the
        pending output into the residual in place, fused with the normalisation."""
        if self.fused is not None:
            return self.fused(rope, h, residual, meta)
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h = self.input_layernorm(h, residual)
        h = self.self_attn(rope, h, meta)
        h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def fuse(self, ops: KernelOps) -> None:
        """Runs the layer as one compiled call (``FusedLayer``) where ``ops`` has one and every linear layer is
        packed (CPU): unquantized, W8A8 or 4-bit, on one rank (a row-parallel layer needs its all-reduce); a
        sparse MoE layer stays unfused (the compiled layer runs the gated MLP only)."""
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, LlamaMLP):
            return
        packed = [linear.packed for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        kinds = [_fused_kind(p) for p in packed]
        if ops.llama_decoder_layer is None or attn.o_proj.tp.size > 1 or None in kinds:
            return
        qkv, o, gate_up, down = packed
        norms = [None if norm is None else norm.weight for norm in (attn.q_norm, attn.k_norm)]
        # Each quantized linear's two extra tensors (None, None for one in the model's dtype: a 4-bit model keeps
        # a layer whose width its group size does not divide).
        quantized = [] if set(kinds) == {"plain"} else [
            t for p in packed for t in (p.scale, p.col_offset if p.w4_offset is None else p.w4_offset)]
        self.fused = FusedLayer(
            op=ops.llama_decoder_layer,
            weights=[self.input_layernorm.weight, qkv.packed, o.packed, self.post_attention_layernorm.weight,
                     gate_up.packed, down.packed],
            optional=[qkv.bias, o.bias, gate_up.bias, down.bias, *norms, *quantized],
            sizes=[attn.num_heads, attn.num_kv_heads, attn.head_dim, qkv.out_features, o.out_features,
                   gate_up.out_features, down.out_features],
            attn=attn.attn, eps=self.input_layernorm.eps)


def _fused_kind(packed: PackedLinear | None) -> str | None:
    """What the compiled layer runs a packed linear as: plain, W8A8 or 4-bit; None for a layer it cannot take
    (unpacked, or weight-only int8)."""
    if packed is None:
        return None
    if packed.scale is None:
        return "plain"
    if packed.col_offset is not None:
        return "w8a8"
    return "w4" if packed.w4_offset is not None else None


class LlamaModel(nn.Module):
    """``mlp(layer)``: that layer's MLP; ``sinks``: attention sinks in every layer (gpt-oss)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, qkv_bias: bool, qk_norm: bool,
                 tp: TensorParallel, mlp: Callable[[int], nn.Module], sinks: bool = False) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = rotary
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, qkv_bias, qk_norm, tp, partial(mlp, i), sinks)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.hf["rms_norm_eps"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.step(positions, meta)
        for layer in self.layers:
            h, residual = layer(rope, h, residual, meta)
        return self.norm(h, residual)


class LlamaForCausalLM(nn.Module):
    """Module names follow the Hugging Face checkpoint, so loading is a rename at most."""

    packed_modules = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    qkv_bias = False
    qk_norm = False
    attention_sinks = False  # gpt-oss: a sink logit per head in every layer's softmax
    tied_by_default = False  # tie_word_embeddings where config.json omits it
    rope_aliases: dict[str, str] = {}  # legacy rope types the family's configs use for another one
    checkpoint_renames: dict[str, str] = {}  # checkpoint name part -> the engine's, before any other mapping
    expert_parts: dict[str, tuple[str, int]] = {}  # an MoE expert's projection -> (stacked parameter, part)
    graph_capturable = True  # False: decode steps run eagerly on CUDA too (a host sync inside the forward)

    def __init__(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.model = self.build_model(cfg, device, dtype, tp)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp)
        self.tie_word_embeddings = cfg.hf.get("tie_word_embeddings", self.tied_by_default)

    def build_model(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        if cfg.hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{cfg.architecture}: unsupported hidden_act {cfg.hf['hidden_act']!r} (only silu)")
        rope = rope_config(cfg.hf, cfg.head_dim, cfg.max_position_embeddings, self.rope_aliases)
        rotary = RotaryEmbedding(rope, device, dtype)
        qkv_bias = cfg.hf.get("qkv_bias", self.qkv_bias) or cfg.hf.get("attention_bias", False)
        return LlamaModel(cfg, rotary, qkv_bias, self.qk_norm, tp, lambda layer: self.build_mlp(cfg, layer, tp),
                          self.attention_sinks)

    def build_mlp(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
        return LlamaMLP(cfg, tp)

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


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3, Phi-3.5-mini, Phi-4-mini: Llama's layer with q|k|v and gate|up stored fused (the loader splits
    them per part), partial rotary and LongRoPE; transformers reads its legacy "su" and "yarn" as LongRoPE."""

    rope_aliases = {"su": "longrope", "yarn": "longrope"}
