"""Sparse mixture-of-experts decoders on Llama's layer: Mixtral, Qwen2-MoE (a sigmoid-gated shared expert beside
the routed ones) and Qwen3-MoE (Qwen3's q/k norms). A router scores every expert per token (softmax in fp32),
the top k run, their outputs summed under the routing weights: one ``fused_moe`` call on the stacked experts
(grouped GEMMs, cuda_ext/csrc/cpu/moe.cpp).

Tensor parallelism shards every expert's intermediate size (gate|up column-parallel, down row-parallel, one
all-reduce), like a dense MLP's; the router and the shared expert's gate are replicated. The experts and the
router stay unquantized when the dense layers are quantized."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

import cuda_ext
from engine.distributed.parallel_state import TensorParallel
from engine.layers.linear import Linear, Shard
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM, LlamaMLP


@dataclass(frozen=True, slots=True)
class Routing:
    """One family's routing rules, read from config.json."""

    num_experts: int
    top_k: int
    renormalize: bool  # the top k weights rescaled to sum to 1
    weights_in_model_dtype: bool  # Qwen rounds them to the model's dtype; Mixtral keeps them fp32
    top_k_first: bool = False  # gpt-oss: the top k logits picked first, the softmax taken over them alone

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 weights [T, k], expert ids int64 [T, k]) from the router's logits [T, E], in transformers' order."""
        if self.top_k_first:
            top, ids = logits.topk(self.top_k, dim=-1)
            weights = torch.softmax(top.float(), dim=-1)
        else:
            weights, ids = torch.softmax(logits.float(), dim=-1).topk(self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype).float()
        return weights, ids


class Router(Linear):
    """A replicated linear layer that stays unquantized: its scores pick the experts (transformers keeps it a
    plain weight, not a linear layer, so its quantization tooling skips it too)."""

    quantizable = False

    def __init__(self, hidden: int, outputs: int, bias: bool = False) -> None:
        super().__init__(hidden, outputs, bias=bias)


class FusedExperts(nn.Module):
    """Every expert's projections stacked, this rank's share of each: w13 [E, 2 * I / tp, H] (its slice of the
    gate rows, then of the up rows), w2 [E, H, I / tp]. Filled from per-expert checkpoint tensors
    (``...experts.{e}.{part}.weight``: the loader's ``expert_parts``), the layout transformers writes. gpt-oss
    (engine/models/gpt_oss.py) adds biases, w13_bias [E, 2 * I / tp] and w2_bias [E, H], and its clamped SwiGLU
    (``swiglu``: its alpha and limit; (0, 0): the plain gated ``activation``, silu or Gemma 4's gelu_tanh)."""

    ops: cuda_ext.KernelOps = cuda_ext.load_ops("torch")  # the loader hands over the compiled ops

    def __init__(self, num_experts: int, hidden: int, intermediate: int, field: str, tp: TensorParallel,
                 bias: bool = False, swiglu: tuple[float, float] = (0.0, 0.0), activation: str = "silu") -> None:
        super().__init__()
        self.local = tp.shard(intermediate, field)
        self.tp = tp
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, self.local), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * self.local), requires_grad=False) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False) if bias else None
        self.swiglu, self.activation = swiglu, activation

    def checkpoint_shard(self, param: str, part: tuple[int, int]) -> Shard:
        """Expert ``part[0]``'s gate (part[1] 0) or up (1) rows of w13, or its columns of w2: this rank's slice."""
        expert, index = part
        if not 0 <= expert < self.w13.shape[0]:
            raise ValueError(f"checkpoint holds expert {expert}; config.json gives {self.w13.shape[0]} experts")
        start = self.tp.rank * self.local
        if param == "w13":
            return Shard(dim=0, total=self.local * self.tp.size, start=start, size=self.local,
                         dest_start=index * self.local, select=expert)
        return Shard(1, self.local * self.tp.size, start, self.local, select=expert)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.ops.fused_moe(x, self.w13, self.w2, ids, weights, self.w13_bias, self.w2_bias,
                                                     *self.swiglu, activation=self.activation))


class StackedExperts(FusedExperts):
    """FusedExperts read from transformers 5's stacked tensors: ``gate_up_proj`` [E, 2 * I, H] (every gate row,
    then every up row) and ``down_proj`` [E, H, I], this rank's slices only."""

    def fused_checkpoint_shards(self, param: str) -> list[Shard]:
        total, start = self.local * self.tp.size, self.tp.rank * self.local
        if param == "w2":
            return [Shard(dim=2, total=total, start=start, size=self.local)]
        return [Shard(dim=1, total=2 * total, start=half * total + start, size=self.local,
                      dest_start=half * self.local) for half in (0, 1)]


class SparseMoeBlock(nn.Module):
    """Router, routed experts, and (Qwen2-MoE) a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, routing: Routing, intermediate_field: str,
                 shared_intermediate: int = 0) -> None:
        super().__init__()
        self.routing = routing
        self.gate = Router(cfg.hidden_size, routing.num_experts)
        self.experts = FusedExperts(routing.num_experts, cfg.hidden_size, cfg.hf[intermediate_field],
                                    intermediate_field, tp)
        self.shared_expert = LlamaMLP(cfg, tp, intermediate=shared_intermediate) if shared_intermediate else None
        # A linear layer in transformers, replicated here: quantized with the dense layers.
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False) if shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routing.route(self.gate(x))
        out = self.experts(x, weights, ids)
        if self.shared_expert is None:
            return out
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class MoeForCausalLM(LlamaForCausalLM):
    """Llama's decoder with sparse MoE blocks where the family puts them (Qwen's defaults here). ``fused_moe``
    sizes its expert groups on the host, so on CUDA its decode steps run eagerly, not as captured graphs."""

    graph_capturable = False
    expert_parts = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; the released checkpoints num_experts.
    experts_keys = ("num_experts", "num_local_experts")
    intermediate_field = "moe_intermediate_size"
    weights_in_model_dtype = True
    top_k_first = False

    def build_mlp(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
        routing = self.routing(cfg)
        if not routing.num_experts or not self.is_sparse(cfg.hf, layer):
            return LlamaMLP(cfg, tp)
        return SparseMoeBlock(cfg, tp, routing, self.intermediate_field,
                              cfg.hf.get("shared_expert_intermediate_size", 0))

    def routing(self, cfg: ModelConfig) -> Routing:
        key = next((key for key in self.experts_keys if key in cfg.hf), self.experts_keys[0])
        num_experts, top_k = cfg.hf.get(key) or 0, cfg.hf.get("num_experts_per_tok") or 0
        if num_experts and not 0 < top_k <= num_experts:
            raise ValueError(f"{cfg.path}/config.json: num_experts_per_tok={top_k} must be in [1, {key}={num_experts}]")
        return Routing(num_experts, top_k, renormalize=self.renormalize(cfg.hf),
                       weights_in_model_dtype=self.weights_in_model_dtype, top_k_first=self.top_k_first)

    @staticmethod
    def renormalize(hf: dict) -> bool:
        return hf.get("norm_topk_prob", False)

    @staticmethod
    def is_sparse(hf: dict, layer: int) -> bool:
        """Layers outside ``mlp_only_layers``, every ``decoder_sparse_step``-th."""
        return layer not in (hf.get("mlp_only_layers") or []) and (layer + 1) % hf.get("decoder_sparse_step", 1) == 0


class MixtralForCausalLM(MoeForCausalLM):
    """Every layer sparse, experts named w1 (gate), w3 (up), w2 (down) under ``block_sparse_moe``; routing
    weights always renormalised, kept fp32."""

    checkpoint_renames = {".block_sparse_moe.": ".mlp."}
    expert_parts = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", 0)}
    experts_keys = ("num_local_experts",)
    intermediate_field = "intermediate_size"
    weights_in_model_dtype = False

    @staticmethod
    def renormalize(hf: dict) -> bool:
        return True

    @staticmethod
    def is_sparse(hf: dict, layer: int) -> bool:
        return True


class Qwen2MoeForCausalLM(MoeForCausalLM):
    qkv_bias = True  # unless config.json's qkv_bias says otherwise


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True
