"""DeepSeek-V3 (and Kimi-K2, the same architecture): multi-head latent attention (MLA) over a paged latent cache,
and a sparse MoE with grouped top-k sigmoid routing, shared experts and dense first layers.

MLA derives every head's keys and values from one latent per token: ``c_kv``, the normalised first
``kv_lora_rank`` outputs of ``kv_a_proj_with_mqa``, beside a rotated key of ``qk_rope_head_dim`` shared by all
heads. The pool keeps only ``[c_kv, k_rope]``, one KV "head" read as both K and V (engine/models/layer_kv.py), and
attention runs absorbed, as MQA over it: head h's nope key is ``W_UK[h] c_kv``, so ``q_nope · k_nope =
(W_UK[h]^T q_nope) · c_kv`` and the query becomes ``[W_UK[h]^T q_nope, q_rope]``; the output's latent part times
``W_UV[h]`` is the head's value sum. Prefill and decode run the same way."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from cuda_ext import KernelOps
from engine.distributed.parallel_state import TensorParallel
from engine.layers.attention import AttentionMetadata, PagedAttention
from engine.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear, Shard
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RopeStep, RotaryEmbedding, rope_config, softmax_mscale
from engine.layers.vocab_parallel import VocabParallelEmbedding
from engine.models.config import ModelConfig
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from engine.models.moe import FusedExperts, MoeForCausalLM, Router

# transformers builds q_a_layernorm and kv_a_layernorm with its RMSNorm's default eps, not rms_norm_eps.
_LATENT_NORM_EPS = 1e-6
_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
# DeepseekV3Config's defaults for the fields a config.json may leave out (the released ones spell them all out).
_DEFAULTS = {"q_lora_rank": 1536, "qk_nope_head_dim": 128, "v_head_dim": 128, "n_routed_experts": 256,
             "n_shared_experts": 1, "moe_intermediate_size": 2048, "n_group": 8, "topk_group": 4,
             "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
             "routed_scaling_factor": 2.5, "rope_interleave": True}


class LatentProjection(nn.Module):
    """``kv_b_proj``: each head's W_UK [qk_nope_head_dim, kv_lora_rank] and W_UV [v_head_dim, kv_lora_rank] stacked
    (this rank's heads). Only ever applied absorbed, as batched per-head matmuls, so it is a plain weight: never
    packed for the skinny GEMM nor quantized."""

    def __init__(self, rank: int, heads: int, nope: int, v_dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.heads, self.split = tp, heads, [nope, v_dim]
        self.weight = nn.Parameter(torch.empty(heads * (nope + v_dim), rank), requires_grad=False)

    def checkpoint_shard(self, param: str, part: None) -> Shard:
        rows = self.weight.shape[0]
        return Shard(0, rows * self.tp.size, self.tp.rank * rows, rows)

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> [T, H, rank]: each head's query in latent space."""
        w_uk, _ = self._per_head()
        return torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)

    def values(self, latent: torch.Tensor) -> torch.Tensor:
        """[T, H, rank] (attention over the latents) -> [T, H * v_head_dim], the heads' outputs."""
        _, w_uv = self._per_head()
        return torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).flatten(1)

    def _per_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.weight.view(self.heads, -1, self.weight.shape[1]).split(self.split, dim=1)


class MLAttention(nn.Module):
    """Queries from ``q_proj``, or the low-rank ``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj`` under
    ``q_lora_rank`` (the engine names both ``q_b_proj``); the latent from ``kv_a_proj_with_mqa``."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, scale: float) -> None:
        super().__init__()
        hf = cfg.hf
        self.num_heads = tp.shard(cfg.num_heads, "num_attention_heads")
        self.rank, self.nope, self.rope_dim = hf["kv_lora_rank"], hf["qk_nope_head_dim"], hf["qk_rope_head_dim"]
        q_rank, bias = hf["q_lora_rank"], hf.get("attention_bias", False)
        self.q_a_proj = Linear(cfg.hidden_size, q_rank, bias) if q_rank else None
        self.q_a_layernorm = RMSNorm(q_rank, _LATENT_NORM_EPS) if q_rank else None
        self.q_b_proj = ColumnParallelLinear(q_rank or cfg.hidden_size, [cfg.num_heads * (self.nope + self.rope_dim)],
                                             False, tp)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.rank + self.rope_dim, bias)  # replicated
        self.kv_a_layernorm = RMSNorm(self.rank, _LATENT_NORM_EPS)
        self.kv_b_proj = LatentProjection(self.rank, self.num_heads, self.nope, hf["v_head_dim"], tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * hf["v_head_dim"], cfg.hidden_size, bias, tp)
        self.attn = PagedAttention(self.num_heads, 1, self.rank + self.rope_dim, scale)
        self.interleaved = hf["rope_interleave"]

    def forward(self, rope: RopeStep, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = x if self.q_a_proj is None else self.q_a_layernorm(self.q_a_proj(x))
        q_nope, q_rope = self.q_b_proj(h).view(x.shape[0], self.num_heads, -1).split([self.nope, self.rope_dim], -1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        q = torch.cat((self.kv_b_proj.absorb(q_nope), self._halves(q_rope)), dim=-1)
        kv = torch.cat((self.kv_a_layernorm(c_kv), self._halves(k_rope)), dim=-1).unsqueeze(1)
        rope(q[..., self.rank:])
        rope(kv[..., self.rank:])
        out = self.attn(q, kv, kv, meta).view(x.shape[0], self.num_heads, -1)
        return self.o_proj(self.kv_b_proj.values(out[..., :self.rank]))

    def _halves(self, x: torch.Tensor) -> torch.Tensor:
        """The rotary dims in the neox layout the rotary op turns: DeepSeek rotates interleaved pairs (x0, x1),
        (x2, x3)... (``rope_interleave``), which is the neox rotation of the evens then the odds; transformers
        emits that layout too, so the cached key is the same."""
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.interleaved else x


@dataclass(frozen=True, slots=True)
class GroupedRouting:
    """DeepSeek-V3's routing: sigmoid scores; the top k experts chosen by score + ``e_score_correction_bias``
    among the ``topk_group`` best of ``n_group`` groups (a group's worth: its two best biased scores). The bias
    steers the choice only: the weights are the unbiased scores (renormalised under ``norm_topk_prob``) times
    ``routed_scaling_factor``, all fp32 as in transformers."""

    num_experts: int
    top_k: int
    num_groups: int
    top_groups: int
    renormalize: bool
    scaling: float

    def route(self, logits: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 weights [T, k], expert ids int64 [T, k]) from the router's logits [T, E]."""
        scores = logits.float().sigmoid()
        groups = (scores + bias.float()).view(-1, self.num_groups, self.num_experts // self.num_groups)
        best = groups.topk(2, dim=-1).values.sum(dim=-1).topk(self.top_groups, dim=-1, sorted=False).indices
        kept = torch.zeros(groups.shape[:2], dtype=torch.bool, device=logits.device).scatter_(1, best, True)
        choice = groups.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids


class BiasedRouter(Router):
    """The router's logits, with the per-expert bias that only ``GroupedRouting`` reads."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__(hidden, num_experts)
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)


class DeepseekMoE(nn.Module):
    """Routed experts (one ``fused_moe`` call) plus the always-on shared experts, one MLP of
    ``n_shared_experts * moe_intermediate_size``."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, routing: GroupedRouting) -> None:
        super().__init__()
        inter, shared = cfg.hf["moe_intermediate_size"], cfg.hf["n_shared_experts"] or 0
        self.routing = routing
        self.gate = BiasedRouter(cfg.hidden_size, routing.num_experts)
        self.experts = FusedExperts(routing.num_experts, cfg.hidden_size, inter, "moe_intermediate_size", tp)
        self.shared_experts = LlamaMLP(cfg, tp, intermediate=inter * shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routing.route(self.gate(x), self.gate.e_score_correction_bias)
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's layer order (pre-norms, fused residual adds) around MLA and a dense or sparse MLP."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, scale: float, mlp: nn.Module) -> None:
        nn.Module.__init__(self)  # LlamaDecoderLayer's forward, over these parts
        eps = cfg.hf["rms_norm_eps"]
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.self_attn = MLAttention(cfg, tp, scale)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.mlp = mlp

    def fuse(self, ops: KernelOps) -> None:
        """Stays op by op: the compiled layer runs Llama's attention."""


class DeepseekV3Model(LlamaModel):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, scale: float, tp: TensorParallel,
                 mlp: Callable[[int], nn.Module]) -> None:
        nn.Module.__init__(self)  # LlamaModel's forward, over these layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary = rotary
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, tp, scale, mlp(i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.hf["rms_norm_eps"])


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    # Without q_lora_rank the query has one projection, q_proj: the engine's q_b_proj.
    checkpoint_renames = {".self_attn.q_proj.": ".self_attn.q_b_proj."}
    expert_parts = MoeForCausalLM.expert_parts
    graph_capturable = False  # fused_moe sizes its expert groups on the host

    def unused_checkpoint_weight(self, name: str) -> bool:
        """The released checkpoints' multi-token-prediction layers (``model.layers.{num_hidden_layers}.*`` on):
        a speculative head this engine does not run."""
        match = _LAYER_INDEX.match(name)
        return match is not None and int(match[1]) >= len(self.model.layers)

    def build_model(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        cfg = replace(cfg, hf=_DEFAULTS | cfg.hf)
        check_config(cfg)
        hf = cfg.hf
        rope = rope_config(hf, hf["qk_rope_head_dim"], cfg.max_position_embeddings)
        # transformers' yarn_apply_mscale: the softmax scale of the whole q·k, not the latent head's size.
        mscale = softmax_mscale(rope)
        scale = (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"]) ** -0.5 * mscale * mscale
        return DeepseekV3Model(cfg, RotaryEmbedding(rope, device, dtype), scale, tp,
                               lambda layer: self.build_mlp(cfg, layer, tp))

    def build_mlp(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
        hf = cfg.hf
        if layer < hf["first_k_dense_replace"]:
            return LlamaMLP(cfg, tp)
        routing = GroupedRouting(num_experts=hf["n_routed_experts"], top_k=hf["num_experts_per_tok"],
                                 num_groups=hf["n_group"], top_groups=hf["topk_group"],
                                 renormalize=hf["norm_topk_prob"], scaling=float(hf["routed_scaling_factor"]))
        return DeepseekMoE(cfg, tp, routing)


def check_config(cfg: ModelConfig) -> None:
    """Refuses, naming the field, what the engine would not run as transformers does (the latent's fields are
    checked as config.json is read: engine/models/layer_kv.py)."""
    hf, where = cfg.hf, f"{cfg.path}/config.json"
    for key in ("qk_nope_head_dim", "v_head_dim", "n_routed_experts", "moe_intermediate_size", "n_group", "topk_group",
                "num_experts_per_tok"):
        _expect(where, hf, key, _positive_int(hf.get(key)), "a positive integer")
    _expect(where, hf, "q_lora_rank", hf["q_lora_rank"] is None or _positive_int(hf["q_lora_rank"]),
            "null or a positive integer")
    _expect(where, hf, "qk_rope_head_dim", hf["qk_rope_head_dim"] % 2 == 0, "even (it rotates in pairs)")
    _expect(where, hf, "hidden_act", hf.get("hidden_act", "silu") == "silu", '"silu"')
    _expect(where, hf, "scoring_func", hf.get("scoring_func", "sigmoid") == "sigmoid", '"sigmoid"')
    _expect(where, hf, "topk_method", hf.get("topk_method", "noaux_tc") == "noaux_tc", '"noaux_tc"')
    dense = hf["first_k_dense_replace"]
    _expect(where, hf, "first_k_dense_replace", isinstance(dense, int) and 0 <= dense <= cfg.num_layers,
            f"an integer in [0, num_hidden_layers={cfg.num_layers}]")
    _check_groups(where, hf)


def _check_groups(where: str, hf: dict) -> None:
    experts, groups = hf["n_routed_experts"], hf["n_group"]
    _expect(where, hf, "n_group", experts % groups == 0 and experts // groups >= 2,
            f"a divisor of n_routed_experts={experts} leaving 2 or more experts a group (a group scores its two best)")
    _expect(where, hf, "topk_group", hf["topk_group"] <= groups, f"at most n_group={groups}")
    _expect(where, hf, "num_experts_per_tok", hf["num_experts_per_tok"] <= hf["topk_group"] * experts // groups,
            "at most the experts of topk_group groups")


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _expect(where: str, hf: dict, key: str, ok: bool, what: str) -> None:
    if not ok:
        raise ValueError(f"{where}: {key} must be {what}, got {hf.get(key)!r}")
