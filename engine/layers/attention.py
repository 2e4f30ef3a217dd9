"""Paged attention layer: writes the step's K/V into the pool, then attends over it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cuda_ext import KernelOps, reference
from engine.layers.linear import Shard


@dataclass(slots=True)
class StateMetadata:
    """A hybrid model's recurrent layers' share of the step, per sequence (cuda_ext/reference_recurrent.py)."""

    slots: torch.Tensor         # [B] int64, the sequence's state slot
    has_initial: torch.Tensor   # [B] bool, False: its state starts from zeros (its first tokens)
    save_slots: torch.Tensor    # [B] int64, -1 or the snapshot slot that gets its state after save_offsets rows
    save_offsets: torch.Tensor  # [B] int64

    def to(self, device: torch.device) -> StateMetadata:
        return StateMetadata(*(t.to(device, non_blocking=True) for t in (self.slots, self.has_initial,
                                                                          self.save_slots, self.save_offsets)))


@dataclass(slots=True)
class AttentionMetadata:
    """The flattened step, as the paged ops want it (built once per step by the runner)."""

    slot_mapping: torch.Tensor     # [T] int64, -1 = do not store
    block_tables: torch.Tensor     # [B, max_blocks] int32
    seq_lens: torch.Tensor         # [B] int32, context including this step's tokens
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int
    max_seq_len: int
    state: StateMetadata | None = None  # hybrid models only
    # Row ranges [start, end) of the step, each within one sequence's rows, whose rows also see each other's later
    # keys: an image's tokens in Gemma 3 (engine/models/gemma3_vl.py). None: causal throughout.
    bidirectional: list[tuple[int, int]] | None = None


class PagedAttention(nn.Module):
    """Stateless but for its cache views, which the model runner binds once, and (gpt-oss) its sink logits."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, sliding_window: int = 0,
                 softcap: float = 0.0, sinks: Shard | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window  # each query sees its last ``sliding_window`` positions; 0: all
        self.softcap = softcap  # scores capped to softcap * tanh(score / softcap) (Gemma 2); 0: off
        self.ops: KernelOps | None = None
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.k_scale: torch.Tensor | None = None  # a quantized cache's scales (cuda_ext/reference.py); else None
        self.v_scale: torch.Tensor | None = None
        # gpt-oss: one logit per head joining the softmax's denominator; ``sinks`` is this rank's share of the
        # checkpoint's (one per query head).
        self.sink_shard = sinks
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None

    def checkpoint_shard(self, param: str, part: None) -> Shard | None:
        return self.sink_shard

    def bind(self, ops: KernelOps, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
        self.ops, self.k_cache, self.v_cache, self.k_scale, self.v_scale = ops, k_cache, v_cache, k_scale, v_scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq * D]."""
        if self.k_cache is None:
            raise RuntimeError("PagedAttention used before the model runner bound its KV cache")
        self.ops.reshape_and_cache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, key_scale=self.k_scale,
                                   value_scale=self.v_scale)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over the bound cache as it is, this step's K/V already in it: alone, for a layer that reads
        another layer's K/V (Gemma 4's shared layers)."""
        out = torch.empty_like(q)
        args = (out, q, self.k_cache, self.v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                meta.max_query_len, meta.max_seq_len, self.scale, self.sliding_window, self.softcap)
        scales = dict(key_scale=self.k_scale, value_scale=self.v_scale,
                      sinks=None if self.sinks is None else self.sinks.float())  # the kernels' fp32
        if meta.bidirectional:  # the kernels are causal only: such a step (a prefill with images) takes the torch op
            reference.paged_attention(*args, **scales, bidirectional=meta.bidirectional)
        else:
            self.ops.paged_attention(*args, **scales)
        return out.view(q.shape[0], -1)
