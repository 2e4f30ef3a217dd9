"""The batch-1 decode floor: a decode step streams every weight it multiplies from memory once, so no engine
decodes one sequence faster than (read bandwidth) / (bytes of weights a token reads). bench_offline measures the
bandwidth in the same run and reports each pagedserve figure as a share of its floor."""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from engine.layers.linear import Linear

_BUFFER_BYTES = 1 << 30  # far past the last-level cache


def read_bandwidth(threads: int, repeats: int = 5) -> float:
    """Bytes per second ``threads`` torch threads read (the median of ``repeats`` sums over a 1 GiB buffer)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(_BUFFER_BYTES // 4)
        buffer.sum()  # first touch
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            buffer.sum()
            seconds.append(time.perf_counter() - start)
        return _BUFFER_BYTES / statistics.median(seconds)
    finally:
        torch.set_num_threads(previous)


def decode_bytes(model: nn.Module) -> int:
    """Bytes of weights one greedy decode token reads: every linear layer's as the GEMM reads them (the packed
    copy and its scales where packed; an LM head with an argmax screen, its screen: greedy decoding reads that
    and recomputes a few columns), norms and biases; not the embedding table (one row a token). MoE experts
    count whole (a batch-1 token reads only its top-k: an upper bound there)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed is not None:
            p = module.packed
            weights = p.packed if p.screen is None else p.screen.screen
            total += sum(t.nbytes for t in (weights, p.bias, p.scale, p.col_offset, p.w4_offset) if t is not None)
        elif not isinstance(module, nn.Embedding):
            total += sum(t.nbytes for t in module.parameters(recurse=False) if t.device.type != "meta")
    return total
