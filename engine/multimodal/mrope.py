"""Multimodal RoPE (Qwen2.5-VL, Qwen3-VL): each rotary angle pair turns by one of a token's three positions
(temporal, height, width), as ``mrope_section`` assigns them: in runs (Qwen2.5-VL) or interleaved (Qwen3-VL). A
text token's three positions are equal, so plain RoPE at that position is exact for it; a step with image rows
builds per-row cos / sin tables instead."""
from __future__ import annotations

from dataclasses import dataclass

import torch

import cuda_ext
from engine.layers.rotary import RopeStep, RotaryEmbedding


def mrope_sections(hf: dict, rotary_dim: int, device: torch.device, interleaved: bool = False) -> torch.Tensor:
    """For each of the ``rotary_dim / 2`` angle pairs, which position row (0, 1, 2) turns it: ``mrope_section``
    [t, h, w] pairs in three runs, or ``interleaved`` as transformers' Qwen3-VL lays them: pair j is height's
    where j % 3 == 1 and j < 3h, width's where j % 3 == 2 and j < 3w, temporal's otherwise."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    sections = params.get("mrope_section")
    if not isinstance(sections, list) or sum(sections) != rotary_dim // 2:
        raise ValueError(f"config.json text_config.rope_parameters.mrope_section must list angle pairs summing to "
                         f"{rotary_dim // 2} (head_dim / 2), got {sections!r}")
    if interleaved:
        rows = [j % 3 if j % 3 and j < 3 * sections[j % 3] else 0 for j in range(rotary_dim // 2)]
    else:
        rows = [i % 3 for i, n in enumerate(sections) for _ in range(n)]
    return torch.tensor(rows, dtype=torch.int64, device=device)


@dataclass(frozen=True, slots=True)
class StepTables:
    """One step's cos / sin, a row per token: stands in a ``RotaryEmbedding`` in a ``RopeStep`` (and in the fused
    decoder layer, which reads its tables and the step's rows)."""

    cos: torch.Tensor
    sin: torch.Tensor
    rotary_dim: int
    ops: cuda_ext.KernelOps

    def __call__(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        self.ops.rotary_embedding(x[..., :self.rotary_dim], rows, self.cos, self.sin)


def mrope_step(rotary: RotaryEmbedding, sections: torch.Tensor, positions: torch.Tensor) -> RopeStep:
    """The step's rotary at ``positions`` [3, T]: angle pair j of row t turns by positions[sections[j], t], read
    from the same fp32-computed tables as plain RoPE."""
    rows = positions[sections]  # [pairs, T]
    pairs = torch.arange(len(sections), device=positions.device)[:, None]
    cos, sin = rotary.cos[rows, pairs].t().contiguous(), rotary.sin[rows, pairs].t().contiguous()
    tables = StepTables(cos, sin, rotary.rotary_dim, rotary.ops)
    return RopeStep(tables, torch.arange(positions.shape[1], device=positions.device))  # type: ignore[arg-type]
