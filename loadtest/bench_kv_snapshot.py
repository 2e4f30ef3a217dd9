"""What the dashboard's KV snapshots cost the engine: step time with and without them, 256 sequences decoding.

  python -m loadtest.bench_kv_snapshot --seqs 256 --rounds 8 --window 16 [--model PATH] [--device cuda]

One engine (the demo model unless ``--model``), ``--seqs`` requests decoding together (each holds its blocks
for the whole run: ``ignore_eos``, enough ``max_tokens``). Steps are measured in windows of ``--window``
steps, alternately without snapshots and with them taken as a watched worker takes them
(``service.worker.take_kv_snapshot`` between steps whenever due: at most every 0.5 s, less often when one
costs more than 0.5% of that), ABBA-ordered so the steps' slow growth with the context cancels. Reported:
the mean step time of each kind, wall clock and the process's CPU time (all its threads; on a shared
machine the wall clock also counts other processes' turns), their ratios (with the standard error over
the ABBA pairs), the snapshots' own cost (ms of CPU each), and that cost as a share of the wall time
with snapshots: the slowdown it implies.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.demo_model import ensure_demo_model
from service.worker import take_kv_snapshot, tune_gc


def build_engine(args: argparse.Namespace) -> LLMEngine:
    per_seq = -(-(args.prompt_len + args.max_tokens) // args.block_size) + 1
    return LLMEngine(EngineConfig(
        model=args.model or ensure_demo_model(), device=args.device, block_size=args.block_size,
        num_device_blocks=args.seqs * per_seq + 64, max_num_seqs=args.seqs,
        max_num_batched_tokens=max(args.seqs * args.prompt_len, 2048), max_model_len=args.prompt_len + args.max_tokens,
        show_progress=False))


def fill(engine: LLMEngine, args: argparse.Namespace) -> None:
    """The sequences added and their prompts computed: every later step decodes all of them."""
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    for i in range(args.seqs):
        engine.add_request(f"r{i}", [(7 * i + j) % 200 + 1 for j in range(args.prompt_len)], params)
    while engine.stats().num_requests_waiting or engine.stats().generation_tokens_total < args.seqs:
        engine.step()


class Watched:
    """Snapshots as a watched worker takes them: whenever due, its schedule kept across windows."""

    def __init__(self) -> None:
        self.due = 0.0
        self.costs: list[float] = []  # CPU seconds of each

    def after_step(self, engine: LLMEngine) -> None:
        if time.monotonic() >= self.due:
            cpu = time.thread_time()
            _, interval = take_kv_snapshot(engine, "bench", "bench", {})
            self.costs.append(time.thread_time() - cpu)
            self.due = time.monotonic() + interval


def window(engine: LLMEngine, steps: int, watched: Watched | None) -> tuple[float, float]:
    """Mean seconds a step over ``steps`` steps, wall clock and process CPU, snapshots taken when due counted in."""
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(steps):
        engine.step()
        if watched is not None:
            watched.after_step(engine)
    return (time.perf_counter() - started) / steps, (time.process_time() - cpu_started) / steps


def ratio(off: list[float], on: list[float]) -> tuple[float, float]:
    """mean(on) / mean(off), and the standard error of the per-pair ratios."""
    pairs = [b / a for a, b in zip(off, on)]
    return statistics.mean(on) / statistics.mean(off), statistics.stdev(pairs) / len(pairs) ** 0.5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=8, help="ABBA rounds (4 windows each)")
    parser.add_argument("--window", type=int, default=16, help="steps per window")
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()
    args.max_tokens = args.rounds * 4 * args.window + 2 * args.window + 8
    engine = build_engine(args)
    fill(engine, args)
    tune_gc()  # as a worker process does once its engine is loaded
    window(engine, args.window, None)  # warm up
    off, on, watched = [], [], Watched()
    for _ in range(args.rounds):
        for snapshots in (False, True, True, False):
            (on if snapshots else off).append(window(engine, args.window, watched if snapshots else None))
    costs = watched.costs
    assert engine.stats().num_requests_running == args.seqs, "a sequence finished during the measurement"
    (wall_off, cpu_off), (wall_on, cpu_on) = zip(*off), zip(*on)
    wall, wall_error = ratio(wall_off, wall_on)
    cpu, cpu_error = ratio(cpu_off, cpu_on)
    figures = {
        "seqs": args.seqs, "device": args.device, "num_blocks": engine.stats().num_blocks_total,
        "blocks_used": engine.stats().num_blocks_used, "steps_per_kind": len(off) * args.window,
        "step_ms_without": 1000 * statistics.mean(wall_off), "step_ms_with": 1000 * statistics.mean(wall_on),
        "wall_ratio": wall, "wall_ratio_stderr": wall_error, "cpu_ratio": cpu, "cpu_ratio_stderr": cpu_error,
        "snapshots": len(costs), "snapshot_ms": 1000 * statistics.mean(costs),
        "snapshot_share": sum(costs) / (statistics.mean(wall_on) * len(on) * args.window),
    }
    for name, value in figures.items():
        print(f"{name:>22}: {value:.4f}" if isinstance(value, float) else f"{name:>22}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
