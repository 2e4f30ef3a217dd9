"""Chaos: bounded streaming load while workers and Redis are killed and restarted at random.

    python -m loadtest.chaos --minutes M --json FILE [--png FILE] [--seed 0] [--clients 6]
        [--workers 2] [--gateways 1] [--max-tokens 120] [--mean-fault-s 6] [--no-redis-faults] [--model PATH]
        [--hostile 0]

Starts a stack on loopback (private redis-server, ``--workers`` workers with short heartbeats,
``--gateways`` gateways, the demo model unless ``--model``), computes each prompt's undisturbed greedy
text once, then runs ``--clients`` concurrent greedy streaming clients for ``--minutes`` while a seeded
schedule (mean ``--mean-fault-s`` between faults) SIGKILLs a worker, SIGTERMs one (a drain), SIGSTOPs one
(a hung engine holding routed requests, continued after the outage), makes one's prefix summary stale (it
claims another engine's cached blocks, so requests are routed where their prefix is not), or SIGKILLs
Redis, each restarted after a short random outage. The prompts recur, so most requests are routed to the
engine caching them: a killed or stopped engine holds routed requests, in its stream and in flight.

Reports requests sent, completed, failed (by reason; ``refused``: of those, the ones answered with
an HTTP error before streaming, e.g. 503 while no engine or no Redis is up), resumed (completed
requests that were in flight across a worker fault: the client cannot see an owner change, so this
counts the requests a resume may have carried, an upper bound), hung (no end within the request
deadline), and the tokens duplicated and lost: each completed text is diffed with its undisturbed
one (a failed request's partial text with the undisturbed prefix), counted in characters of text
(the demo model's answers are ASCII, a few characters per token). A Redis restart loses the
queue and every record (no persistence); workers and gateways write back what they hold, so requests in
flight complete, except one whose engine dies before its first checkpoint after the restart (an error,
never a hang or wrong text). New requests sent before any engine beat again are refused with a 503.
``--hostile N`` adds N clients of another API key beside the load: bad bodies (each a 4xx), resumes of the
load's live streams (each a 404 that must leave the stream untouched: its text is judged as usual), and
/tokenize floods; their answers are counted by status, and any 5xx but a 503 while Redis is down fails the run.
``--png`` draws a timeline (completions and failures per second, the faults as lines).
"""
from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import random
import re
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import aiohttp

from engine.config import EngineConfig
from engine.demo_model import ensure_demo_model
from loadtest import output_path
from loadtest.bench_serving import report
from loadtest.stream_client import Outcome, completion_body, sse_stream
from service.flags import config_argv
from service.local_stack import Child, LocalStack

MODEL_NAME = "chaos"
API_KEY = "chaos-key"
HOSTILE_KEY = "chaos-hostile-key"  # another tenant: may not touch the load's streams
AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONE = "\\udcff"  # a lone surrogate as a JSON escape
# The hostile tenant's bad bodies (raw JSON text): each is the client's mistake, so a 4xx, never a 5xx.
BAD_BODIES = ('{"model": "chaos", "prompt": "x", "cache_salt": "' + LONE + '"}',
              '{"model": "chaos", "messages": [{"role": "user", "content": "' + LONE + '"}]}',
              '{"model": "chaos", "prompt": "x", "n": 100000}', '{"model": "chaos", "prompt": "x", "max_tokens": -1}',
              '{"model": "chaos", "prompt": "x", "logprobs": 1e9}', '{"model": "chaos", "prompt": ' + "[" * 100 + "]" * 100 + "}",
              '{"model": "chaos", "prompt": "x", "stop": ' + json.dumps(["a"] * 100) + "}", "not json", '{"model": "chaos", "prompt": NaN}')
REQUEST_DEADLINE_S = 60.0  # a stream still open after this long counts as hung
PROMPTS = [f"chaos {i}: paged attention keeps" for i in range(12)]
ENGINE = EngineConfig(num_device_blocks=256, max_num_seqs=16, num_threads=1, attention_backend="torch")
WORKER_FLAGS = ["--heartbeat-interval", "0.2", "--heartbeat-ttl", "1", "--redis-block-ms", "200"]
GATEWAY_FLAGS = ["--engine-poll", "0.2", "--redis-block-ms", "200"]
# (action, relative weight); a Redis restart loses in-flight requests, so it is the rarest
ACTIONS = (("kill_worker", 5), ("term_worker", 2), ("stop_worker", 2), ("stale_summary", 2), ("restart_redis", 1))
PREFIX = "pagedserve"  # the stack's Redis key prefix (the default)


@dataclass(slots=True)
class ChaosOptions:
    minutes: float = 1.0
    seed: int = 0
    clients: int = 6
    workers: int = 2
    gateways: int = 1
    max_tokens: int = 120
    mean_fault_s: float = 6.0
    redis_faults: bool = True
    model: str | None = None
    hostile: int = 0  # clients of another key sending bad bodies, resumes of the load's streams, floods


@dataclass(slots=True)
class Record:
    """One request as its client saw it; times in seconds since the load started."""

    start: float
    end: float
    prompt: str
    done: bool
    error: str | None
    duplicated: int
    lost: int


@dataclass(slots=True)
class Fault:
    t: float
    action: str
    target: str
    outage_s: float


@dataclass(slots=True)
class Run:
    options: ChaosOptions
    expected: dict[str, str]
    t0: float = field(default_factory=time.monotonic)
    records: list[Record] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    live_ids: list[str] = field(default_factory=list)  # the load's latest request ids: the hostile key's targets
    hostile: Counter = field(default_factory=Counter)  # (what the hostile client did, HTTP status) -> count

    def now(self) -> float:
        return time.monotonic() - self.t0


def text_diff(text: str, expected: str) -> tuple[int, int]:
    """(duplicated, lost) characters: inserted into / missing from the expected text."""
    duplicated = lost = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, expected, text, autojunk=False).get_opcodes():
        if op in ("insert", "replace"):
            duplicated += j2 - j1
        if op in ("delete", "replace"):
            lost += i2 - i1
    return duplicated, lost


def judge(outcome: Outcome, expected: str) -> tuple[int, int]:
    """A completed text against the whole expected one, a failed one against the expected prefix."""
    return text_diff(outcome.text, expected if outcome.done else expected[:len(outcome.text)])


def build_stack(options: ChaosOptions, model: str) -> LocalStack:
    stack = LocalStack(env={"PAGEDSERVE_API_KEY": f"{API_KEY},{HOSTILE_KEY}"})
    common = ["--model", model, "--served-model-name", MODEL_NAME, "--log-level", "ERROR"]
    for i in range(options.workers):
        stack.add_worker([*common, *config_argv(ENGINE), *WORKER_FLAGS, "--engine-id", f"w{i}"])
    for _ in range(options.gateways):
        stack.add_gateway([*common, *GATEWAY_FLAGS])
    return stack


async def undisturbed(stack: LocalStack, max_tokens: int) -> dict[str, str]:
    async with aiohttp.ClientSession(headers=AUTH) as session:
        outcomes = await asyncio.gather(*(sse_stream(session, "POST", f"{stack.url}/v1/completions", Outcome(p),
                                                     completion_body(MODEL_NAME, p, max_tokens)) for p in PROMPTS))
    failed = [o for o in outcomes if not o.done]
    if failed:
        raise RuntimeError(f"the undisturbed run failed: {failed[0].error}")
    return {o.prompt: o.text for o in outcomes}


async def client(run: Run, stack: LocalStack, rng: random.Random, stop_at: float) -> None:
    timeout = aiohttp.ClientTimeout(total=REQUEST_DEADLINE_S)
    async with aiohttp.ClientSession(headers=AUTH, timeout=timeout) as session:
        while run.now() < stop_at:
            prompt, url = rng.choice(PROMPTS), rng.choice(stack.urls)
            start = run.now()
            outcome = Outcome(prompt)
            try:
                await sse_stream(session, "POST", f"{url}/v1/completions", outcome,
                                 completion_body(MODEL_NAME, prompt, run.options.max_tokens))
            except TimeoutError:
                outcome.error = f"hung: no end within {REQUEST_DEADLINE_S:.0f}s"
            run.live_ids = [*run.live_ids[-31:], outcome.request_id] if outcome.request_id else run.live_ids
            run.records.append(Record(start, run.now(), prompt, outcome.done, None if outcome.done else
                                      outcome.error or "ended without [DONE]", *judge(outcome, run.expected[prompt])))
            if not outcome.done:
                await asyncio.sleep(0.5)  # a failing service is not hammered


async def hostile_client(run: Run, stack: LocalStack, rng: random.Random, stop_at: float) -> None:
    """Another tenant beside the load: bad bodies, resumes of the load's streams (each must be a 404 that
    leaves the stream untouched: the load's texts are judged as usual), and /tokenize floods."""
    headers = {"Authorization": f"Bearer {HOSTILE_KEY}", "Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=REQUEST_DEADLINE_S)
    flood = json.dumps({"model": MODEL_NAME, "prompt": "paged " * 20_000})
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        while run.now() < stop_at:
            url, kind = rng.choice(stack.urls), rng.choice(("bad body", "foreign resume", "tokenize flood"))
            if kind == "foreign resume" and run.live_ids:
                call = session.get(f"{url}/v1/streams/{rng.choice(run.live_ids)}")
            elif kind == "tokenize flood":
                call = session.post(f"{url}/tokenize", data=flood)
            else:
                kind, call = "bad body", session.post(f"{url}/v1/completions", data=rng.choice(BAD_BODIES))
            try:
                async with call as response:
                    await response.read()
                    run.hostile[kind, response.status] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                run.hostile[kind, type(exc).__name__] += 1
                await asyncio.sleep(0.5)


async def chaos(run: Run, stack: LocalStack, rng: random.Random, stop_at: float) -> None:
    """Faults until ``stop_at``; each one is over (its process restarted) before the next starts."""
    actions = [a for a, _ in ACTIONS if run.options.redis_faults or a != "restart_redis"]
    weights = [w for a, w in ACTIONS if a in actions]
    while (wait := rng.expovariate(1 / run.options.mean_fault_s)) + run.now() < stop_at:
        await asyncio.sleep(wait)
        action = rng.choices(actions, weights)[0]
        outage = rng.uniform(0.2, 2.0)
        target = stack.redis if action == "restart_redis" else rng.choice(stack.workers)
        name = "redis" if target is stack.redis else target.argv[target.argv.index("--engine-id") + 1]
        run.faults.append(Fault(round(run.now(), 2), action, name, round(outage, 2)))
        print(f"[{run.now():6.1f}s] {action} {name} (back after {outage:.1f}s)", flush=True)
        await inject(stack, target, action, outage)


async def inject(stack: LocalStack, target: Child, action: str, outage_s: float) -> None:
    if action == "stale_summary":  # instant: the summary stays wrong until the engine's set is rewritten
        others = [w for w in stack.workers if w is not target]
        if others:
            stack.redis_command("SUNIONSTORE", _prefixes(target), _prefixes(target), _prefixes(others[0]))
        return
    if action == "stop_worker":
        target.process.send_signal(signal.SIGSTOP)
        await asyncio.sleep(outage_s)
        target.process.send_signal(signal.SIGCONT)
        return
    target.process.send_signal(signal.SIGTERM if action == "term_worker" else signal.SIGKILL)
    while target.returncode is None:  # a draining worker finishes its requests first
        await asyncio.sleep(0.1)
    await asyncio.sleep(outage_s)
    stack.restart(target)  # on the loop's (main) thread: a child dies with the thread that started it


def _prefixes(worker: Child) -> str:
    return f"{PREFIX}:prefixes:{worker.argv[worker.argv.index('--engine-id') + 1]}"


async def progress(run: Run, stop_at: float) -> None:
    while run.now() < stop_at:
        await asyncio.sleep(5)
        done = sum(r.done for r in run.records)
        print(f"[{run.now():6.1f}s] sent {len(run.records)} completed {done} failed {len(run.records) - done} "
              f"faults {len(run.faults)}", flush=True)


async def load(options: ChaosOptions, stack: LocalStack) -> Run:
    run = Run(options, await undisturbed(stack, options.max_tokens))
    stop_at = options.minutes * 60
    rngs = [random.Random(f"{options.seed}:{i}") for i in range(options.clients + options.hostile + 1)]
    await asyncio.gather(chaos(run, stack, rngs[0], stop_at), progress(run, stop_at),
                         *(client(run, stack, rng, stop_at) for rng in rngs[1:options.clients + 1]),
                         *(hostile_client(run, stack, rng, stop_at) for rng in rngs[options.clients + 1:]))
    return run


def run_chaos(options: ChaosOptions) -> dict:
    """Starts the stack, runs the load and the faults, stops everything; the report."""
    model = options.model or ensure_demo_model()
    with build_stack(options, model) as stack:
        stack.wait_ready()
        started = time.monotonic()
        run = asyncio.run(load(options, stack))
    return summarize(run, time.monotonic() - started)


def summarize(run: Run, duration_s: float) -> dict:
    done = [r for r in run.records if r.done]
    worker_faults = [f.t for f in run.faults if f.action != "restart_redis"]
    resumed = sum(any(r.start < t < r.end for t in worker_faults) for r in done)
    reasons = Counter(_reason(r.error) for r in run.records if not r.done)
    return {"options": asdict(run.options), "duration_s": round(duration_s, 1), "sent": len(run.records),
            "completed": len(done), "resumed": resumed, "failed": len(run.records) - len(done),
            "refused": sum(r.error.startswith("HTTP ") for r in run.records if r.error),
            "hung": sum(r.error.startswith("hung") for r in run.records if r.error),
            "failures": dict(reasons.most_common()), "tokens_duplicated": sum(r.duplicated for r in run.records),
            "tokens_lost": sum(r.lost for r in run.records), "faults": [asdict(f) for f in run.faults],
            "hostile": {f"{kind} -> {status}": n for (kind, status), n in sorted(run.hostile.items(), key=str)},
            # 503 is the right answer to a resume while Redis is down; any other 5xx is a server fault
            "hostile_5xx": sum(n for (_, status), n in run.hostile.items() if status in range(500, 600)
                               and status != 503),
            "requests": [asdict(r) | {"start": round(r.start, 2), "end": round(r.end, 2)} for r in run.records]}


def _reason(error: str) -> str:
    """An error without its request ids and numbers, so equal causes count together."""
    return re.sub(r"(?<!HTTP )\b\d+(\.\d+)?\b", "N", re.sub(r"(chatcmpl|cmpl)-[0-9a-f]+", "<id>", error))[:160]


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no timeline drawn", file=sys.stderr)
        return
    end = max([r["end"] for r in result["requests"]] + [1.0])
    bins = range(int(end) + 2)
    fig, ax = plt.subplots(figsize=(12, 4))
    ends = [[r["end"] for r in result["requests"] if r["done"] is done] for done in (True, False)]
    ax.hist(ends, bins=bins, stacked=True, label=["completed", "failed"], color=["tab:green", "tab:red"])
    colors = {"kill_worker": "black", "term_worker": "tab:blue", "stop_worker": "tab:purple",
              "stale_summary": "tab:gray", "restart_redis": "tab:orange"}
    for f in result["faults"]:
        ax.axvline(f["t"], color=colors[f["action"]], linestyle="--", linewidth=1)
        ax.text(f["t"], ax.get_ylim()[1] * 0.95, f"{f['action']} {f['target']}", rotation=90, fontsize=7,
                va="top", ha="right")
    ax.set(xlabel="seconds", ylabel="requests ended per second",
           title=f"chaos: {result['completed']} completed, {result['failed']} failed, "
                 f"{result['tokens_duplicated']} duplicated, {result['tokens_lost']} lost")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"timeline: {path}")


def parse_args(argv: list[str] | None = None) -> tuple[ChaosOptions, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = ChaosOptions()
    p.add_argument("--minutes", type=float, default=defaults.minutes, help="how long the load runs")
    p.add_argument("--seed", type=int, default=defaults.seed, help="seeds the fault schedule and the clients")
    p.add_argument("--clients", type=int, default=defaults.clients, help="concurrent streaming clients")
    p.add_argument("--workers", type=int, default=defaults.workers, help="worker processes")
    p.add_argument("--gateways", type=int, default=defaults.gateways, help="gateway processes")
    p.add_argument("--max-tokens", type=int, default=defaults.max_tokens, help="tokens per request")
    p.add_argument("--mean-fault-s", type=float, default=defaults.mean_fault_s, help="mean seconds between faults")
    p.add_argument("--no-redis-faults", action="store_true", help="kill and restart workers only")
    p.add_argument("--model", help="checkpoint folder (default: the demo model)")
    p.add_argument("--hostile", type=int, default=defaults.hostile,
                   help="clients of another key beside the load: bad bodies, foreign resumes, /tokenize floods")
    p.add_argument("--json", help="write the report here")
    p.add_argument("--png", help="draw the timeline here")
    args = p.parse_args(argv)
    options = ChaosOptions(minutes=args.minutes, seed=args.seed, clients=args.clients, workers=args.workers,
                           gateways=args.gateways, max_tokens=args.max_tokens, mean_fault_s=args.mean_fault_s,
                           redis_faults=not args.no_redis_faults, model=args.model, hostile=args.hostile)
    return options, args


def main(argv: list[str] | None = None) -> int:
    options, args = parse_args(argv)
    result = run_chaos(options)
    report({k: v for k, v in result.items() if k != "requests"}, None)
    if args.json:
        with open(output_path(args.json), "w") as f:
            json.dump(result, f, indent=1)
    if args.png:
        plot(result, output_path(args.png))
    clean = result["tokens_duplicated"] == 0 and result["tokens_lost"] == 0 and result["hung"] == 0 \
        and result["hostile_5xx"] == 0
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
