"""Decode-only steps at a few padded batch sizes (buckets), over static input buffers: on CUDA each bucket's
forward pass is captured once as a CUDA graph and replayed, one launch for the whole model instead of one per
op; on CPU the same padded buffers run eagerly (no capture), so the padding is tested where no GPU is."""
from __future__ import annotations

from bisect import bisect_left

import torch
from torch import nn

from engine.layers.attention import AttentionMetadata
from engine.step_inputs import StepBuffers, StepLayout, StepTensors, TokenFill

_NO_TOKENS = torch.empty(0, dtype=torch.int64)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64 and every 16 beyond, up to ``max_num_seqs`` (always the last)."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_num_seqs, 16)]
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class DecodeGraphs:
    """Runs a step whose every sequence decodes one token, padded to the smallest bucket that holds it."""

    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device) -> None:
        self.model = model
        self.buckets = decode_buckets(max_num_seqs)
        self.width = max_blocks_per_seq
        top = self.buckets[-1]
        self.inputs = StepBuffers(device, StepLayout(top, top, self.width, top).nbytes)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if device.type == "cuda":
            self._capture(max_model_len)

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest bucket holding ``num_seqs`` sequences; None past the largest."""
        i = bisect_left(self.buckets, num_seqs)
        return self.buckets[i] if i < len(self.buckets) else None

    def accepts(self, num_seqs: int, max_query_len: int, width: int) -> bool:
        return max_query_len == 1 and width <= self.width and self.bucket(num_seqs) is not None

    def forward(self, step: StepTensors, fill: TokenFill | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states of the padded batch, the rows to sample); ``step`` holds the decode step on the host,
        ``fill`` the tokens its input ids still lack (async scheduling)."""
        size = self.bucket(len(step.meta.seq_lens))
        layout = StepLayout(size, size, self.width, len(step.sample_rows))
        padded = self.inputs.load(layout, step)
        if fill is not None:
            fill.apply(padded.input_ids)
        graph = self._graphs.get(size)
        if graph is None:
            return self.model(padded.input_ids, padded.positions, padded.meta), padded.sample_rows
        graph[0].replay()
        return graph[1], padded.sample_rows

    @torch.inference_mode()
    def _capture(self, max_model_len: int) -> None:
        """Largest bucket first, all in one memory pool: a smaller graph reuses the larger one's memory (they
        never run at once). The attention kernels take max_seq_len only as a hint: any length replays."""
        pool = None
        for size in reversed(self.buckets):
            layout = StepLayout(size, size, self.width, 0)
            self.inputs.load(layout, _no_seqs(self.width))  # all pads: what the warm-up and the capture read
            static = self.inputs.views(layout, 1, max_model_len)
            self.model(static.input_ids, static.positions, static.meta)  # warm-up: lazy inits stay out of the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(static.input_ids, static.positions, static.meta)
            pool = graph.pool()
            self._graphs[size] = (graph, hidden)


def _no_seqs(width: int) -> StepTensors:
    """A step of no sequences, on the host: loaded at a bucket's layout, every row is a pad."""
    meta = AttentionMetadata(slot_mapping=_NO_TOKENS, block_tables=torch.empty(0, width, dtype=torch.int32),
                             seq_lens=torch.empty(0, dtype=torch.int32),
                             query_start_loc=torch.zeros(1, dtype=torch.int32), max_query_len=1, max_seq_len=1)
    return StepTensors(_NO_TOKENS, _NO_TOKENS, meta, _NO_TOKENS)
