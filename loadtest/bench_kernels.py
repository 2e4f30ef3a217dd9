"""Decode attention micro-benchmark: the paged ops vs torch SDPA.

    python -m loadtest.bench_kernels --json results/kernels.json
    python -m loadtest.bench_kernels --device cuda --json results/kernels_cuda.json

For each (shape, context length, dtype), block size 16, shuffled blocks of an engine-layout cache (4 layers):
  paged   torch.ops.pagedserve.paged_attention (the simple kernel) on the paged pool
  split   torch.ops.pagedserve.paged_attention_split (CUDA only: on the CPU it is the same kernel as paged)
  sdpa    F.scaled_dot_product_attention on contiguous [B, Hkv, L, D] K/V (flash on CUDA: the baseline at its best)
  gather  gather the pool into contiguous K/V, then SDPA (a paged baseline without a kernel)
Shapes: CPU batch 32, 14 / 2 heads, head size 64; CUDA batch 64, 32 / 8 heads, head size 128 and batch 256,
14 / 2 heads, head size 64. Reports median µs per call, ratios, and the K/V bytes per second each reads.
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
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(slots=True)
class Shape:
    batch: int = 32
    num_heads: int = 14
    num_kv_heads: int = 2
    head_size: int = 64
    block_size: int = 16

    def name(self) -> str:
        return f"B{self.batch} {self.num_heads}/{self.num_kv_heads} D{self.head_size}"


SHAPES = {"cpu": [Shape()], "cuda": [Shape(64, 32, 8, 128), Shape(256, 14, 2, 64)]}
CONTEXTS = {"cpu": [128, 512, 2048], "cuda": [512, 2048, 8192]}


@dataclass(slots=True)
class Result:
    shape: str
    context: int
    dtype: str
    paged_us: float
    split_us: float | None  # CUDA only
    sdpa_us: float
    gather_us: float
    sdpa_over_paged: float
    gather_over_paged: float
    sdpa_over_split: float | None
    paged_kv_gb_s: float
    split_kv_gb_s: float | None
    sdpa_kv_gb_s: float


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn: Callable[[], object], min_seconds: float, device: str = "cpu", repeats: int = 5) -> float:
    """Median µs per call over `repeats` timed loops that together fill about min_seconds (a CUDA loop is
    timed from an idle device until its last kernel ends)."""
    fn()  # warm-up
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    loop = max(2, int(min_seconds / repeats / max(time.perf_counter() - start, 1e-7)))
    samples = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(loop):
            fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) / loop * 1e6)
    return statistics.median(samples)


def paged_inputs(shape: Shape, context: int, dtype: torch.dtype, gen: torch.Generator) -> dict:
    """Made on gen's device: a CUDA pool of several GB is drawn there, not copied over."""
    device = gen.device
    blocks_per_seq = -(-context // shape.block_size)
    num_blocks = shape.batch * blocks_per_seq
    kv_cache = torch.randn(num_blocks, NUM_LAYERS, 2, shape.num_kv_heads, shape.block_size, shape.head_size,
                           generator=gen, device=device, dtype=dtype)
    tables = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32).view(shape.batch, blocks_per_seq)
    return dict(
        query=torch.randn(shape.batch, shape.num_heads, shape.head_size, generator=gen, device=device, dtype=dtype),
        key_cache=kv_cache[:, 1, 0], value_cache=kv_cache[:, 1, 1], block_tables=tables,
        seq_lens=torch.full((shape.batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(shape.batch + 1, dtype=torch.int32, device=device),
    )


def gather_dense(cache: torch.Tensor, tables: torch.Tensor, context: int) -> torch.Tensor:
    """[B, Hkv, L, D] from the pool: what a paged system without a kernel does each step."""
    blocks = cache[tables.long()]  # [B, n, Hkv, bs, D]
    return blocks.permute(0, 2, 1, 3, 4).flatten(2, 3)[:, :, :context]


def sdpa_variants(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> list[Callable[[], object]]:
    """SDPA on native GQA K/V, and on CUDA also on K/V expanded to every query head (the fastest counts: a
    backend may not take GQA as it is)."""
    variants = [lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)]
    if q4.is_cuda:
        group = q4.shape[1] // k.shape[1]
        k_wide, v_wide = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        variants.append(lambda: F.scaled_dot_product_attention(q4, k_wide, v_wide, scale=scale))
    return variants


def bench_one(shape: Shape, context: int, dtype_name: str, min_seconds: float, device: str) -> Result:
    dtype, gen = DTYPES[dtype_name], torch.Generator(device).manual_seed(context)
    x = paged_inputs(shape, context, dtype, gen)
    scale = shape.head_size**-0.5
    out = torch.empty_like(x["query"])
    q4 = x["query"][:, :, None]  # [B, Hq, 1, D]
    k_dense = gather_dense(x["key_cache"], x["block_tables"], context).contiguous()
    v_dense = gather_dense(x["value_cache"], x["block_tables"], context).contiguous()

    def run(op: Callable[..., None]) -> Callable[[], None]:
        return lambda: op(out, x["query"], x["key_cache"], x["value_cache"], x["block_tables"], x["seq_lens"],
                          x["query_start_loc"], 1, context, scale)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q4, k_dense, v_dense, scale=scale, enable_gqa=True)

    def gather() -> torch.Tensor:
        k = gather_dense(x["key_cache"], x["block_tables"], context)
        v = gather_dense(x["value_cache"], x["block_tables"], context)
        return F.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

    kernels = [torch.ops.pagedserve.paged_attention] + ([torch.ops.pagedserve.paged_attention_split]
                                                        if device == "cuda" else [])
    expected, timed = sdpa()[:, :, 0], []
    for kernel in kernels:
        out.fill_(float("nan"))
        run(kernel)()
        torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)  # same numbers before timing
        timed.append(time_call(run(kernel), min_seconds, device))
    paged_us, split_us = timed[0], timed[1] if len(timed) > 1 else None
    sdpa_us = min(time_call(f, min_seconds, device) for f in sdpa_variants(q4, k_dense, v_dense, scale))
    gather_us = time_call(gather, min_seconds, device)
    kv_bytes = 2 * k_dense.numel() * k_dense.element_size()
    return Result(shape.name(), context, dtype_name, paged_us, split_us, sdpa_us, gather_us, sdpa_us / paged_us,
                  gather_us / paged_us, split_us and sdpa_us / split_us, kv_bytes / paged_us / 1e3,
                  split_us and kv_bytes / split_us / 1e3, kv_bytes / sdpa_us / 1e3)


def optional(value: float | None, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def print_table(results: list[Result]) -> None:
    header = f"{'shape':>16} {'context':>7} {'dtype':>5} {'paged µs':>9} {'split µs':>9} {'sdpa µs':>9} " \
             f"{'gather µs':>9} {'sdpa/paged':>10} {'sdpa/split':>10} {'gather/paged':>12} {'paged GB/s':>10} " \
             f"{'split GB/s':>10} {'sdpa GB/s':>9}"
    print(header)
    for r in results:
        print(f"{r.shape:>16} {r.context:>7} {r.dtype:>5} {r.paged_us:>9.1f} {optional(r.split_us, 9, 1)} "
              f"{r.sdpa_us:>9.1f} {r.gather_us:>9.1f} {r.sdpa_over_paged:>10.2f} "
              f"{optional(r.sdpa_over_split, 10, 2)} {r.gather_over_paged:>12.2f} {r.paged_kv_gb_s:>10.1f} "
              f"{optional(r.split_kv_gb_s, 10, 1)} {r.sdpa_kv_gb_s:>9.1f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--device", choices=sorted(SHAPES), default="cpu")
    parser.add_argument("--contexts", type=int, nargs="+", help="default: 128 512 2048 (CPU), 512 2048 8192 (CUDA)")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES),
                        help="default: fp32 bf16 (CPU; fp16 is CUDA only), bf16 (CUDA)")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (the engine's default)")
    parser.add_argument("--seconds", type=float, default=1.0, help="timed seconds per variant and shape")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cuda_ext.load_ops("ext")  # builds the ops
    contexts = args.contexts or CONTEXTS[args.device]
    dtypes = args.dtypes or (["bf16"] if args.device == "cuda" else ["fp32", "bf16"])
    runs = [(shape, context, dtype) for shape in SHAPES[args.device] for context in contexts for dtype in dtypes]
    results = []
    for shape, context, dtype_name in runs:
        print(f"[{len(results) + 1}/{len(runs)}] {shape.name()} context {context} {dtype_name}...",
              file=sys.stderr, flush=True)
        results.append(bench_one(shape, context, dtype_name, args.seconds, args.device))
    print_table(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = dict(device=args.device, shapes=[asdict(s) for s in SHAPES[args.device]], num_layers=NUM_LAYERS,
                    shuffled_blocks=True, threads=args.threads, torch=torch.__version__, cpu_capability=torch.backends.cpu.get_cpu_capability())
        args.json.write_text(json.dumps(dict(meta=meta, results=[asdict(r) for r in results]), indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
