"""Does the gateway cut off slow clients (slowloris: headers, or a body, trickled in)?

    python -m loadtest.bench_slow_clients [--clients 50] [--interval 1] [--seconds 40] [--json FILE]
        [--model PATH] [gateway flags, e.g. --header-timeout 10 --body-timeout 30]

Starts a private redis-server and one ``pagedserve gateway`` process (``LocalStack``; no worker:
/health and /tokenize need none), with any flags not listed above passed to it. Opens
``--clients`` connections that send a request's headers one byte every ``--interval`` seconds,
and as many that send a /tokenize request's headers at once and its body one byte at a time.
Reports how many of each the gateway has closed after 5, 12, 35 and ``--seconds`` seconds, when
each was cut (seconds from its first byte) and how each was answered. The defaults
(docs/security.md, "Connections and timeouts") close the first kind at 10 s and answer the second
with 408 at 30 s; before them, none of either was closed.
"""
from __future__ import annotations

import argparse
import asyncio
import time
import urllib.request
from collections import Counter
from urllib.parse import urlsplit

from engine.demo_model import ensure_demo_model
from loadtest.bench_serving import report
from service.local_stack import LocalStack

_BODY = b'{"prompt": "' + b"slow " * 20 + b'"}'
_HEADERS = b"GET /health HTTP/1.1\r\nHost: bench\r\nX-Pad: " + b"a" * 100 + b"\r\n\r\n"
_POST = b"POST /tokenize HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"


def parse_args() -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", type=int, default=50, help="slow connections of each kind")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between two bytes of a slow client")
    p.add_argument("--seconds", type=float, default=40.0, help="how long the run lasts")
    p.add_argument("--model", help="checkpoint folder (default: the demo model)")
    p.add_argument("--json", help="write the results here")
    return p.parse_known_args()


async def slow_client(host: str, port: int, head: bytes, trickled: bytes, interval: float,
                      cuts: list[tuple[float, bytes]]) -> None:
    """Sends ``head`` at once, then ``trickled`` a byte at a time; records (seconds from the first byte
    until the server closed the connection, the first bytes of its answer)."""
    reader, writer = await asyncio.open_connection(host, port)
    start = time.monotonic()
    writer.write(head)
    closed = asyncio.create_task(reader.read())
    for byte in trickled:
        if closed.done():
            break
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except ConnectionError:
            break
        await asyncio.sleep(interval)
    try:
        answer = await closed
    except ConnectionError:
        answer = b""
    cuts.append((time.monotonic() - start, answer[:12]))
    writer.close()


def summary(cuts: list[tuple[float, bytes]]) -> dict:
    seconds = sorted(s for s, _ in cuts)
    return {"closed": len(cuts), "first_cut_s": round(seconds[0], 2) if seconds else None,
            "last_cut_s": round(seconds[-1], 2) if seconds else None,
            "answers": dict(Counter(answer.decode("latin-1") or "(none)" for _, answer in cuts))}


async def run(url: str, args: argparse.Namespace) -> dict:
    parts = urlsplit(url)
    headers_cut: list[tuple[float, bytes]] = []
    bodies_cut: list[tuple[float, bytes]] = []
    clients = [slow_client(parts.hostname, parts.port, b"", _HEADERS, args.interval, headers_cut)
               for _ in range(args.clients)]
    clients += [slow_client(parts.hostname, parts.port, _POST % len(_BODY), _BODY, args.interval, bodies_cut)
                for _ in range(args.clients)]
    tasks = [asyncio.create_task(c) for c in clients]
    start, counts = time.monotonic(), {}
    for at in sorted({5.0, 12.0, 35.0, args.seconds}):
        if at <= args.seconds:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
            counts[f"{at:g}s"] = {"slow_headers_closed": len(headers_cut), "slow_bodies_closed": len(bodies_cut)}
            print(f"after {at:g} s: slow headers closed {len(headers_cut)}/{args.clients}, "
                  f"slow bodies closed {len(bodies_cut)}/{args.clients}", flush=True)
    for task in tasks:
        task.cancel()
    return {"clients": args.clients, "interval_s": args.interval, "closed_by_time": counts,
            "slow_headers": summary(headers_cut), "slow_bodies": summary(bodies_cut)}


def wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    """Until /health answers (there is no engine: /ready never would)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def main() -> None:
    args, gateway_flags = parse_args()
    stack = LocalStack()
    stack.add_gateway(["--model", args.model or ensure_demo_model(), "--log-level", "WARNING", *gateway_flags])
    with stack:
        wait_healthy(stack.url)
        result = asyncio.run(run(stack.url, args))
    report(result | {"gateway_flags": gateway_flags}, args.json)


if __name__ == "__main__":
    main()
