"""The event loop stays free: over-long prompts are refused before tokenizing, and tokenizing and
detokenizing run on the gateway's tokenizer threads."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient

from service import prompts as prompts_module
from service.config import GatewayConfig
from service.memory_broker import MemoryBus
from service.tokenization import template_chars_per_message
from tests.service.conftest import MODEL_NAME, gateway_client, memory_worker, running

CONTEXT, CHARS_PER_TOKEN = 64, 4
LIMIT = CONTEXT * CHARS_PER_TOKEN


@pytest.fixture
async def client_and_bus(tokenizer) -> AsyncIterator[tuple[TestClient, MemoryBus]]:
    bus = MemoryBus()
    async with gateway_client(GatewayConfig(engine_poll_s=0.05, max_chars_per_token=CHARS_PER_TOKEN), tokenizer, bus, CONTEXT) as client:
        yield client, bus


@pytest.fixture
def tokenized(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts the gateway tokenized."""
    seen: list[str] = []
    encode_prompt, encode_chat = prompts_module.encode_prompt, prompts_module.encode_chat
    monkeypatch.setattr(prompts_module, "encode_prompt", lambda tok, p: seen.append(p) or encode_prompt(tok, p))
    monkeypatch.setattr(prompts_module, "encode_chat",
                        lambda tok, m, *rest: seen.append(str(m)) or encode_chat(tok, m, *rest))
    return seen


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_a_prompt_too_long_for_any_tokenizer_is_refused_untokenized(client_and_bus, tokenized, tokenizer,
                                                                          endpoint: str) -> None:
    client, _ = client_and_bus
    chat = endpoint.endswith("chat/completions")
    template = 2 * template_chars_per_message(tokenizer) if chat else 0  # what the template adds to 2 messages
    errors = []
    for size in (LIMIT - template + 1, LIMIT - template):  # the system message counts too
        text = "x" * size
        body = {"messages": [{"role": "system", "content": text[:10]}, {"role": "user", "content": text[10:]}]} \
            if chat else {"prompt": text}
        response = await client.post(endpoint, json={"model": MODEL_NAME, "max_tokens": 1, **body})
        assert response.status == 400
        errors.append((await response.json())["error"])
    assert len(tokenized) == 1  # only the prompt within the limit, which then fails the token count
    too_long, tokenized_then_refused = errors
    assert set(too_long) == {"message", "type", "param", "code"} and too_long["type"] == "invalid_request_error"
    assert too_long["param"] == ("messages" if chat else "prompt") and too_long["code"] == "context_length_exceeded"
    assert f"at most {LIMIT} characters" in too_long["message"] and str(CONTEXT) in too_long["message"]
    assert "characters" not in tokenized_then_refused["message"]


async def test_a_token_id_prompt_longer_than_the_context_is_refused(client_and_bus) -> None:
    client, _ = client_and_bus
    response = await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": [1] * (CONTEXT + 1)})
    error = (await response.json())["error"]
    assert response.status == 400 and error["param"] == "prompt" and str(CONTEXT) in error["message"]


async def test_tokenizing_and_detokenizing_run_off_the_event_loop(client_and_bus, tokenizer, demo_engine,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    client, bus = client_and_bus
    threads: set[str] = set()
    for name in ("encode", "decode", "apply_chat_template"):
        method = getattr(tokenizer, name)
        monkeypatch.setattr(tokenizer, name, lambda *a, _m=method, **k: threads.add(
            threading.current_thread().name) or _m(*a, **k))
    body = {"model": MODEL_NAME, "temperature": 0.0, "ignore_eos": True, "max_tokens": 5, "logprobs": 2}
    async with running(memory_worker(bus, demo_engine)):
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.02)
        whole = await (await client.post("/v1/completions", json={**body, "prompt": "paged"})).json()
        streamed = await client.post("/v1/completions", json={**body, "prompt": "paged", "stream": True})
        raw = (await streamed.read()).decode()
        chat = await client.post("/v1/chat/completions", json={
            "model": MODEL_NAME, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status in (200, 400)  # the demo tokenizer may have no chat template: 400, after rendering
        await chat.read()
    assert whole["choices"][0]["text"] and '"text"' in raw and raw.rstrip().endswith("data: [DONE]")
    assert threads and all(t.startswith("tokenize") for t in threads), threads
