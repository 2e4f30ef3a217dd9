"""The reply path's cost and speed, against a real redis-server (issue 11, point 7).

  python -m loadtest.bench_broker --streams 256 --gateways 2 --rates 10000,20000,30000 --json out.json

Each offered rate is one run of fresh processes: a private redis-server, one worker process (the real
``Worker`` and ``RedisWorkerBroker`` driving a synthetic engine that emits one token per request per step, at
a fixed step period: offered tok/s = streams / step time), N gateway processes and one SSE client process
per gateway. Clients keep their share of the streams open: each request asks for ``--tokens-per-request``
tokens and is replaced by a new one when it ends. Reported per rate, over the measuring window only:

- worker CPU µs/token: the worker process's CPU time, less the synthetic engine's own step CPU (its thread
  time), per token the engine emitted; the total with the engine is reported too
- gateway CPU µs/token: all gateway processes' CPU time per token the clients received
- Redis CPU µs/token: INFO CPU (used_cpu_user + used_cpu_sys) per token received
- served tok/s and the p50/p99 inter-token delay the clients saw; the highest rate served with a p99
  under two step times is the result

The gateway component is pluggable (``--gateway``, the ``GATEWAYS`` table), its CPU time read from /proc:
``pagedserve`` runs ``python -m service.cli gateway`` processes (the v5 gateway: POST /v1/completions, SSE);
``reader`` is a minimal v5 reader, labelled as such in the output: one blocking XREAD over its out stream,
``decode_batch``, dedup by index, routing to per-request asyncio queues, SSE formatting to lean HTTP/1.0
clients; submission is the StreamRecord SET NX + XADD pipeline; it beats as a gateway. The reader shows what
the wire itself costs a gateway.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

if TYPE_CHECKING:  # the engine imports torch: only the worker process needs them, at run time
    from engine.core.kv_snapshot import KVSnapshot
    from engine.outputs import RequestOutput, ResumeState
    from engine.sampling_params import SamplingParams
    from engine.stats import EngineStats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "bench"
_STARTUP_S = 10.0  # python + torch imports of every child on a busy machine, before the warmup starts


# ---- the worker process: the real Worker and RedisWorkerBroker around a synthetic engine ----

class SyntheticEngine:
    """One token per running request per step, steps at a fixed period (a GPU's step time). The worker's
    ``Engine`` protocol in full (tests/service/test_engine_protocol.py checks it): no KV blocks, no prefix cache."""

    max_model_len = 1 << 20

    def __init__(self, step_s: float, max_seqs: int) -> None:
        self.step_s = step_s
        self.max_seqs = max_seqs
        self.requests: dict[str, list[int]] = {}  # request id -> [tokens left, tokens emitted]
        self.tokens = 0
        self.step_cpu_s = 0.0  # this engine's own CPU time, on the step thread
        self._next_step = time.monotonic()

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    cache_salt: str | None = None, resume: ResumeState | None = None, priority: int = 0,
                    images: list | None = None) -> None:
        self.requests[request_id] = [params.max_tokens, 0]

    def abort_request(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.requests.pop(request_id, None)

    def step(self) -> list[RequestOutput]:
        from engine.outputs import CompletionOutput, RequestOutput
        self._next_step += self.step_s
        delay = self._next_step - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        else:
            self._next_step = time.monotonic()  # behind: the next step starts a full period from now
        started = time.thread_time()
        outputs = []
        for request_id, state in list(self.requests.items()):
            state[0] -= 1
            state[1] += 1
            done = state[0] == 0
            outputs.append(RequestOutput(request_id, [], [CompletionOutput(0, [65 + state[1] % 26],  # letters
                                                                           finish_reason="length" if done else None)],
                                         finished=done))
            if done:
                del self.requests[request_id]
        self.tokens += len(outputs)
        self.step_cpu_s += time.thread_time() - started
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_capacity(self) -> bool:
        return len(self.requests) < self.max_seqs

    def prefix_cache_summary(self) -> tuple[int, set[bytes]]:
        return 0, set()  # no prefix caching: nothing to route by

    def stats(self) -> EngineStats:
        from engine.stats import EngineStats
        return EngineStats(**{f.name: 0 for f in fields(EngineStats)})

    def kv_snapshot(self) -> KVSnapshot:
        """Its requests, all running, holding no blocks (taken only while a dashboard watches)."""
        from engine.core.kv_snapshot import KVSnapshot, PoolSnapshot, SnapshotRequest
        requests = [SnapshotRequest(request_id, "running", 1, []) for request_id in self.requests]
        # No pools: the block size (the engine's default) labels nothing.
        return KVSnapshot(time.time(), 16, PoolSnapshot.empty(0), PoolSnapshot.empty(0), requests, self.stats())


async def run_worker(args: argparse.Namespace) -> dict:
    from service.config import RedisConfig, WorkerConfig
    from service.redis_worker import RedisWorkerBroker
    from service.worker import Worker, tune_gc

    tune_gc()  # as the pagedserve worker does
    redis = RedisConfig(url=args.redis_url, prefix=args.prefix)
    config = WorkerConfig(redis=redis, engine_id="bench-worker", max_pull=64, drain_timeout_s=0,
                          step_lane=args.step_lane)
    engine = SyntheticEngine(args.step_ms / 1000, max_seqs=args.streams * 2)
    broker = RedisWorkerBroker(redis, config.engine_id, MODEL, config.reply_ttl_s, config.heartbeat_ttl_s)
    worker = Worker(config, engine, MODEL, broker)
    task = asyncio.create_task(worker.run())

    def sample() -> tuple[float, float, int]:
        return time.process_time(), engine.step_cpu_s, engine.tokens

    (cpu0, step0, tokens0), (cpu1, step1, tokens1) = await window(args, sample)
    worker.stop()
    await task
    return {"cpu_s": cpu1 - cpu0, "engine_cpu_s": step1 - step0, "tokens": tokens1 - tokens0}


async def window(args: argparse.Namespace, sample: Callable[[], tuple]) -> tuple[tuple, tuple]:
    """``sample()`` at the measuring window's start and end (wall clock, the same for every process)."""
    await asyncio.sleep(max(0.0, args.t0 - time.time()))
    first = sample()
    await asyncio.sleep(max(0.0, args.t1 - time.time()))
    return first, sample()


# ---- the gateway component: a minimal v5 reader ----

@dataclass(slots=True)
class _Sub:
    queue: asyncio.Queue
    expected: int = 0  # the next event index


class MinimalReader:
    """Submit (StreamRecord SET NX + XADD), one blocking XREAD over the own out stream, decode_batch,
    dedup by index, route to per-request queues, format SSE; beat as a gateway."""

    def __init__(self, redis_url: str, prefix: str, gateway_id: str) -> None:
        from service.broker import connect
        from service.config import RedisConfig
        from service.redis_keys import Keys
        config = RedisConfig(url=redis_url, prefix=prefix, block_ms=1000)
        self.client, self.blocking = connect(config), connect(config, blocking=True)
        self.keys, self.gateway_id = Keys(prefix), gateway_id
        self.subs: dict[str, _Sub] = {}

    async def submit(self, max_tokens: int) -> tuple[str, _Sub]:
        from engine.sampling_params import SamplingParams
        from service.messages import RequestMsg, StreamRecord, encode, params_to_wire
        request_id = f"cmpl-{uuid.uuid4().hex}"
        now = time.time()
        record = StreamRecord(request_id, self.gateway_id, b"{}", [1, 2, 3], int(now), int(now * 1000), "bench")
        msg = RequestMsg(request_id, [1, 2, 3], params_to_wire(SamplingParams(max_tokens=max_tokens)),
                         self.gateway_id, now, MODEL)
        sub = self.subs[request_id] = _Sub(asyncio.Queue())
        pipe = self.client.pipeline(transaction=False)
        pipe.set(self.keys.request(request_id), encode(record), nx=True, ex=24 * 3600)
        pipe.xadd(self.keys.requests(MODEL), {"p": encode(msg)})
        await pipe.execute()
        return request_id, sub

    async def read(self) -> None:
        from service.messages import CONTROL_INDEX, decode_batch
        out, last = self.keys.out(self.gateway_id), "$"
        while True:
            response = await self.blocking.xread({out: last}, block=1000)
            for _, entries in response or []:
                for entry_id, entry in entries:
                    last = entry_id
                    for request_id, event in decode_batch(entry[b"b"]).events:
                        sub = self.subs.get(request_id)
                        if sub is None or event.index == CONTROL_INDEX or event.index < sub.expected:
                            continue
                        sub.expected += 1
                        sub.queue.put_nowait(event)

    async def beat(self) -> None:
        from service.messages import GatewayBeat, encode
        while True:
            await self.client.set(self.keys.gateway(self.gateway_id), encode(GatewayBeat(self.gateway_id)), px=5000)
            await self.client.sadd(self.keys.gateways, self.gateway_id)
            await asyncio.sleep(0.5)

    async def stream(self, request):
        from aiohttp import web
        request_id, sub = await self.submit(int(request.query["max_tokens"]))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        k = 0
        try:
            while True:
                event = await sub.queue.get()
                for choice in event.choices:
                    k += 1
                    chunk = {"id": request_id, "object": "text_completion", "created": 0, "model": MODEL,
                             "choices": [{"index": choice.index, "text": " ".join(map(str, choice.token_ids)),
                                          "finish_reason": choice.finish_reason}]}
                    await response.write(f"id: {request_id}:{k}\ndata: {json.dumps(chunk)}\n\n".encode())
                if event.finished:
                    await response.write(b"data: [DONE]\n\n")
                    return response
        finally:
            self.subs.pop(request_id, None)


async def run_reader(args: argparse.Namespace) -> None:
    """Serves until the bench stops it (its CPU time is read from /proc, as a pagedserve gateway's)."""
    from aiohttp import web
    reader = MinimalReader(args.redis_url, args.prefix, args.gateway_id)
    app = web.Application()
    app.router.add_get("/stream", reader.stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port).start()
    await asyncio.gather(reader.read(), reader.beat())


@dataclass(frozen=True, slots=True)
class GatewayKind:
    label: str
    argv: Callable[[argparse.Namespace, int, int], list[str]]  # (args, index, port) -> the process's argv
    request: Callable[[int], bytes]  # max_tokens -> one streaming request, HTTP/1.0


def _reader_argv(args: argparse.Namespace, index: int, port: int) -> list[str]:
    return ["-m", "loadtest.bench_broker", "--role", "reader", "--redis-url", args.redis_url, "--prefix",
            args.prefix, "--port", str(port), "--gateway-id", f"gw{index}"]


def _pagedserve_argv(args: argparse.Namespace, index: int, port: int) -> list[str]:
    return ["-m", "service.cli", "gateway", "--redis-url", args.redis_url, "--redis-prefix", args.prefix,
            "--port", str(port), "--served-model-name", MODEL, "--max-pending-requests", str(4 * args.streams),
            "--log-level", "WARNING"]


def _completion_request(max_tokens: int) -> bytes:
    body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    return (f"POST /v1/completions HTTP/1.0\r\nHost: bench\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


GATEWAYS = {
    "reader": GatewayKind("minimal v5 reader (XREAD + decode_batch + route + SSE), not the pagedserve gateway",
                          _reader_argv, lambda n: f"GET /stream?max_tokens={n} HTTP/1.0\r\nHost: bench\r\n\r\n".encode()),
    "pagedserve": GatewayKind("pagedserve gateway processes (python -m service.cli gateway, demo tokenizer)",
                              _pagedserve_argv, _completion_request),
}


# ---- lean SSE clients ----

@dataclass(slots=True)
class ClientStats:
    tokens: int = 0  # received inside the window
    gaps_ms: list[float] = field(default_factory=list)  # between consecutive tokens of a request, in the window
    requests: int = 0


async def one_stream(port: int, max_tokens: int, args: argparse.Namespace, stats: ClientStats) -> None:
    """Requests one after the other on a fresh connection each (HTTP/1.0: no chunking, closed at the end)."""
    while time.time() < args.t1:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except ConnectionRefusedError:  # the gateway is still starting
            await asyncio.sleep(0.2)
            continue
        writer.write(GATEWAYS[args.gateway].request(max_tokens))
        try:
            if b" 200 " not in await reader.readline():  # e.g. 503 before the engine's first beat
                await asyncio.sleep(0.2)
                continue
            await read_events(reader, args, stats)
        except ConnectionError:  # the gateway process ended with the window
            return
        finally:
            writer.close()
        stats.requests += 1


async def read_events(reader: asyncio.StreamReader, args: argparse.Namespace, stats: ClientStats) -> None:
    previous = None
    while line := await reader.readline():
        if not line.startswith(b"data: {"):
            continue
        now = time.time()
        if args.t0 <= now <= args.t1:
            stats.tokens += 1
            if previous is not None:
                stats.gaps_ms.append((now - previous) * 1000)
        previous = now


async def run_clients(args: argparse.Namespace) -> dict:
    stats = ClientStats()
    streams = [one_stream(args.port, args.tokens_per_request, args, stats) for _ in range(args.streams)]
    await asyncio.wait([asyncio.create_task(s) for s in streams], timeout=max(0.0, args.t1 - time.time()) + 1)
    return {"tokens": stats.tokens, "gaps_ms": stats.gaps_ms, "requests": stats.requests}


ROLES = {"worker": run_worker, "reader": run_reader, "clients": run_clients}


def process_cpu_s(pid: int) -> float:
    """A process's user + system CPU time (Linux /proc), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # from field 3 on: utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def child(args: argparse.Namespace) -> None:
    result = await ROLES[args.role](args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    # A bench child needs no orderly teardown: cancelling a blocking redis-py read can hang it.
    os._exit(0)


def child_main(args: argparse.Namespace) -> None:
    import uvloop
    uvloop.run(child(args))


# ---- the orchestrator ----

def spawn(role: str, out: str, common: list[str], *extra: str) -> subprocess.Popen:
    return start([sys.executable, "-m", "loadtest.bench_broker", "--role", role, "--out", out, *common, *extra])


def start(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})


async def redis_cpu(url: str) -> float:
    client = aioredis.Redis.from_url(url)
    info = await client.info("cpu")
    await client.aclose()
    return info["used_cpu_user"] + info["used_cpu_sys"]


def run_rate(args: argparse.Namespace, rate: float) -> dict:
    from service.local_stack import LocalStack, free_port
    step_ms = args.streams * 1000 / rate
    with LocalStack() as stack, tempfile.TemporaryDirectory() as tmp:
        t0 = time.time() + _STARTUP_S + args.warmup_s
        args.redis_url, args.prefix = stack.redis_url, f"b{uuid.uuid4().hex[:6]}"
        common = ["--redis-url", args.redis_url, "--prefix", args.prefix, "--t0", str(t0),
                  "--t1", str(t0 + args.measure_s), "--streams", str(args.streams), "--gateway", args.gateway,
                  "--tokens-per-request", str(args.tokens_per_request), "--step-ms", str(step_ms)]
        ports = [free_port() for _ in range(args.gateways)]
        shares = [args.streams // args.gateways + (i < args.streams % args.gateways) for i in range(args.gateways)]
        gateways = [start([sys.executable, *GATEWAYS[args.gateway].argv(args, i, port)]) for i, port in enumerate(ports)]
        lane = [] if args.step_lane else ["--no-step-lane"]
        children = {"worker": spawn("worker", f"{tmp}/worker.json", common, *lane)}
        for i, (port, share) in enumerate(zip(ports, shares)):
            children[f"clients{i}"] = spawn("clients", f"{tmp}/clients{i}.json", common,  # the last --streams wins
                                            "--streams", str(share), "--port", str(port))
        try:
            redis_cpu_s, gateway_cpu_s = asyncio.run(measure(stack.redis_url, gateways, t0, t0 + args.measure_s))
            results = collect(children, tmp, t0 + args.measure_s)
        finally:
            for process in gateways:
                process.kill()
                process.wait()
    return summarize(rate, step_ms, redis_cpu_s, gateway_cpu_s, results, args)


async def measure(url: str, gateways: list[subprocess.Popen], t0: float, t1: float) -> tuple[float, float]:
    """Redis's and the gateway processes' CPU seconds in the window."""
    def sample() -> float:
        if any(p.poll() is not None for p in gateways):
            raise RuntimeError("a gateway process ended early")
        return sum(process_cpu_s(p.pid) for p in gateways)

    await asyncio.sleep(max(0.0, t0 - time.time()))
    redis0, gateways0 = await redis_cpu(url), sample()
    await asyncio.sleep(max(0.0, t1 - time.time()))
    return await redis_cpu(url) - redis0, sample() - gateways0


def collect(children: dict[str, subprocess.Popen], tmp: str, t1: float) -> dict[str, dict]:
    results = {}
    for name, process in children.items():
        try:
            process.wait(timeout=max(1.0, t1 - time.time()) + 15)
        except subprocess.TimeoutExpired:
            process.kill()
            raise RuntimeError(f"bench child {name} did not finish") from None
        with open(f"{tmp}/{name}.json") as f:
            results[name] = json.load(f)
    return results


def summarize(rate: float, step_ms: float, redis_cpu_s: float, gateway_cpu: float, results: dict[str, dict],
              args: argparse.Namespace) -> dict:
    worker = results["worker"]
    clients = [r for name, r in results.items() if name.startswith("clients")]
    received = sum(c["tokens"] for c in clients)
    gaps = sorted(g for c in clients for g in c["gaps_ms"])
    per_token = 1e6 / max(received, 1)
    return {
        "offered_tok_s": rate, "step_ms": round(step_ms, 3), "served_tok_s": round(received / args.measure_s),
        "served_over_offered": round(received / args.measure_s / rate, 3),
        "emitted_tok_s": round(worker["tokens"] / args.measure_s),
        "worker_cpu_us_per_token": round((worker["cpu_s"] - worker["engine_cpu_s"]) * 1e6 / max(worker["tokens"], 1), 2),
        "worker_cpu_us_per_token_with_engine": round(worker["cpu_s"] * 1e6 / max(worker["tokens"], 1), 2),
        "gateway_cpu_us_per_token": round(gateway_cpu * per_token, 2),
        "redis_cpu_us_per_token": round(redis_cpu_s * per_token, 2),
        "p50_inter_token_ms": round(statistics.median(gaps), 2) if gaps else None,
        "p99_inter_token_ms": round(gaps[int(len(gaps) * 0.99)], 2) if gaps else None,
        "requests_completed": sum(c["requests"] for c in clients),
    }


def orchestrate(args: argparse.Namespace) -> None:
    rates = [float(r) for r in args.rates.split(",")]
    points = []
    for rate in rates:
        print(f"offered {rate:.0f} tok/s ({args.streams} streams, {args.gateways} gateways: {args.gateway}) ...",
              flush=True)
        points.append(run_rate(args, rate))
        print("  " + json.dumps(points[-1]), flush=True)
    good = [p for p in points if p["p99_inter_token_ms"] is not None and p["p99_inter_token_ms"] < 2 * p["step_ms"]]
    report = {"gateway": GATEWAYS[args.gateway].label, "gateways": args.gateways, "streams": args.streams,
              "tokens_per_request": args.tokens_per_request, "measure_s": args.measure_s, "cpus": os.cpu_count(),
              "points": points, "max_served_tok_s_p99_under_2_steps": max((p["served_tok_s"] for p in good), default=0)}
    print(json.dumps({k: v for k, v in report.items() if k != "points"}), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256, help="concurrent streams (engine requests)")
    parser.add_argument("--gateways", type=int, default=2, help="gateway processes (each with its client process)")
    parser.add_argument("--gateway", choices=sorted(GATEWAYS), default="reader", help="the gateway component")
    parser.add_argument("--rates", default="10000,20000,30000,40000", help="offered tok/s, comma-separated")
    parser.add_argument("--step-ms", type=float, help="one step time instead of --rates (offered = streams/step)")
    parser.add_argument("--tokens-per-request", type=int, default=200)
    parser.add_argument("--no-step-lane", dest="step_lane", action="store_false",
                        help="the worker's --no-step-lane (the asyncio reply path)")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--measure-s", type=float, default=5.0)
    parser.add_argument("--json", help="write the report here")
    child = parser.add_argument_group("child processes (internal)")
    for name in ("--role", "--out", "--redis-url", "--prefix", "--gateway-id"):
        child.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--t0", "--t1"):
        child.add_argument(name, type=float, help=argparse.SUPPRESS)
    child.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.step_ms is not None and not args.role:
        args.rates = str(args.streams * 1000 / args.step_ms)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role:
        child_main(args)
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
