"""Abuse benchmark: one API key floods the gateway's tokenizer; another key's time to first token, in one run.

    python -m loadtest.bench_abuse [--json FILE] [--chat-requests 100] [--chat-rate 4] [--flood-clients 4]

One stack (redis-server, one worker, one gateway, the demo model: context 2048 tokens, so the gateway takes
at most 2048 x 64 characters of text per request) with two keys. Three phases, each sending the same chat
trace from the ``chat`` key (Poisson arrivals, short prompts, streamed) and measuring its TTFT:

1. ``alone``: the chat key by itself, the baseline;
2. ``tokenize``: ``--flood-clients`` clients of the ``flood`` key each posting ``/tokenize`` with the longest
   prompt the gateway accepts, back to back (before the caps: 1 MB prompts, 1.1 s of tokenizer each);
3. ``messages``: the same clients posting chat requests of as many empty messages as the cap allows (before
   it: 31,755 of them in under 1 MiB, 889k tokens to render and tokenize).

The gateway's tokenizer threads take the tenants in turn (``service.fair_pool``), so the chat key waits for
at most one flood job per thread. The flood runs in a process of its own at the lowest CPU priority (a tenant
on another machine), as in ``bench_fairness``. Reported: the chat's TTFT (mean, median, p99) per phase, each
flooded phase's median and p99 over the alone ones, and the flood's jobs per second.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as EventType

import aiohttp

from loadtest.bench_fairness import MODEL_NAME, phase, report, start_stack

CONTEXT = 2048  # the demo model's
CHARS_PER_TOKEN = 64  # GatewayConfig.max_chars_per_token's default
CHARS_PER_MESSAGE = 32  # what ChatML adds around an empty message, rounded up: the flood stays under the cap


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chat-requests", type=int, default=100)
    p.add_argument("--chat-rate", type=float, default=4.0, help="chat requests per second (Poisson)")
    p.add_argument("--chat-tokens", type=int, default=8, help="max_tokens of a chat request")
    p.add_argument("--flood-clients", type=int, default=4)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    return p.parse_args()


def flood_body(kind: str) -> tuple[str, dict]:
    """The route and body of one flood job: the most work the gateway accepts for one request."""
    if kind == "tokenize":
        rng = random.Random(0)
        text = " ".join(rng.choice(["paged", "block", "cache", "tenant"]) for _ in range(CONTEXT * CHARS_PER_TOKEN))
        return "/tokenize", {"model": MODEL_NAME, "prompt": text[:CONTEXT * CHARS_PER_TOKEN - 1]}
    messages = [{"role": "user", "content": ""}] * (CONTEXT * CHARS_PER_TOKEN // CHARS_PER_MESSAGE - 1)
    return "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages, "max_tokens": 1}


async def flood_client(session: aiohttp.ClientSession, url: str, key: str, kind: str, stop: EventType,
                       counts: dict[str, int]) -> None:
    route, body = flood_body(kind)
    payload = json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    while not stop.is_set():
        async with session.post(f"{url}{route}", data=payload, headers=headers) as response:
            await response.read()  # 200, a 400 for a prompt the template made too long, or a 429: all cost work
            counts["refused" if response.status == 429 else "completed"] += 1
            if response.status == 429:
                await asyncio.sleep(0.05)


async def flood(url: str, key: str, kind: str, clients: int, stop: EventType) -> dict[str, int]:
    counts = {"completed": 0, "refused": 0}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await asyncio.gather(*(flood_client(session, url, key, kind, stop, counts) for _ in range(clients)))
    return counts


def flood_process(url: str, key: str, args: argparse.Namespace, stop: EventType, counts: Queue) -> None:
    os.nice(19)  # a tenant on another machine: no CPU time the server needs
    counts.put(asyncio.run(flood(url, key, args.kind, args.flood_clients, stop)))


async def run(url: str, args: argparse.Namespace) -> dict:
    await phase(url, args, None)  # warm-up: compiled paths, caches
    results = {"alone": await phase(url, args, None)}
    for kind in ("tokenize", "messages"):
        args.kind = kind  # what flood_process sends
        results[kind] = await phase(url, args, "flood", f"{kind} flood", flood_process)
    alone = results["alone"]["chat_ttft"]
    for name in ("tokenize", "messages"):
        ttft = results[name]["chat_ttft"]
        results[name]["median_vs_alone"] = ttft["median_ms"] / alone["median_ms"]
        results[name]["p99_vs_alone"] = ttft["p99_ms"] / alone["p99_ms"]
    return results


def main() -> None:
    args = parse_args()
    args.flood_policy = ""  # no policy: the flood is limited by the tokenizer's turns alone
    with start_stack(args) as stack:
        stack.wait_ready(180)
        results = asyncio.run(run(stack.url, args))
    report(results, args)


if __name__ == "__main__":
    main()
