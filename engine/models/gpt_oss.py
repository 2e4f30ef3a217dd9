"""gpt-oss: Llama's decoder with q/k/v/o biases, a sink logit per head in every softmax (``paged_attention``'s
``sinks``), sliding-window and full layers alternating by ``layer_types``, YaRN RoPE, and a sparse MoE in every
layer: a router with a bias, the top k of its logits softmaxed among themselves, experts with biases and a clamped
SwiGLU (``fused_moe``'s ``swiglu_alpha`` / ``swiglu_limit``).

The checkpoint stores each expert projection stacked over the experts and transposed ([E, in, out]), gate and up
interleaved column by column (gate even, up odd); ``GptOssExperts`` reads them into ``FusedExperts``' layout
([gate | up] rows, this rank's share of the intermediate size)."""
from __future__ import annotations

import torch
from torch import nn

from engine.distributed.parallel_state import TensorParallel
from engine.models.config import ModelConfig
from engine.models.moe import FusedExperts, MoeForCausalLM, Router, Routing

_LAYER_TYPES = ("sliding_attention", "full_attention")


class GptOssExperts(FusedExperts):
    """FusedExperts with biases and the clamped SwiGLU, read from gpt-oss's stacked, interleaved tensors."""

    def checkpoint_shard(self, param: str, part: None) -> None:
        return None  # whole tensors: checkpoint_tensor cuts this rank's part after the reshuffle

    def checkpoint_tensor(self, name: str, attr: str, src, expected: list[int]) -> torch.Tensor:
        """The checkpoint's tensor ``attr`` (w13, w13_bias, w2, w2_bias) in this module's layout and share."""
        experts, hidden, inter = self.w13.shape[0], self.w2.shape[1], self.local * self.tp.size
        stored = {"w13": (experts, hidden, 2 * inter), "w13_bias": (experts, 2 * inter),
                  "w2": (experts, inter, hidden), "w2_bias": (experts, hidden)}[attr]
        if tuple(src.get_shape()) != stored:
            raise ValueError(f"shape mismatch for {name!r}: checkpoint has {tuple(src.get_shape())}, config.json "
                             f"gives {stored} (num_local_experts, hidden_size, intermediate_size)")
        return self.reshuffle(attr, src[:])

    def reshuffle(self, attr: str, t: torch.Tensor) -> torch.Tensor:
        start = self.tp.rank * self.local
        if attr == "w2_bias":  # added once: by rank 0, before the all-reduce sums the ranks
            return t if self.tp.rank == 0 else torch.zeros_like(t)
        if attr == "w2":
            return t.transpose(1, 2).narrow(2, start, self.local)
        rows = t.transpose(1, 2) if attr == "w13" else t  # [E, 2I(, H)]: gate and up interleaved
        pairs = rows.unflatten(1, (-1, 2)).narrow(1, start, self.local)
        return torch.cat((pairs[:, :, 0], pairs[:, :, 1]), dim=1)


class GptOssMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel, routing: Routing) -> None:
        super().__init__()
        self.routing = routing
        self.router = Router(cfg.hidden_size, routing.num_experts, bias=True)
        swiglu = (cfg.hf.get("swiglu_alpha", 1.702), cfg.hf.get("swiglu_limit", 7.0))
        self.experts = GptOssExperts(routing.num_experts, cfg.hidden_size, cfg.hf["intermediate_size"],
                                     "intermediate_size", tp, bias=True, swiglu=swiglu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.routing.route(self.router(x))
        return self.experts(x, weights, ids)


class GptOssForCausalLM(MoeForCausalLM):
    checkpoint_renames = {".self_attn.sinks": ".self_attn.attn.sinks", ".experts.gate_up_proj": ".experts.w13",
                          ".experts.down_proj": ".experts.w2"}
    expert_parts: dict[str, tuple[str, int]] = {}  # stacked in the checkpoint already
    mxfp4_tensors = (".experts.gate_up_proj", ".experts.down_proj")  # OpenAI's checkpoints: MXFP4 (engine/mxfp4.py)
    attention_sinks = True
    qkv_bias = True
    experts_keys = ("num_local_experts",)
    intermediate_field = "intermediate_size"
    top_k_first = True

    def build_model(self, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, tp: TensorParallel) -> nn.Module:
        check_config(cfg)
        return super().build_model(cfg, device, dtype, tp)

    def build_mlp(self, cfg: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
        return GptOssMoeBlock(cfg, tp, self.routing(cfg))


def check_config(cfg: ModelConfig) -> None:
    """Refuses, naming the field, what transformers' gpt-oss would not run as the engine does."""
    hf, where = cfg.hf, f"{cfg.path}/config.json"
    for field, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
        value = hf.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"{where}: {field} must be a positive number, got {value!r}")
    if not hf.get("num_local_experts"):
        raise ValueError(f"{where}: num_local_experts must be a positive integer, got {hf.get('num_local_experts')!r}")
    unknown = set(hf.get("layer_types") or ()) - set(_LAYER_TYPES)
    if unknown:
        raise ValueError(f"{where}: layer_types may hold {' and '.join(_LAYER_TYPES)} only, got {sorted(unknown)}")
    if hf.get("attention_bias") is not True:
        raise ValueError(f"{where}: attention_bias must be true (gpt-oss's projections have biases), got "
                         f"{hf.get('attention_bias')!r}")
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")):  # transformers' default YaRN, left unwritten
        raise ValueError(f"{where}: gpt-oss needs its rope_parameters (or rope_scaling) spelled out")
