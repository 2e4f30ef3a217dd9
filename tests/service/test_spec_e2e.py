"""Speculative decoding through the whole stack (gateway process, Redis, worker process, the demo model with
the n-gram proposer): stop strings, max_tokens, usage and logprobs come out exactly as without speculation.

Each request goes to both a speculating stack and the session's plain ``stack``. With speculation a step
may emit several tokens (the accepted proposals and the target's own token), so the interesting cases are
those that end in the middle of such a step: a stop string completed by a token that is not the step's
last, and a ``max_tokens`` that falls inside one. The prompts are ones the demo model repeats itself on,
so proposals are accepted; the ``*_step`` fixtures check that they are, and find the multi-token steps
from a streamed run (the worker sends one event per engine step, the gateway one chunk per event).
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

from service.local_stack import LocalStack
from tests.service.conftest import ENGINE, MODEL_NAME, START_TIMEOUT_S, local_stack
from tests.service.test_e2e import engine_figures, post, sse

SPEC_ENGINE = replace(ENGINE, speculative_method="ngram", num_speculative_tokens=4)
GREEDY = {"model": MODEL_NAME, "temperature": 0.0, "ignore_eos": True}
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
# The demo model answers a question it already answered in the conversation with the same answer again,
# which the n-gram proposer finds in the sequence. The completion's prompt is such a conversation in the
# model's chat format (ChatML), the only text it knows.
COMPLETION = {**GREEDY, "max_tokens": 12, "logprobs": 2, "prompt": (
    "<|im_start|>user\nWhat is 17 plus 25?<|im_end|>\n<|im_start|>assistant\n17 plus 25 is 42.<|im_end|>\n"
    "<|im_start|>user\nWhat is 17 plus 25?<|im_end|>\n<|im_start|>assistant\n")}
QUESTION = {"role": "user", "content": "What day comes after Friday?"}
CHAT = {**GREEDY, "max_tokens": 10, "logprobs": True, "top_logprobs": 2, "messages": [
    QUESTION, {"role": "assistant", "content": "The day after Friday is Saturday."}, QUESTION]}


@pytest.fixture(scope="module")
def spec_stack(demo_model: str) -> Iterator[LocalStack]:
    """One gateway and one worker whose engine speculates (n-gram proposals, K = 4)."""
    with local_stack(demo_model, num_workers=1, num_gateways=1, engine=SPEC_ENGINE) as stack:
        stack.wait_ready(START_TIMEOUT_S)
        yield stack


@dataclass(frozen=True, slots=True)
class Result:
    """What must not change with speculation: text, finish reason, token counts and per-token logprobs
    (token, logprob, top alternatives; completions' text offset too)."""

    text: str
    finish_reason: str | None
    usage: tuple[int, int, int]
    logprobs: list[tuple[Any, ...]]


def usage_counts(usage: dict[str, Any]) -> tuple[int, int, int]:
    # cached_tokens is left out: the two stacks' prefix caches saw different requests.
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def completion_logprobs(logprobs: dict[str, Any] | None) -> list[tuple[Any, ...]]:
    if logprobs is None:
        return []
    return list(zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"],
                    logprobs["text_offset"]))


def chat_logprobs(logprobs: dict[str, Any] | None) -> list[tuple[Any, ...]]:
    if logprobs is None:
        return []
    return [(e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e["top_logprobs"]})
            for e in logprobs["content"]]


def whole(body: dict[str, Any], chat: bool) -> Result:
    (choice,) = body["choices"]
    if chat:
        return Result(choice["message"]["content"], choice["finish_reason"], usage_counts(body["usage"]),
                      chat_logprobs(choice["logprobs"]))
    return Result(choice["text"], choice["finish_reason"], usage_counts(body["usage"]),
                  completion_logprobs(choice["logprobs"]))


def streamed(events: list[tuple[str, str]], chat: bool) -> Result:
    """The stream's chunks put together (their boundaries differ with speculation: a step is one chunk)."""
    chunks = [json.loads(data) for _, data in events[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    if chat:
        text = "".join(c["delta"].get("content") or "" for c in choices)
        logprobs = [e for c in choices for e in chat_logprobs(c["logprobs"])]
    else:
        text = "".join(c["text"] for c in choices)
        logprobs = [e for c in choices for e in completion_logprobs(c["logprobs"])]
    assert chunks[-1]["choices"] == [], "include_usage: the last chunk carries the usage alone"
    return Result(text, choices[-1]["finish_reason"], usage_counts(chunks[-1]["usage"]), logprobs)


def path(chat: bool) -> str:
    return "/v1/chat/completions" if chat else "/v1/completions"


async def both(plain: LocalStack, spec: LocalStack, body: dict[str, Any], chat: bool) -> tuple[Result, Result]:
    """The same request on the plain and the speculating stack, at once (each stack runs it alone)."""
    if body.get("stream"):
        body = {**body, "stream_options": {"include_usage": True}}
        a, b = await asyncio.gather(sse(plain.url + path(chat), body), sse(spec.url + path(chat), body))
        return streamed(a, chat), streamed(b, chat)
    (status_a, a), (status_b, b) = await asyncio.gather(post(plain.url + path(chat), body),
                                                        post(spec.url + path(chat), body))
    assert status_a == 200 and status_b == 200, (a, b)
    return whole(a, chat), whole(b, chat)


def assert_same(plain: Result, spec: Result) -> None:
    assert (spec.text, spec.finish_reason, spec.usage) == (plain.text, plain.finish_reason, plain.usage)
    assert len(spec.logprobs) == len(plain.logprobs) == plain.usage[1]
    for (token, logprob, top, *offset), (p_token, p_logprob, p_top, *p_offset) in zip(spec.logprobs, plain.logprobs):
        assert (token, offset, top.keys()) == (p_token, p_offset, p_top.keys())
        assert logprob == pytest.approx(p_logprob, abs=1e-4)
        assert list(top.values()) == pytest.approx(list(p_top.values()), abs=1e-4)


def compare(plain: LocalStack, spec: LocalStack, body: dict[str, Any], chat: bool) -> Result:
    """Both stacks' results, asserted the same; the plain one."""
    expected, got = asyncio.run(both(plain, spec, body, chat))
    assert_same(expected, got)
    return expected


# ---- the steps of a speculating run -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MidStep:
    """A token in the middle of a step that accepted proposals (tokens of the same step follow it)."""

    num_tokens: int  # the output's tokens up to and including it
    stop: str  # a stop string whose first occurrence ends with it


def step_tokens(events: list[tuple[str, str]], chat: bool) -> list[list[str]]:
    """Each chunk's tokens (from its logprobs); checks that they spell the chunk's text."""
    steps = []
    for _, data in events[:-1]:
        for choice in json.loads(data)["choices"]:
            if chat:
                text = choice["delta"].get("content") or ""
                tokens = [e[0] for e in chat_logprobs(choice["logprobs"])]
            else:
                text, tokens = choice["text"], [e[0] for e in completion_logprobs(choice["logprobs"])]
            if tokens:
                steps.append(tokens)
                if "".join(tokens) != text:  # a special token (not in the text) or a character split: no stop here
                    return steps
    return steps


def mid_step(steps: list[list[str]]) -> MidStep:
    """The first token with tokens of its own step after it whose text can end a stop string: some suffix
    of the text so far (2 characters or more, not from its start, so that some text is left) occurs there
    first."""
    text, count = "", 0
    for tokens in steps:
        for k, token in enumerate(tokens):
            text, count = text + token, count + 1
            if k == len(tokens) - 1:
                continue
            for length in range(2, len(text)):
                if text.find(text[-length:]) == len(text) - length:
                    return MidStep(count, text[-length:])
    raise AssertionError(f"no step of several tokens: {steps}")


def probe_steps(plain: LocalStack, spec: LocalStack, body: dict[str, Any], chat: bool) -> list[list[str]]:
    """The speculating stack's steps on ``body`` (streamed, no stop), after checking that its engine accepted
    proposals (its counter, through the gateway's /metrics) and that the plain stack emits a token a step."""

    async def run() -> tuple[list, list]:
        stream = {**body, "stream": True}
        return await asyncio.gather(sse(plain.url + path(chat), stream), sse(spec.url + path(chat), stream))

    before = engine_figures(spec.url).get(ACCEPTED, 0.0)
    plain_events, spec_events = asyncio.run(run())
    assert all(len(tokens) == 1 for tokens in step_tokens(plain_events, chat))
    steps = step_tokens(spec_events, chat)
    accepted = sum(len(tokens) - 1 for tokens in steps)
    assert accepted > 0, f"no proposal was accepted: {steps}"
    wait_for_more(spec.url, ACCEPTED, before + accepted)
    return steps


def wait_for_more(base_url: str, name: str, at_least: float, timeout_s: float = 10.0) -> None:
    """Until the engine's counter (sent with its heartbeats) reaches ``at_least``."""

    async def poll() -> None:
        while engine_figures(base_url).get(name, 0.0) < at_least:
            await asyncio.sleep(0.1)

    asyncio.run(asyncio.wait_for(poll(), timeout_s))


@pytest.fixture(scope="module")
def completion_step(stack: LocalStack, spec_stack: LocalStack) -> MidStep:
    return mid_step(probe_steps(stack, spec_stack, COMPLETION, chat=False))


@pytest.fixture(scope="module")
def chat_step(stack: LocalStack, spec_stack: LocalStack) -> MidStep:
    return mid_step(probe_steps(stack, spec_stack, CHAT, chat=True))


# ---- the tests ------------------------------------------------------------------------------------------


ENDPOINTS = pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
STREAM = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


def endpoint(request: pytest.FixtureRequest, chat: bool) -> tuple[dict, MidStep]:
    """The endpoint's request body and its observed multi-token step."""
    return (CHAT, request.getfixturevalue("chat_step")) if chat else (
        COMPLETION, request.getfixturevalue("completion_step"))


@ENDPOINTS
@STREAM
@pytest.mark.parametrize("include_stop", [False, True], ids=["trimmed", "with-stop"])
def test_stop_string_mid_step(request: pytest.FixtureRequest, stack: LocalStack, spec_stack: LocalStack,
                              chat: bool, stream: bool, include_stop: bool) -> None:
    base, step = endpoint(request, chat)
    body = {**base, "stop": [step.stop], "include_stop_str_in_output": include_stop, "stream": stream}
    plain = compare(stack, spec_stack, body, chat=chat)
    assert plain.finish_reason == "stop" and plain.usage[1] == step.num_tokens
    assert plain.text.endswith(step.stop) == include_stop


@ENDPOINTS
@STREAM
def test_max_tokens_mid_step(request: pytest.FixtureRequest, stack: LocalStack, spec_stack: LocalStack,
                             chat: bool, stream: bool) -> None:
    base, step = endpoint(request, chat)
    plain = compare(stack, spec_stack, {**base, "max_tokens": step.num_tokens, "stream": stream}, chat=chat)
    assert plain.finish_reason == "length" and plain.usage[1] == step.num_tokens
