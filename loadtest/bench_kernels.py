"""Decode attention micro-benchmark: the paged C++ op vs torch SDPA.

    python -m loadtest.bench_kernels --json results/kernels.json

For each (context length, dtype): batch 32, 14 query heads / 2 KV heads, head
size 64, block size 16, shuffled blocks of an engine-layout cache (4 layers):
  paged   torch.ops.pagedserve.paged_attention on the paged pool
  sdpa    F.scaled_dot_product_attention on contiguous [B, Hkv, L, D] K/V
  gather  gather the pool into contiguous K/V, then SDPA (a paged baseline without a kernel)
Reports median µs per call, ratios against the paged op, and the KV bytes/s it reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import cuda_ext

NUM_LAYERS = 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(slots=True)
class Shape:
    batch: int = 32
    num_heads: int = 14
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16


@dataclass(slots=True)
class Result:
    context: int
    dtype: str
    paged_us: float
    sdpa_us: float
    gather_us: float
    sdpa_over_paged: float
    gather_over_paged: float
    paged_kv_gb_s: float
    sdpa_kv_gb_s: float


def time_call(fn: Callable[[], object], min_seconds: float, repeats: int = 5) -> float:
    """Median µs per call over `repeats` timed loops that together fill about min_seconds."""
    fn()  # warm-up
    start = time.perf_counter()
    fn()
    loop = max(2, int(min_seconds / repeats / max(time.perf_counter() - start, 1e-7)))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(loop):
            fn()
        samples.append((time.perf_counter() - start) / loop * 1e6)
    return statistics.median(samples)


def paged_inputs(shape: Shape, context: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    blocks_per_seq = -(-context // shape.block_size)
    num_blocks = shape.batch * blocks_per_seq
    kv_cache = torch.randn(num_blocks, NUM_LAYERS, 2, shape.num_kv_heads, shape.block_size, shape.head_size,
                           generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(shape.batch, blocks_per_seq)
    return dict(
        query=torch.randn(shape.batch, shape.num_heads, shape.head_size, generator=gen).to(dtype),
        key_cache=kv_cache[:, 1, 0], value_cache=kv_cache[:, 1, 1], block_tables=tables,
        seq_lens=torch.full((shape.batch,), context, dtype=torch.int32),
        query_start_loc=torch.arange(shape.batch + 1, dtype=torch.int32),
    )


def gather_dense(cache: torch.Tensor, tables: torch.Tensor, context: int) -> torch.Tensor:
    """[B, Hkv, L, D] from the pool: what a paged system without a kernel does each step."""
    blocks = cache[tables.long()]  # [B, n, Hkv, bs, D]
    return blocks.permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :context]


def bench_one(ops: cuda_ext.KernelOps, shape: Shape, context: int, dtype_name: str, min_seconds: float) -> Result:
    dtype, gen = DTYPES[dtype_name], torch.Generator().manual_seed(context)
    x = paged_inputs(shape, context, dtype, gen)
    scale = shape.head_size**-0.5
    out = torch.empty_like(x["query"])
    q4 = x["query"][:, :, None]  # [B, Hq, 1, D]
    k_dense = gather_dense(x["key_cache"], x["block_tables"], context).contiguous()
    v_dense = gather_dense(x["value_cache"], x["block_tables"], context).contiguous()

    def paged() -> None:
        ops.paged_attention(out, x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"],
                            x["query_start_loc"], 1, context, scale)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, enable_gqa=True)

    def gather() -> torch.Tensor:
        k = gather_dense(x["key_cache"], x["block_tables"], context)
        v = gather_dense(x["value_cache"], x["block_tables"], context)
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    paged()
    torch.testing.assert_close(out, sdpa()[:, :, 0], atol=2e-2, rtol=2e-2)  # same numbers before timing
    paged_us, sdpa_us, gather_us = (time_call(f, min_seconds) for f in (paged, sdpa, gather))
    kv_bytes = 2 * k_dense.numel() * k_dense.element_size()
    return Result(context, dtype_name, paged_us, sdpa_us, gather_us, sdpa_us / paged_us, gather_us / paged_us,
                  kv_bytes / paged_us / 1e3, kv_bytes / sdpa_us / 1e3)


def print_table(results: list[Result]) -> None:
    header = f"{'context':>7} {'dtype':>5} {'paged µs':>9} {'sdpa µs':>9} {'gather µs':>9} " \
             f"{'sdpa/paged':>10} {'gather/paged':>12} {'paged GB/s':>10} {'sdpa GB/s':>9}"
    print(header)
    for r in results:
        print(f"{r.context:>7} {r.dtype:>5} {r.paged_us:>9.1f} {r.sdpa_us:>9.1f} {r.gather_us:>9.1f} "
              f"{r.sdpa_over_paged:>10.2f} {r.gather_over_paged:>12.2f} "
              f"{r.paged_kv_gb_s:>10.1f} {r.sdpa_kv_gb_s:>9.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 2048])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (the engine's default)")
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per variant and shape")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops, shape = cuda_ext.load_ops("ext"), Shape()
    results = []
    for context in args.contexts:
        for dtype_name in args.dtypes:
            print(f"[{len(results) + 1}/{len(args.contexts) * len(args.dtypes)}] context {context} {dtype_name}...",
                  file=sys.stderr, flush=True)
            results.append(bench_one(ops, shape, context, dtype_name, args.seconds))
    print_table(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(shape=asdict(shape), num_layers=NUM_LAYERS, shuffled_blocks=True, threads=args.threads,
                    torch=torch.__version__, cpu_capability=torch.backends.cpu.get_cpu_capability())
        args.json.write_text(json.dumps(dict(meta=meta, results=[asdict(r) for r in results]), indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
