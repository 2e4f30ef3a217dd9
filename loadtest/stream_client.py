"""Streaming clients for the fault tests and the chaos run: each records what the client saw
(request id, text so far, the last SSE event id, how the stream ended) while it runs, so a test
can inject a fault once every stream is under way and compare the text with an undisturbed run."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp
import openai

GREEDY = {"temperature": 0.0, "ignore_eos": True}


@dataclass(slots=True)
class Outcome:
    prompt: str
    request_id: str = ""
    text: str = ""
    last_event_id: str | None = None  # the SSE id of the last event read (raw SSE clients only)
    events: int = 0
    done: bool = False  # ended with [DONE] (or the openai client's normal end)
    error: str | None = None  # how it failed: an error event, an HTTP status, a timeout


def completion_body(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, **GREEDY}


async def openai_stream(client: openai.AsyncOpenAI, outcome: Outcome, model: str, max_tokens: int) -> Outcome:
    """One greedy completion through the official client; an error event raises in it (APIError)."""
    try:
        stream = await client.completions.create(model=model, prompt=outcome.prompt, max_tokens=max_tokens,
                                                 stream=True, temperature=0.0, extra_body={"ignore_eos": True})
        async for chunk in stream:
            outcome.request_id = chunk.id
            outcome.events += 1
            outcome.text += "".join(c.text for c in chunk.choices)
        outcome.done = True
    except openai.APIError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    return outcome


async def sse_stream(session: aiohttp.ClientSession, method: str, url: str, outcome: Outcome,
                     body: dict | None = None, headers: dict | None = None) -> Outcome:
    """A raw SSE client (the openai client hides event ids): POST a request, or GET a stream to resume,
    with a ``Last-Event-ID`` header when resuming; appends to ``outcome``. A timeout (the session's) is
    raised: the caller decides what a stream that never ended means. It asks for the events' ids
    (``X-Resumable``)."""
    try:
        headers = {"X-Resumable": "1"} | (headers or {})
        async with session.request(method, url, json=body, headers=headers) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.read())[:300].decode(errors='replace')}"
                return outcome
            async for event_id, data in _events(response.content):
                _apply(outcome, event_id, data)
    except TimeoutError:  # aiohttp's timeouts are TimeoutErrors, some of them ClientErrors as well
        raise
    except (aiohttp.ClientError, asyncio.IncompleteReadError) as exc:
        outcome.error = outcome.error or f"connection: {type(exc).__name__}: {exc}"
    return outcome


async def _events(content: aiohttp.StreamReader):
    """(id, data) of each SSE event block."""
    event_id, data = None, []
    async for raw in content:
        line = raw.decode().rstrip("\r\n")
        if not line:
            if data:
                yield event_id, "\n".join(data)
            event_id, data = None, []
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def _apply(outcome: Outcome, event_id: str | None, data: str) -> None:
    outcome.events += 1
    outcome.last_event_id = event_id
    if data == "[DONE]":
        outcome.done = outcome.error is None
        return
    chunk = json.loads(data)
    if "error" in chunk:
        outcome.error = chunk["error"].get("message", str(chunk["error"]))
        return
    outcome.request_id = chunk.get("id", outcome.request_id)
    outcome.text += "".join(c.get("text", "") for c in chunk.get("choices", []))
