"""Locust load test for any OpenAI-compatible server (pagedserve, vLLM, ...): streamed chat.

Each user streams chat completions and reports, besides Locust's own row for the POST
(time to response headers), these custom rows (request_type, all under the same name):

    TTFT  time to first token, ms (request sent -> first chunk with content)
    ITL   inter-token latency, ms (one sample per gap between content chunks)
    E2E   end-to-end latency, ms (request sent -> `data: [DONE]`); its size column counts
          completion tokens, not bytes
    TPS   output tokens/s of one request (completion tokens / E2E). Locust shows it in its
          "ms" columns: read them as tokens/s.

At the end the run's aggregate output throughput (tokens/s) is logged. The run exits non-zero
when any request failed (Locust's default) or when no request succeeded at all.

    locust -f loadtest/locustfile.py --headless -H http://127.0.0.1:8000 \
        -u 4 -r 2 -t 60s --max-tokens 64 --prompt-words 100

Options (flag / env var): --api-key PAGEDSERVE_API_KEY, --model PAGEDSERVE_LT_MODEL (default:
the first of /v1/models), --prompt-words PAGEDSERVE_LT_PROMPT_WORDS, --max-tokens
PAGEDSERVE_LT_MAX_TOKENS, --ignore-eos PAGEDSERVE_LT_IGNORE_EOS (exact output lengths, a
vLLM extension), --temperature PAGEDSERVE_LT_TEMPERATURE, --think-time-min / --think-time-max
PAGEDSERVE_LT_THINK_MIN / PAGEDSERVE_LT_THINK_MAX (seconds between a user's requests).
"""
from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass, field

from locust import HttpUser, events, task
from locust.env import Environment
from locust.exception import StopUser

CHAT_PATH = "/v1/chat/completions"
# Prompts are drawn from these words; most BPE tokenizers make one to two tokens of each.
WORDS = (
    "the of and to in is was for on are with as by at from that this which be or an have not "
    "paged attention memory block cache token sequence request batch kernel server stream queue "
    "model layer weight value query key scheduler engine worker gateway latency throughput"
).split()

logger = logging.getLogger(__name__)


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    parser.add_argument("--api-key", env_var="PAGEDSERVE_API_KEY", default="", is_secret=True,
                        help="Bearer token sent with every request (empty: none)")
    parser.add_argument("--model", env_var="PAGEDSERVE_LT_MODEL", default="",
                        help="Model name (default: the first one /v1/models lists)")
    parser.add_argument("--prompt-words", env_var="PAGEDSERVE_LT_PROMPT_WORDS", type=int, default=32,
                        help="Words in each prompt (random, so the prefix cache does not help)")
    parser.add_argument("--max-tokens", env_var="PAGEDSERVE_LT_MAX_TOKENS", type=int, default=64,
                        help="max_tokens of each request (the output length)")
    parser.add_argument("--ignore-eos", env_var="PAGEDSERVE_LT_IGNORE_EOS", action="store_true",
                        help="Send ignore_eos so every output has exactly --max-tokens tokens")
    parser.add_argument("--temperature", env_var="PAGEDSERVE_LT_TEMPERATURE", type=float, default=1.0)
    parser.add_argument("--think-time-min", env_var="PAGEDSERVE_LT_THINK_MIN", type=float, default=0.0,
                        help="Minimum seconds a user waits between requests")
    parser.add_argument("--think-time-max", env_var="PAGEDSERVE_LT_THINK_MAX", type=float, default=1.0,
                        help="Maximum seconds a user waits between requests")


@dataclass(slots=True)
class StreamTiming:
    """Arrival times of one streamed completion (perf_counter seconds)."""

    start: float
    chunk_times: list[float] = field(default_factory=list)
    usage_tokens: int | None = None
    done_at: float | None = None

    @property
    def completion_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.chunk_times)


class StreamError(Exception):
    """The server broke the stream (an error event, or no [DONE])."""


def read_stream(lines, timing: StreamTiming) -> None:
    """Consume SSE lines, recording when each content chunk and the usage arrive."""
    for raw in lines:
        if not raw.startswith(b"data:"):
            continue  # blank separators and `id:` lines
        payload = raw[5:].strip()
        if payload == b"[DONE]":
            timing.done_at = time.perf_counter()
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise StreamError(f"error event: {chunk['error']}")
        if any(choice.get("delta", {}).get("content") for choice in chunk.get("choices", [])):
            timing.chunk_times.append(time.perf_counter())
        if chunk.get("usage"):
            timing.usage_tokens = chunk["usage"]["completion_tokens"]
    raise StreamError("stream ended without data: [DONE]")


def fire(environment: Environment, request_type: str, value: float, length: int = 0) -> None:
    environment.events.request.fire(request_type=request_type, name=CHAT_PATH, response_time=value,
                                    response_length=length, exception=None, context={})


def report(environment: Environment, timing: StreamTiming) -> None:
    """Fire the TTFT / ITL / E2E / TPS rows of one finished stream."""
    e2e = timing.done_at - timing.start
    if timing.chunk_times:  # a model may end at once (EOS first): no first token to time
        fire(environment, "TTFT", (timing.chunk_times[0] - timing.start) * 1000)
    for before, after in zip(timing.chunk_times, timing.chunk_times[1:]):
        fire(environment, "ITL", (after - before) * 1000)
    fire(environment, "E2E", e2e * 1000, timing.completion_tokens)
    fire(environment, "TPS", timing.completion_tokens / e2e, timing.completion_tokens)


class ChatUser(HttpUser):
    """A client that streams one chat completion after another."""

    def wait_time(self) -> float:
        options = self.environment.parsed_options
        return random.uniform(options.think_time_min, max(options.think_time_min, options.think_time_max))

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
        self.model = options.model or self.first_model()

    def first_model(self) -> str:
        with self.client.get("/v1/models", headers=self.headers, catch_response=True) as response:
            if response.status_code == 200 and response.json().get("data"):
                return response.json()["data"][0]["id"]
            detail = response.error or response.text[:200]
            response.failure(f"no model to test: HTTP {response.status_code} {detail}")
        raise StopUser()

    def request_body(self) -> dict:
        options = self.environment.parsed_options
        prompt = " ".join(random.choices(WORDS, k=options.prompt_words))
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": options.max_tokens,
            "temperature": options.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if options.ignore_eos:
            body["ignore_eos"] = True
        return body

    @task
    def stream_chat(self) -> None:
        timing = StreamTiming(start=time.perf_counter())
        with self.client.post(CHAT_PATH, json=self.request_body(), headers=self.headers,
                              stream=True, catch_response=True) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.error or response.text[:300]}")
                return
            try:
                read_stream(response.iter_lines(), timing)
            except (StreamError, ValueError, KeyError, OSError) as error:
                response.failure(f"{type(error).__name__}: {error}")
                return
        report(self.environment, timing)


@events.quitting.add_listener
def summarize(environment: Environment, **_) -> None:
    """Log the aggregate output throughput; fail the run when nothing succeeded."""
    stats = environment.stats
    chat = stats.get(CHAT_PATH, "POST")
    e2e = stats.entries.get((CHAT_PATH, "E2E"))
    tokens = e2e.total_content_length if e2e else 0
    succeeded = chat.num_requests - chat.num_failures
    if stats.last_request_timestamp:
        elapsed = max(stats.last_request_timestamp - stats.start_time, 1e-3)
        logger.info("output throughput: %.1f tokens/s (%d tokens in %.1f s); %d of %d chat requests ok",
                    tokens / elapsed, tokens, elapsed, succeeded, chat.num_requests)
    if succeeded == 0:
        logger.error("no chat completion succeeded")
        environment.process_exit_code = 1
