"""fused_moe (the grouped expert GEMM) against Python loops over the same experts, in the same run.

    python -m loadtest.bench_moe --threads 2 --json results/moe.json

Shapes (scaled down so a laptop holds them): Qwen3-30B-A3B's at a quarter (hidden 512, 32 experts of 192, top 8)
and Mixtral 8x7B's at an eighth (hidden 512, 8 experts of 1792, top 2). Per row count (1: a decode step of one
sequence; 256: a prefill chunk), the median ms per call of
  fused_moe      the compiled op (pairs sorted by expert, one GEMM per expert group)
  expert_loop    a Python loop over the experts a token picked, each one's tokens as one matmul (transformers'
                 eager MoE)
  reference      cuda_ext.reference.fused_moe: a Python loop over tokens and their k experts
and fused_moe's speed-up over each. Every call's output is checked against the reference first.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import cuda_ext
from cuda_ext import reference

SHAPES = {  # hidden, experts, intermediate, top-k
    "qwen3-30b-a3b/4": (512, 32, 192, 8),
    "mixtral-8x7b/8": (512, 8, 1792, 2),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def expert_loop(hidden, w13, w2, ids, weights) -> torch.Tensor:
    """transformers' eager MoE: per expert hit, its tokens gathered, one matmul each, scattered back."""
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for e in ids.unique().tolist():
        rows, slots = (ids == e).nonzero(as_tuple=True)
        y = reference.silu_and_mul(hidden[rows] @ w13[e].t()) @ w2[e].t()
        out.index_add_(0, rows, y.float() * weights[rows, slots, None].float())
    return out.to(hidden.dtype)


def inputs(shape: tuple[int, int, int, int], rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    hidden, experts, intermediate, k = shape
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(experts, 2 * intermediate, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, intermediate, generator=gen) * intermediate ** -0.5).to(dtype)
    weights, ids = torch.randn(rows, experts, generator=gen).softmax(-1).topk(k, dim=-1)
    return x, w13, w2, ids, weights / weights.sum(-1, keepdim=True)


def measure(systems: dict[str, Callable], args: tuple, calls: int) -> dict[str, float]:
    """Median ms per call; the systems alternate call by call, so load on the machine hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(calls):
        for name, fn in systems.items():
            start = time.perf_counter()
            fn(*args)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    ops = cuda_ext.load_ops("ext")
    torch.set_num_threads(args.threads)
    systems = {"fused_moe": ops.fused_moe, "expert_loop": expert_loop, "reference": reference.fused_moe}
    results = []
    print(f"{'shape':<18}{'rows':>6}" + "".join(f"{name + ' ms':>16}" for name in systems) + "   speed-up")
    for name in args.shapes:
        for rows in args.rows:
            operands = inputs(SHAPES[name], rows, DTYPES[args.dtype])
            want = reference.fused_moe(*operands).float()
            for fn in systems.values():
                error = ((fn(*operands).float() - want).abs().max() / want.abs().max()).item()
                assert error <= 1e-2, f"{name}, {rows} rows: {error:.2e} off the reference"
            ms = measure(systems, operands, args.calls)
            speedup = {other: ms[other] / ms["fused_moe"] for other in systems if other != "fused_moe"}
            results.append({"shape": name, "rows": rows, "dtype": args.dtype, "threads": args.threads, "ms": ms,
                            "speedup": speedup})
            print(f"{name:<18}{rows:>6}" + "".join(f"{ms[s]:>16.3f}" for s in systems) + "   "
                  + ", ".join(f"{s} x{v:.1f}" for s, v in speedup.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
