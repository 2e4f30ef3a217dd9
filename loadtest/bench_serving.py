"""Serving benchmark: the whole stack (gateway, Redis, worker) under load, against
the same engine run offline on the same trace, in the same run.

    python -m loadtest.bench_serving --json results/serving.json [--workload alpaca|sharegpt]
        [--num-requests 64] [--request-rate inf | R] [--max-concurrency C] [--model PATH]

Trace: loadtest.bench_offline's synthetic workloads (log-normal lengths with the
ShareGPT- / Alpaca-like means given there, random token ids, ``ignore_eos``, greedy).
Arrivals: Poisson at ``--request-rate`` requests/s (``inf``: all at once), optionally
capped at ``--max-concurrency`` requests in flight. Streaming completions; TTFT is the
first chunk carrying text or tokens, ITL the gaps between chunks, TPOT
(e2e - TTFT) / (output tokens - 1). Offline: ``LLMEngine`` stepped directly with the
same EngineConfig, from a dedicated thread like the worker's, before and after serving
(the better run counts: the machine may be shared). ``served / offline`` compares output-token throughput; it is only
a fair ratio when the served run is saturated (``--request-rate inf``).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.demo_model import ensure_demo_model
from loadtest import output_path
from loadtest.bench_offline import Request, make_workload
from service.flags import add_config_flags, config_argv, config_from_args
from service.local_stack import LocalStack

MODEL_NAME = "bench"


@dataclass(slots=True)
class RequestStats:
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    ok: bool = False


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["alpaca", "sharegpt"], default="alpaca")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson rate, requests/s")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight")
    p.add_argument("--json", help="write the results here")
    add_config_flags(p, [("engine", EngineConfig)])  # the worker's, for both runs; --seed also seeds the trace
    # One torch thread leaves cores for the gateway, Redis and this client; no prefix caching: the
    # trace's prompts are random, and both runs should do the same work.
    p.set_defaults(num_threads=1, num_device_blocks=4096, enable_prefix_caching=False)
    return p.parse_args()


def engine_config(args: argparse.Namespace, model: str) -> EngineConfig:
    return config_from_args(EngineConfig, args, model=model, show_progress=False)


def warm_up(requests: list[Request]) -> list[Request]:
    return [Request(r.prompt, 4) for r in requests[:4]]


def run_offline(config: EngineConfig, requests: list[Request], when: str) -> dict[str, float]:
    """Run before and after serving; the best counts, as the machine may be shared."""
    print(f"offline (LLMEngine directly), {when} serving ...", flush=True)
    engine = LLMEngine(config)
    # Stepped from a dedicated thread, as the worker steps it: torch's CPU thread pool
    # behaves differently from the main thread on a busy machine, and that is not serving overhead.
    with ThreadPoolExecutor(1) as thread:
        thread.submit(_drain, engine, warm_up(requests), "warm").result()
        start = time.perf_counter()
        tokens = thread.submit(_drain, engine, requests, "offline").result()
        elapsed = time.perf_counter() - start
    print(f"  {tokens / elapsed:.0f} output tok/s", flush=True)
    return {"duration_s": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "request_s": len(requests) / elapsed}


def _drain(engine: LLMEngine, requests: list[Request], tag: str) -> int:
    for i, r in enumerate(requests):
        engine.add_request(f"{tag}-{i}", r.prompt, SamplingParams(temperature=0.0, max_tokens=r.output_len,
                                                                  ignore_eos=True))
    tokens = 0
    while engine.has_unfinished_requests():
        tokens += sum(len(c.token_ids) for out in engine.step() for c in out.outputs)
    return tokens


def served_stack(model: str, config: EngineConfig, worker_argv: list[str] | None = None) -> LocalStack:
    """A private redis-server, one worker (with ``worker_argv`` too) and one gateway, as ``pagedserve serve``
    runs them."""
    stack = LocalStack()
    common = ["--served-model-name", MODEL_NAME, "--log-level", "WARNING"]
    stack.add_worker(common + config_argv(config) + (worker_argv or []))  # with its --model
    stack.add_gateway(common + ["--model", model, "--max-pending-requests", "100000"])
    return stack


async def run_client(url: str, requests: list[Request], rate: float, concurrency: int | None,
                     seed: int) -> tuple[list[RequestStats], float]:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency or len(requests))
    progress = _Progress(len(requests))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        tasks = []
        start = time.perf_counter()
        for r in requests:
            tasks.append(asyncio.create_task(_one(session, url, r, gate, progress)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        stats = await asyncio.gather(*tasks)
        return stats, time.perf_counter() - start


async def _one(session: aiohttp.ClientSession, url: str, r: Request, gate: asyncio.Semaphore,
               progress: _Progress) -> RequestStats:
    body = {"model": MODEL_NAME, "prompt": r.prompt, "max_tokens": r.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    stats = RequestStats()
    async with gate:
        start = last = time.perf_counter()
        async with session.post(f"{url}/v1/completions", json=body) as response:
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    stats.output_tokens = chunk["usage"]["completion_tokens"]
                elif chunk.get("choices"):
                    if stats.ttft == 0.0:
                        stats.ttft = now - start
                    else:
                        stats.itls.append(now - last)
                    last = now
        stats.e2e = time.perf_counter() - start
        stats.ok = response.status == 200 and stats.output_tokens == r.output_len
    progress.tick()
    return stats


class _Progress:
    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def tick(self) -> None:
        self.done += 1
        if self.done % max(1, self.total // 10) == 0 or self.done == self.total:
            print(f"  served {self.done}/{self.total}", flush=True)


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean_ms": 0.0, "median_ms": 0.0, "p99_ms": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"mean_ms": 1e3 * statistics.fmean(values), "median_ms": 1e3 * statistics.median(values),
            "p99_ms": 1e3 * p99}


def summarize(stats: list[RequestStats], duration: float) -> dict[str, object]:
    ok = [s for s in stats if s.ok]
    tokens = sum(s.output_tokens for s in ok)
    return {
        "completed": len(ok), "failed": len(stats) - len(ok), "duration_s": duration,
        "request_s": len(ok) / duration, "output_tok_s": tokens / duration, "output_tokens": tokens,
        "ttft": _summary([s.ttft for s in ok]),
        "tpot": _summary([(s.e2e - s.ttft) / (s.output_tokens - 1) for s in ok if s.output_tokens > 1]),
        "itl": _summary([x for s in ok for x in s.itls]),
        "e2e": _summary([s.e2e for s in ok]),
    }


def main() -> None:
    args = parse_args()
    model = args.model or ensure_demo_model()
    config = engine_config(args, model)
    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    requests = make_workload(args.workload, args.num_requests, vocab, args.seed)
    print(f"{args.workload}-like trace: {len(requests)} requests, mean input "
          f"{statistics.fmean(len(r.prompt) for r in requests):.0f}, mean output "
          f"{statistics.fmean(r.output_len for r in requests):.0f} tokens", flush=True)
    offline = [run_offline(config, requests, "before")]
    with served_stack(model, config) as stack:
        stack.wait_ready(timeout_s=300)
        asyncio.run(run_client(stack.url, warm_up(requests), float("inf"), None, args.seed))
        print(f"served (rate {args.request_rate} req/s, concurrency {args.max_concurrency or 'unbounded'}) ...",
              flush=True)
        stats, duration = asyncio.run(run_client(stack.url, requests, args.request_rate,
                                                 args.max_concurrency, args.seed))
    offline.append(run_offline(config, requests, "after"))
    served = summarize(stats, duration)
    best = max(offline, key=lambda o: o["output_tok_s"])
    result = {"workload": args.workload, "num_requests": len(requests), "request_rate": str(args.request_rate),
              "max_concurrency": args.max_concurrency, "num_threads": args.num_threads,
              "attention_backend": args.attention_backend, "offline_runs": offline, "offline": best,
              "served": served, "served_over_offline": served["output_tok_s"] / best["output_tok_s"]}
    report(result, args.json)


def report(result: dict, path: str | None) -> None:
    """Prints the result and, given a path, writes it there as JSON."""
    print(json.dumps(result, indent=2))
    if path:
        with open(output_path(path), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
