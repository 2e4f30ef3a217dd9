"""Quantized linear layers against the unquantized one, one row count at a time, in the same run.

    python -m loadtest.bench_linear --json results/linear.json

For Qwen2-0.5B's MLP shapes (896 -> 9728 gate_up, 4864 -> 896 down), bf16 activations and weights packed once:
  bf16   skinny_linear on bf16 weights (the unquantized baseline: vdpbf16ps, or AMX from 2 rows, where the CPU
         has them; fp32 weights and activations where it has no AVX512-BF16, the faster there)
  w8a16  skinny_linear_w8: int8 weights widened in registers, activations as they are
  w8a8   skinny_linear_w8a8: each row of x quantized to int8, vpdpbusd (AVX512-VNNI CPUs only)
  w4a16  skinny_linear_w4: 4-bit weights, groups of 128, symmetric, vdpbf16ps on bf16 rows (AVX-512 CPUs only)
Reports the median ms per call over --calls calls (the systems alternating per call) and each one's speed-up
over the baseline.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

import cuda_ext
from engine import int4
from engine.quantization import quantize

SHAPES = {"gate_up 896->9728": (896, 9728), "down 4864->896": (4864, 896)}


def layers(in_features: int, out_features: int) -> tuple[torch.dtype, dict[str, Callable]]:
    """(the activations' dtype, each system's packed layer)."""
    weight = torch.randn(out_features, in_features) * 0.02
    dtype = torch.bfloat16 if torch.ops.pagedserve.skinny_linear_supports(torch.bfloat16) else torch.float32
    q, scale = quantize(weight, "int8")
    systems = {"bf16" if dtype == torch.bfloat16 else "fp32": cuda_ext.pack_linear(weight.to(dtype), None),
               "w8a16": cuda_ext.pack_linear(q, None, scale=scale)}
    if torch.ops.pagedserve.skinny_linear_w8a8_supports():
        systems["w8a8"] = cuda_ext.pack_linear(q, None, scale=scale, quantize_activations=True)
    if torch.ops.pagedserve.skinny_linear_w4_supports():
        codes, scale4, _ = int4.quantize(weight, 128, symmetric=True)
        systems["w4a16"] = cuda_ext.pack_linear(codes, None, scale=scale4)
    return dtype, systems


def measure(systems: dict[str, Callable], x: torch.Tensor, calls: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(calls):
        for name, layer in systems.items():
            start = time.perf_counter()
            layer(x)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 64])
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    cuda_ext.load_ops("ext")
    torch.set_num_threads(args.threads)
    results = []
    for shape, (in_features, out_features) in SHAPES.items():
        dtype, systems = layers(in_features, out_features)
        baseline = next(iter(systems))
        for rows in args.rows:
            ms = measure(systems, torch.randn(rows, in_features).to(dtype), args.calls)
            speedup = {name: round(ms[baseline] / t, 2) for name, t in ms.items() if name != baseline}
            results.append(dict(shape=shape, rows=rows, ms={k: round(v, 4) for k, v in ms.items()}, speedup=speedup))
            print(f"{shape:>18} rows {rows:3d}: " + "  ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
                  + "  speed-up vs " + baseline + ": " + ", ".join(f"{k} {v}x" for k, v in speedup.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=args.threads, calls=args.calls, results=results), f, indent=2)


if __name__ == "__main__":
    main()
