"""Fairness benchmark: one API key's flood against another key's chat, on the whole stack, in one run.

    python -m loadtest.bench_fairness [--json FILE] [--chat-requests 200] [--chat-rate 4]
        [--flood-clients 48] [--flood-policy priority=10;max_concurrent=4]

One stack (redis-server, one worker, one gateway, the demo model) with three keys: ``chat``, ``flood``
(no policy) and ``limited`` (``--flood-policy``). Three phases, each sending the same chat trace (Poisson
arrivals, short prompts and answers, streamed) and measuring its time to first token:

1. ``alone``: the chat key by itself, the baseline;
2. ``flood``: ``--flood-clients`` clients of the ``flood`` key each sending long requests back to back;
3. ``limited``: the same flood from the ``limited`` key, whose policy lowers its priority and bounds its
   requests in flight (its clients retry a 429 after 0.2 s: an impatient client, not a polite one).

The flood's clients run in a process of their own at the lowest CPU priority (a tenant on another machine):
in the chat client's process their streams and refusals would delay the reading of the chat's first tokens,
and at normal priority they would take CPU time from the server on a 2-core machine: costs of the load
generator, not of the server.

Reported: chat TTFT (mean, median, p99) per phase, the ratio of each flooded phase's p99 to the alone
p99, and the flood's own throughput (the policy's cost to the flooding key).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import random
import time
from collections.abc import AsyncIterator, Callable
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as EventType

import aiohttp

from engine.demo_model import ensure_demo_model
from loadtest.bench_serving import _summary
from service.local_stack import LocalStack

MODEL_NAME = "bench"
KEYS = {"chat": "sk-bench-chat", "flood": "sk-bench-flood", "limited": "sk-bench-limited"}
WORDS = "the paged cache holds every block of every request in one pool".split()


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # 200: a p99 of fewer samples is the slowest request or two.
    p.add_argument("--chat-requests", type=int, default=200)
    p.add_argument("--chat-rate", type=float, default=4.0, help="chat requests per second (Poisson)")
    p.add_argument("--chat-tokens", type=int, default=16, help="max_tokens of a chat request")
    p.add_argument("--flood-clients", type=int, default=48)
    p.add_argument("--flood-tokens", type=int, default=128, help="max_tokens of a flood request")
    p.add_argument("--flood-policy", default="priority=10;max_concurrent=4")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    return p.parse_args()


def start_stack(args: argparse.Namespace) -> LocalStack:
    stack = LocalStack(env={"PAGEDSERVE_API_KEY": ",".join(KEYS.values()),
                            "PAGEDSERVE_KEY_POLICY": f"{KEYS['limited']}:{args.flood_policy}"})
    common = ["--served-model-name", MODEL_NAME, "--log-level", "WARNING", "--model", ensure_demo_model()]
    stack.add_worker(common + ["--num-threads", str(args.num_threads), "--max-num-seqs", str(args.max_num_seqs),
                               "--num-device-blocks", "4096"])
    stack.add_gateway(common + ["--max-pending-requests", "100000"])
    return stack


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def stream(session: aiohttp.ClientSession, url: str, key: str, text: str, max_tokens: int) -> float | None:
    """One streamed completion: its time to first token, or None when refused (429)."""
    body = {"model": MODEL_NAME, "prompt": text, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    start, ttft = time.perf_counter(), None
    async with session.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status == 429:
            return None
        r.raise_for_status()
        async for line in r.content:
            if ttft is None and line.startswith(b"data: {"):
                ttft = time.perf_counter() - start
    return ttft


async def chat_trace(session: aiohttp.ClientSession, url: str, args: argparse.Namespace) -> list[float]:
    rng = random.Random(args.seed)
    tasks = []
    for _ in range(args.chat_requests):
        tasks.append(asyncio.create_task(stream(session, url, KEYS["chat"], prompt(rng, 24), args.chat_tokens)))
        await asyncio.sleep(rng.expovariate(args.chat_rate))
    return [t for t in await asyncio.gather(*tasks) if t is not None]


async def flood_client(session: aiohttp.ClientSession, url: str, key: str, args: argparse.Namespace,
                       stop: EventType, counts: dict[str, int], seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        if await stream(session, url, key, prompt(rng, 96), args.flood_tokens) is None:
            counts["refused"] += 1
            await asyncio.sleep(0.2)
        else:
            counts["completed"] += 1


async def flood(url: str, key: str, args: argparse.Namespace, stop: EventType) -> dict[str, int]:
    counts = {"completed": 0, "refused": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(flood_client(session, url, key, args, stop, counts, i)
                               for i in range(args.flood_clients)))
    return counts


def flood_process(url: str, key: str, args: argparse.Namespace, stop: EventType, counts: Queue) -> None:
    """The flooding tenant in a process of its own, as on a machine of its own: its clients' work (streams,
    refusals) never delays the chat client's reading of its own responses, and at the lowest CPU priority, so
    on a machine with fewer cores than busy processes it takes no time the server's processes need."""
    os.nice(19)
    counts.put(asyncio.run(flood(url, key, args, stop)))


@contextlib.asynccontextmanager
async def flooding(url: str, key: str | None, args: argparse.Namespace,
                   target: Callable[..., None] = flood_process) -> AsyncIterator[dict[str, int]]:
    """While inside: ``key``'s flood runs (none without a key), ``target(url, key, args, stop, counts)`` in a
    process of its own; on leaving, its counts fill the dict yielded."""
    counts = {"completed": 0, "refused": 0}
    if key is None:
        yield counts
        return
    context = multiprocessing.get_context("spawn")
    stop, queue = context.Event(), context.Queue()
    flooder = context.Process(target=target, args=(url, key, args, stop, queue), daemon=True)
    flooder.start()
    await asyncio.sleep(5.0)  # the process starts and the flood fills the engine first
    try:
        yield counts
    finally:
        stop.set()
        counts.update(await asyncio.to_thread(queue.get))
        flooder.join()


async def phase(url: str, args: argparse.Namespace, flood_key: str | None, flood: str = "flood",
                target: Callable[..., None] = flood_process) -> dict:
    """The chat trace's TTFT while ``flood_key``'s ``--flood-clients`` run ``target`` (``flood`` names them)."""
    print(f"phase {flood_key or 'alone'}: {args.chat_requests} chat requests"
          + (f" under {args.flood_clients} {flood} clients" if flood_key else ""), flush=True)
    async with flooding(url, KEYS[flood_key] if flood_key else None, args, target) as flooded:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            start = time.perf_counter()
            ttfts = await chat_trace(session, url, args)
            elapsed = time.perf_counter() - start
    return {"chat_ttft": _summary(ttfts), "chat_completed": len(ttfts),
            "flood_completed_per_s": flooded["completed"] / elapsed, "flood_refused": flooded["refused"]}


async def run(url: str, args: argparse.Namespace) -> dict:
    await phase(url, args, None)  # warm-up: compiled paths, caches
    results = {name: await phase(url, args, key) for name, key in
               (("alone", None), ("flood", "flood"), ("limited", "limited"))}
    alone = results["alone"]["chat_ttft"]["p99_ms"]
    for name in ("flood", "limited"):
        results[name]["p99_vs_alone"] = results[name]["chat_ttft"]["p99_ms"] / alone
    return results


def main() -> None:
    args = parse_args()
    with start_stack(args) as stack:
        stack.wait_ready(180)
        results = asyncio.run(run(stack.url, args))
    report(results, args)


def report(results: dict, args: argparse.Namespace) -> None:
    """Each phase's line (with its ratios to the alone phase, where computed), and the JSON file if asked."""
    results["config"] = vars(args)
    for name, r in results.items():
        if name == "config":
            continue
        ttft = r["chat_ttft"]
        ratio = "".join(f", {what} {r[f'{what}_vs_alone']:.2f}x alone" for what in ("median", "p99")
                        if f"{what}_vs_alone" in r)
        print(f"{name:9s} chat TTFT mean {ttft['mean_ms']:.0f} ms, median {ttft['median_ms']:.0f} ms, "
              f"p99 {ttft['p99_ms']:.0f} ms{ratio}; flood {r['flood_completed_per_s']:.2f} req/s, "
              f"{r['flood_refused']} refused")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
