"""What a translated API costs against chat, in the same run: one stack, the same conversations sent streaming
through /v1/chat/completions, /v1/messages (Anthropic's) and /v1/responses (OpenAI's), the APIs' order rotating
from round to round.

    python -m loadtest.bench_apis --json results/bench_apis.json

Greedy decoding on the demo model, so every API generates the same tokens (tests/service/test_anthropic_api.py
and test_responses_api.py check that): output tokens per second, TTFT and the end-to-end time compare the paths'
overhead only. The figures are messages / chat and responses / chat, medians over the rounds; each round sends
every conversation at once.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import aiohttp

from engine.config import EngineConfig
from engine.demo_model import ensure_demo_model

from loadtest import output_path
from loadtest.bench_serving import MODEL_NAME, served_stack

WORDS = ("the", "cat", "paged", "cache", "block", "stream", "engine", "river", "seven", "blue", "table", "light")


@dataclass(slots=True)
class Round:
    api: str
    output_tokens: int
    duration_s: float
    ttft_ms: float  # mean over the round's requests

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s


def conversations(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) + "?" for _ in range(count)]


APIS = ("chat", "messages", "responses")


def request(api: str, text: str, max_tokens: int) -> tuple[str, dict]:
    messages = [{"role": "user", "content": text}]
    common = {"model": MODEL_NAME, "temperature": 0.0, "stream": True}
    if api == "chat":
        return "/v1/chat/completions", common | {"messages": messages, "max_tokens": max_tokens,
                                                 "stream_options": {"include_usage": True}}
    if api == "messages":
        return "/v1/messages", common | {"messages": messages, "max_tokens": max_tokens}
    return "/v1/responses", common | {"input": messages, "max_output_tokens": max_tokens, "store": False}


async def one(session: aiohttp.ClientSession, url: str, api: str, text: str, max_tokens: int) -> tuple[int, float]:
    """(output tokens, TTFT in seconds) of one streamed request."""
    path, body = request(api, text, max_tokens)
    start, ttft, tokens = time.perf_counter(), 0.0, 0
    async with session.post(url + path, json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if not ttft and _is_text(api, event):
                ttft = time.perf_counter() - start
            tokens = _output_tokens(api, event) or tokens
    return tokens, ttft


def _is_text(api: str, event: dict) -> bool:
    if api == "chat":
        return any(c.get("delta", {}).get("content") for c in event.get("choices") or ())
    return event.get("type") == ("content_block_delta" if api == "messages" else "response.output_text.delta")


def _output_tokens(api: str, event: dict) -> int:
    if api == "chat":
        return (event.get("usage") or {}).get("completion_tokens", 0)
    if api == "messages":
        return event.get("usage", {}).get("output_tokens", 0) if event.get("type") == "message_delta" else 0
    if event.get("type") not in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens
        return 0
    return (event["response"].get("usage") or {}).get("output_tokens", 0)


async def run_round(url: str, api: str, texts: list[str], max_tokens: int) -> Round:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*(one(session, url, api, t, max_tokens) for t in texts))
        duration = time.perf_counter() - start
    return Round(api, sum(t for t, _ in results), duration, 1e3 * statistics.fmean(f for _, f in results))


def measure(url: str, texts: list[str], max_tokens: int, rounds: int) -> list[Round]:
    for api in APIS:  # warm-up of every path
        asyncio.run(run_round(url, api, texts[:4], 4))
    results = []
    for k in range(rounds):
        for api in APIS[k % len(APIS):] + APIS[:k % len(APIS)]:
            results.append(asyncio.run(run_round(url, api, texts, max_tokens)))
            print(f"  round {k + 1} {api}: {results[-1].output_tok_s:.0f} output tok/s, "
                  f"TTFT {results[-1].ttft_ms:.0f} ms", flush=True)
    return results


def summarize(results: list[Round]) -> dict[str, object]:
    by_api = {api: [r for r in results if r.api == api] for api in APIS}
    median = {api: statistics.median(r.output_tok_s for r in rs) for api, rs in by_api.items()}
    ttft = {api: statistics.median(r.ttft_ms for r in rs) for api, rs in by_api.items()}
    tokens = {api: {r.output_tokens for r in rs} for api, rs in by_api.items()}
    rounds = [asdict(r) | {"output_tok_s": r.output_tok_s} for r in results]
    return {"output_tok_s": median, "ttft_ms": ttft, "messages_over_chat": median["messages"] / median["chat"],
            "responses_over_chat": median["responses"] / median["chat"],
            "same_tokens": all(tokens[api] == tokens["chat"] for api in APIS), "rounds": rounds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--words", type=int, default=24, help="words in each user message")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="rounds of each API, their order rotating")
    p.add_argument("--num-threads", type=int, default=1, help="the worker's torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    model = ensure_demo_model()
    config = EngineConfig(model=model, num_threads=args.num_threads, enable_prefix_caching=False,
                          show_progress=False)
    texts = conversations(args.conversations, args.words, args.seed)
    with served_stack(model, config) as stack:
        stack.wait_ready(timeout_s=300)
        result = summarize(measure(stack.url, texts, args.max_tokens, args.rounds))
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=2))
    if args.json:
        with open(output_path(args.json), "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
