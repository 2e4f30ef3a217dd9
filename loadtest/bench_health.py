"""Does the gateway's event loop stay free under a flood of huge prompts?

    python -m loadtest.bench_health --json results/health.json [--clients 4] [--duration 10]
        [--prompt-bytes 1000000] [--probe-interval 0.02] [--model PATH]

Starts a stack (private redis-server, one worker, gateways) with ``LocalStack`` and probes
``GET /health`` on a fresh connection every ``--probe-interval`` seconds, timing each probe from
connect to the first byte of the answer (what a load balancer or a Kubernetes probe waits for).
Phases, ``--duration`` seconds each, in one run:

  idle        no other traffic: the baseline
  flood       ``--clients`` processes POST /v1/completions with a ``--prompt-bytes`` prompt, back to
              back, on the default gateway: the character cap refuses them before tokenizing
  tokenized   the same flood on a second gateway whose character cap lets them through
              (--max-chars-per-token 1024): each is tokenized on the tokenizer thread, then refused
              by the token count

Reports p50 / p99 / max time-to-first-byte of /health per phase and each flood phase's p99 over
the idle one (same run, same machine). The flood clients are processes, so they do not share
the probe's interpreter; on a machine with few cores they still compete with the gateway for CPU.
"""
from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import time
from collections import Counter
from urllib.parse import urlsplit

from engine.demo_model import ensure_demo_model
from loadtest.bench_serving import report
from service.local_stack import LocalStack

MODEL_NAME = "bench"
API_KEY = "bench-key"
_WORDS = ("paged", "attention", "block", "table", "kernel", "token", "cache", "serving", "batch", "the", "of")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=4, help="flooding client processes")
    p.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    p.add_argument("--prompt-bytes", type=int, default=1_000_000, help="prompt size of each flood request")
    p.add_argument("--probe-interval", type=float, default=0.02, help="seconds between /health probes")
    p.add_argument("--model", help="checkpoint folder (default: the demo model)")
    p.add_argument("--json", help="write the results here")
    return p.parse_args()


def make_stack(model: str) -> LocalStack:
    """One worker (idle: every flood request is refused) and two gateways: the default one and one whose
    character cap lets a 1 MB prompt through to the tokenizer."""
    stack = LocalStack(env={"PAGEDSERVE_API_KEY": API_KEY})
    common = ["--model", model, "--served-model-name", MODEL_NAME, "--log-level", "WARNING"]
    stack.add_worker([*common, "--attention-backend", "torch", "--num-threads", "1", "--num-device-blocks", "64"])
    stack.add_gateway(common)
    stack.add_gateway([*common, "--max-chars-per-token", "1024"])
    return stack


def prompt_text(size: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    length = 0
    while length < size:
        words.append(rng.choice(_WORDS))
        length += len(words[-1]) + 1
    return " ".join(words)[:size]


def probe_once(host: str, port: int) -> float:
    """Seconds from connect to the first byte of /health's answer; the answer must be a 200."""
    start = time.perf_counter()
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        first = sock.recv(1)
        ttfb = time.perf_counter() - start
        rest = b"".join(iter(lambda: sock.recv(65536), b""))
    if not (first + rest).startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"/health answered {(first + rest)[:40]!r}")
    return ttfb


def probe(url: str, duration: float, interval: float) -> list[float]:
    parts = urlsplit(url)
    samples = []
    deadline = time.monotonic() + duration
    while time.monotonic() < deadline:
        samples.append(probe_once(parts.hostname, parts.port))
        time.sleep(interval)
    return samples


def flood_client(url: str, body: bytes, stop: mp.Event, results: mp.Queue) -> None:
    """POSTs ``body`` back to back on one keep-alive connection until ``stop``; reports the statuses."""
    parts = urlsplit(url)
    statuses: Counter[int] = Counter()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    while not stop.is_set():
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        statuses[response.status] += 1
    conn.close()
    results.put(dict(statuses))


def run_phase(name: str, probe_url: str, flood_url: str | None, body: bytes, args: argparse.Namespace) -> dict:
    print(f"phase {name}: {args.duration:.0f}s of /health probes"
          + (f" while {args.clients} clients flood {flood_url}" if flood_url else ", no other traffic"), flush=True)
    ctx = mp.get_context("fork")
    stop, results = ctx.Event(), ctx.Queue()
    clients = [ctx.Process(target=flood_client, args=(flood_url, body, stop, results)) for _ in range(args.clients)
               if flood_url]
    for c in clients:
        c.start()
    start = time.perf_counter()
    samples = probe(probe_url, args.duration, args.probe_interval)
    stop.set()
    statuses: Counter[int] = Counter()
    for _ in clients:
        statuses.update(results.get(timeout=300))
    elapsed = time.perf_counter() - start
    for c in clients:
        c.join()
    result = {"health_ttfb_ms": summary(samples), "probes": len(samples)}
    if clients:
        done = sum(statuses.values())
        result["flood"] = {"requests": done, "requests_s": done / elapsed, "statuses": dict(statuses),
                           "MB_s": done * len(body) / elapsed / 1e6}
    print(f"  /health ttfb ms: {result['health_ttfb_ms']}" + (f"; flood: {result['flood']}" if clients else ""),
          flush=True)
    return result


def summary(samples: list[float]) -> dict[str, float]:
    ms = sorted(s * 1000 for s in samples)
    return {"p50": round(_quantile(ms, 0.5), 3), "p99": round(_quantile(ms, 0.99), 3), "max": round(ms[-1], 3),
            "mean": round(statistics.fmean(ms), 3)}


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    args = parse_args()
    model = args.model or ensure_demo_model()
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt_text(args.prompt_bytes), "max_tokens": 1}).encode()
    print(f"flood body: {len(body)} bytes; starting the stack ...", flush=True)
    with make_stack(model) as stack:
        stack.wait_ready(timeout_s=300)
        capped, uncapped = stack.urls
        phases = {"idle": run_phase("idle", capped, None, body, args),
                  "flood": run_phase("flood", capped, capped, body, args),
                  "tokenized": run_phase("tokenized", uncapped, uncapped, body, args)}
    idle_p99 = phases["idle"]["health_ttfb_ms"]["p99"]
    result = {"clients": args.clients, "duration_s": args.duration, "prompt_bytes": args.prompt_bytes,
              "body_bytes": len(body), "probe_interval_s": args.probe_interval, "cpus": os.cpu_count(),
              "phases": phases,
              "p99_over_idle": {k: round(v["health_ttfb_ms"]["p99"] / idle_p99, 2) for k, v in phases.items()
                                if k != "idle"}}
    report(result, args.json)


if __name__ == "__main__":
    main()
