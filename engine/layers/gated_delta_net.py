"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5: q|k|v through a short causal depthwise
conv (SiLU), then the gated delta rule over a recurrent matrix per value head (decay exp(g), write strength
beta), its output RMS-normalised and gated by SiLU(z). The conv window and the matrix live in state pools the
model runner binds (one slot per sequence, engine/core/state_cache.py); the ops read and update them in place.

Tensor parallelism shards the heads: each rank holds whole key-head groups (the value heads they serve), its
slice of each of q, k and v's conv channels and of z, b, a; out_proj is row-parallel."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cuda_ext import KernelOps
from engine.distributed.parallel_state import TensorParallel
from engine.layers.attention import AttentionMetadata
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear, Shard


@dataclass(frozen=True, slots=True)
class LinearStateSpec:
    """The Gated DeltaNet layers of a model and their heads (engine/models/layer_state.py reads them)."""

    layers: tuple[int, ...]  # the linear-attention layers
    num_key_heads: int
    num_value_heads: int
    key_dim: int
    value_dim: int
    conv_width: int  # the conv kernel size - 1: inputs a sequence's window keeps

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_key_heads * self.key_dim + self.num_value_heads * self.value_dim

    def slot_bytes(self, dtype_bytes: int, tp_size: int = 1) -> int:
        """One sequence's state over every linear layer, on one of ``tp_size`` ranks (each holds its heads)."""
        conv = self.conv_channels // tp_size * self.conv_width * dtype_bytes
        recurrent = self.num_value_heads // tp_size * self.key_dim * self.value_dim * 4
        return len(self.layers) * (conv + recurrent)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (fp32, cast, scaled by ``weight``) times SiLU(gate) in fp32, cast back."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return (self.weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class DepthwiseConv(nn.Module):
    """The conv's weight [channels, 1, kernel] (the checkpoint's shape), this rank's slice of each of its
    ``parts`` (q, k, v channels) one after another."""

    def __init__(self, parts: list[int], kernel: int, tp: TensorParallel) -> None:
        super().__init__()
        self.tp, self.parts = tp, parts
        self.local = [tp.shard(size, "the linear-attention conv channels") for size in parts]
        self.weight = nn.Parameter(torch.empty(sum(self.local), 1, kernel), requires_grad=False)

    def fused_checkpoint_shards(self, param: str) -> list[Shard]:
        return [Shard(dim=0, total=sum(self.parts), start=sum(self.parts[:i]) + self.tp.rank * size, size=size,
                      dest_start=sum(self.local[:i])) for i, size in enumerate(self.local)]


class GatedDeltaNet(nn.Module):
    """``split_projections``: Qwen3.5's separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a; else
    Qwen3-Next's in_proj_qkvz and in_proj_ba, interleaved per key head ([q, k, v..., z...] and [b..., a...])."""

    def __init__(self, spec: LinearStateSpec, hidden: int, eps: float, tp: TensorParallel,
                 split_projections: bool) -> None:
        super().__init__()
        self.spec, self.split_projections = spec, split_projections
        self.num_k_heads = tp.shard(spec.num_key_heads, "linear_num_key_heads")
        self.num_v_heads = tp.shard(spec.num_value_heads, "linear_num_value_heads")
        key_size, value_size = spec.num_key_heads * spec.key_dim, spec.num_value_heads * spec.value_dim
        heads = spec.num_value_heads
        if split_projections:
            self.in_proj_qkv = ColumnParallelLinear(hidden, [key_size, key_size, value_size], False, tp)
            self.in_proj_z = ColumnParallelLinear(hidden, [value_size], False, tp)
            self.in_proj_b = ColumnParallelLinear(hidden, [heads], False, tp)
            self.in_proj_a = ColumnParallelLinear(hidden, [heads], False, tp)
        else:
            self.in_proj_qkvz = ColumnParallelLinear(hidden, [2 * key_size + 2 * value_size], False, tp)
            self.in_proj_ba = ColumnParallelLinear(hidden, [2 * heads], False, tp)
        self.conv1d = DepthwiseConv([key_size, key_size, value_size], spec.conv_width + 1, tp)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = GatedRMSNorm(spec.value_dim, eps)
        self.out_proj = RowParallelLinear(value_size, hidden, False, tp)
        self.tp = tp
        self.ops: KernelOps | None = None
        self.conv_states: torch.Tensor | None = None
        self.states: torch.Tensor | None = None

    def checkpoint_shard(self, param: str, part: None) -> Shard:
        """dt_bias and A_log: one per value head."""
        return Shard(0, self.spec.num_value_heads, self.tp.rank * self.num_v_heads, self.num_v_heads)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One slot's conv window [channels, width] and recurrent matrices [value heads, key dim, value dim]."""
        return ((self.conv1d.weight.shape[0], self.spec.conv_width),
                (self.num_v_heads, self.spec.key_dim, self.spec.value_dim))

    def bind(self, ops: KernelOps, conv_states: torch.Tensor, states: torch.Tensor) -> None:
        self.ops, self.conv_states, self.states = ops, conv_states, states

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.states is None or meta.state is None:
            raise RuntimeError("GatedDeltaNet used before the model runner bound its state pools")
        qkv, z, b, a = self._project(x)
        st, qsl = meta.state, meta.query_start_loc
        steps = (st.slots, qsl, st.has_initial, st.save_slots, st.save_offsets)
        mixed = self.ops.causal_conv1d(qkv, self.conv1d.weight[:, 0], self.conv_states, *steps)
        key_size = self.num_k_heads * self.spec.key_dim
        q, k, v = mixed.split([key_size, key_size, mixed.shape[1] - 2 * key_size], dim=-1)
        t, dk, dv = x.shape[0], self.spec.key_dim, self.spec.value_dim
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = self.ops.gated_delta_rule(q.reshape(t, -1, dk), k.reshape(t, -1, dk), v.reshape(t, -1, dv), g,
                                        b.sigmoid(), self.states, *steps)
        return self.out_proj(self.norm(out, z).reshape(t, -1))

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q|k|v [T, conv channels], z [T, value heads, value dim], b and a [T, value heads]."""
        t, dk, dv = x.shape[0], self.spec.key_dim, self.spec.value_dim
        if self.split_projections:
            z = self.in_proj_z(x).view(t, -1, dv)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        group = self.num_v_heads // self.num_k_heads
        q, k, v, z = self.in_proj_qkvz(x).view(t, self.num_k_heads, -1).split([dk, dk, group * dv, group * dv], -1)
        b, a = self.in_proj_ba(x).view(t, self.num_k_heads, 2 * group).split([group, group], dim=-1)
        qkv = torch.cat((q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)), dim=-1)
        return qkv, z.reshape(t, -1, dv), b.reshape(t, -1), a.reshape(t, -1)
