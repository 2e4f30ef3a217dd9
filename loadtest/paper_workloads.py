"""Synthetic traces for the paper reproduction (no datasets offline).

Lengths follow ``loadtest.bench_offline.WORKLOADS`` (log-normal with the
datasets' means: ShareGPT-like input 161 / output 338, Alpaca-like 19 / 58),
token ids are random, arrivals are Poisson. For one seed the lengths and the
unit-rate arrival pattern are fixed, so a trace at rate r is the same requests
with arrivals scaled by 1/r: a rate sweep changes only the load.
"""
from __future__ import annotations

import random

from loadtest.bench_offline import WORKLOADS, lognormal_lengths
from loadtest.paper_sim import TraceRequest

VOCAB = 256  # token ids below the demo model's vocabulary (512), so a trace also runs on the real engine
# Shared-prefix (few-shot translation) requests: the per-request sentence and its
# translation, log-normal (mean, sigma, cap) like the other workloads.
TRANSLATION = ((24, 0.5, 128), (24, 0.5, 128))
SHOTS = {"1-shot": 80, "5-shot": 341}  # common prefix lengths of the paper's Fig. 16


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]


def _arrivals(count: int, rate: float, seed: int) -> list[float]:
    """Poisson arrivals at ``rate`` requests/s; all at 0 when the rate is infinite."""
    rng = random.Random(seed + 1)
    t, times = 0.0, []
    for _ in range(count):
        times.append(t)
        t += rng.expovariate(1.0)
    return [x / rate for x in times] if rate != float("inf") else [0.0] * count


def make_trace(workload: str, count: int, rate: float, seed: int = 0, n: int = 1,
               prefix_len: int = 0, beam_width: int = 0) -> list[TraceRequest]:
    """``count`` requests of ``workload`` ("sharegpt", "alpaca" or "translation",
    the latter after a common ``prefix_len``-token few-shot prefix), beam searches when ``beam_width``."""
    rng = random.Random(seed)
    (im, isg, icap), (om, osg, ocap) = TRANSLATION if workload == "translation" else WORKLOADS[workload]
    inputs = lognormal_lengths(rng, count, im, isg, icap)
    outputs = lognormal_lengths(rng, count, om, osg, ocap)
    prefix = _tokens(rng, prefix_len)
    return [TraceRequest(t, prefix + _tokens(rng, i), o, n, beam_width)
            for t, i, o in zip(_arrivals(count, rate, seed), inputs, outputs)]


def mean_lengths(trace: list[TraceRequest]) -> tuple[float, float]:
    """Realised mean (input, output) lengths."""
    return (sum(len(r.prompt) for r in trace) / len(trace), sum(r.max_tokens for r in trace) / len(trace))
