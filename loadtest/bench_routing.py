"""Routing benchmark: prefix-aware routing against shared-queue pulling, several engines, one run.

    python -m loadtest.bench_routing [--json FILE] [--workers 3] [--concurrency 24] [--conversations 96]
                                     [--turns 6] [--repeats 3]

One stack (redis-server, ``--workers`` workers on the demo model, two gateways: one routing by cached prefix,
one with ``--no-prefix-routing``) and a one-worker stack for the single-engine reference. Workloads:

- ``chat``: ``--conversations`` multi-turn conversations, ``--concurrency`` at once (a closed loop: each
  client starts its next conversation when one ends, so the run measures the fleet saturated, in steady
  state, not one burst of first turns), each turn after the previous one's answer, each opening with one of
  ``--system-prompts`` long system prompts; a turn's prompt is the previous turn's plus the answer and a
  new user message (token ids; the answer is synthetic, as a client that edits it would send);
- ``unshared``: the same number of requests with unrelated prompts of the same lengths.

Each (workload, mode) runs on fresh content (its own seed), so no run reuses another's cache. Reported per
run: prefix-cache hit rate (cached / prompt tokens, from each response's usage), requests/s, prompt and
output tokens/s; then routing's hit rate against the single engine's and its throughput against the shared
queue's. ``--repeats`` alternates the modes that many times and keeps each one's best throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass

import aiohttp

from engine.demo_model import ensure_demo_model
from service.local_stack import LocalStack

MODEL_NAME = "bench"
API_KEY = "sk-bench-routing"


@dataclass(slots=True)
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    failed: int = 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--conversations", type=int, default=96)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=384)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=24,
                   help="conversations at once: each slot starts its next conversation when one ends")
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    return p.parse_args()


def start_stack(workers: int, args: argparse.Namespace, gateways: list[list[str]]) -> LocalStack:
    stack = LocalStack(env={"PAGEDSERVE_API_KEY": API_KEY})
    common = ["--served-model-name", MODEL_NAME, "--log-level", "WARNING", "--model", ensure_demo_model()]
    for i in range(workers):
        stack.add_worker(common + ["--engine-id", f"w{i}", "--num-threads", str(args.num_threads),
                                   "--num-device-blocks", "4096", "--max-num-seqs", "64"])
    for flags in gateways:
        stack.add_gateway(common + ["--max-pending-requests", "100000", "--prefix-cache-secret", "bench", *flags])
    return stack


def tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(count)]


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                   totals: Totals) -> None:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            totals.failed += 1
            return
        usage = (await response.json())["usage"]
    totals.requests += 1
    totals.prompt_tokens += usage["prompt_tokens"]
    totals.cached_tokens += usage["prompt_tokens_details"]["cached_tokens"]
    totals.output_tokens += usage["completion_tokens"]


async def slot(session: aiohttp.ClientSession, url: str, systems: list[list[int]], seed: int,
               conversations: range, args: argparse.Namespace, totals: Totals, shared: bool) -> None:
    """One client at a time: its conversations one after another (a user leaves, the next one comes)."""
    for i in conversations:
        await conversation(session, url, systems[i % len(systems)], random.Random(seed * 1000 + i), args, totals,
                           shared)


async def conversation(session: aiohttp.ClientSession, url: str, system: list[int], rng: random.Random,
                       args: argparse.Namespace, totals: Totals, shared: bool) -> None:
    """``shared``: turns that extend one another after a common system prompt; else unrelated prompts of the
    same lengths."""
    history = list(system)
    for _ in range(args.turns):
        history += tokens(rng, args.user_tokens)
        prompt = history if shared else tokens(rng, len(history))
        await complete(session, url, prompt, args.max_tokens, totals)
        history += tokens(rng, args.max_tokens)  # the answer, as the client sends it back


async def run_workload(url: str, args: argparse.Namespace, shared: bool, seed: int) -> dict:
    rng = random.Random(seed)
    systems = [tokens(rng, args.system_tokens) for _ in range(args.system_prompts)]
    totals = Totals()
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        await asyncio.gather(*(slot(session, url, systems, seed, range(first, args.conversations, args.concurrency),
                                    args, totals, shared) for first in range(args.concurrency)))
        elapsed = time.perf_counter() - start
    return {"hit_rate": totals.cached_tokens / max(1, totals.prompt_tokens), "requests_s": totals.requests / elapsed,
            "prompt_tok_s": totals.prompt_tokens / elapsed, "output_tok_s": totals.output_tokens / elapsed,
            "failed": totals.failed, "seconds": elapsed}


def best(runs: list[dict]) -> dict:
    return max(runs, key=lambda r: r["requests_s"])


def measure(args: argparse.Namespace) -> dict:
    results: dict[str, dict] = {}
    with start_stack(args.workers, args, [[], ["--no-prefix-routing"]]) as stack:
        stack.wait_ready(300)
        routed_url, shared_url = (g.url for g in stack.gateways)
        seed = 1
        for workload, shared in (("chat", True), ("unshared", False)):
            runs: dict[str, list[dict]] = {"routing": [], "shared_queue": []}
            for _ in range(args.repeats):
                for mode, url in (("routing", routed_url), ("shared_queue", shared_url)):
                    print(f"{workload}, {mode}: {args.conversations} x {args.turns} requests", flush=True)
                    runs[mode].append(asyncio.run(run_workload(url, args, shared, seed)))
                    seed += 1
            results[workload] = {mode: best(r) | {"runs": r} for mode, r in runs.items()}
    with start_stack(1, args, [[]]) as single:
        single.wait_ready(300)
        print(f"chat, one engine: {args.conversations} x {args.turns} requests", flush=True)
        results["chat"]["one_engine"] = asyncio.run(run_workload(single.url, args, True, seed))
    return results


def main() -> None:
    args = parse_args()
    results = measure(args)
    chat, unshared = results["chat"], results["unshared"]
    results["ratios"] = {
        "chat_hit_rate_vs_one_engine": chat["routing"]["hit_rate"] / max(1e-9, chat["one_engine"]["hit_rate"]),
        "chat_throughput_vs_shared_queue": chat["routing"]["requests_s"] / chat["shared_queue"]["requests_s"],
        "unshared_throughput_vs_shared_queue": unshared["routing"]["requests_s"] / unshared["shared_queue"]["requests_s"],
    }
    results["config"] = vars(args)
    for workload in ("chat", "unshared"):
        for mode, r in results[workload].items():
            print(f"{workload:9s} {mode:13s} hit rate {r['hit_rate']:.3f}, {r['requests_s']:.2f} req/s, "
                  f"{r['prompt_tok_s']:.0f} prompt tok/s, {r['output_tok_s']:.0f} output tok/s, {r['failed']} failed")
    for name, value in results["ratios"].items():
        print(f"{name}: {value:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
