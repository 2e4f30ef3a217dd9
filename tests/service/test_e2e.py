"""Through the whole stack (gateway processes, Redis, worker processes, the
real engine on the demo model), checked against transformers and the openai client."""
from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.local_stack import LocalStack
from tests.service.conftest import API_KEY, MODEL_NAME, get_json, get_text

AUTH = {"Authorization": f"Bearer {API_KEY}"}
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(demo_model: str):
    return AutoTokenizer.from_pretrained(demo_model)


@pytest.fixture(scope="module")
def hf_greedy(demo_model: str, tokenizer):
    """The reference: transformers' greedy continuation and its logprobs."""
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, eos_token_id=None,
                                 pad_token_id=0)
        ids = out.sequences[0, len(prompt_ids):].tolist()
        logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, ids)]
        return ids, logprobs

    return generate


async def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body, headers=AUTH if headers is None else headers) as response:
            return response.status, await response.json(content_type=None)


async def sse(url: str, body: dict, resumable: bool = False) -> list[tuple[str | None, str]]:
    """(id, data) of every event, checking the framing on the way: OpenAI's (``data:`` lines alone, as parsers
    that split on blank lines and strip ``data: `` expect), or with ``X-Resumable`` an ``id:`` line first."""
    headers = AUTH | ({"X-Resumable": "1"} if resumable else {})
    async with aiohttp.ClientSession() as session:
        async with session.post(url, json=body, headers=headers) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/event-stream")
            request_id = response.headers["X-Request-Id"]
            raw = (await response.read()).decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw[:-2].split("\n\n"):
        lines = block.split("\n")
        if resumable:
            assert len(lines) == 2 and lines[0].startswith("id: ") and lines[1].startswith("data: "), block
            events.append((lines[0][4:], lines[1][6:]))
        else:
            assert len(lines) == 1 and lines[0].startswith("data: "), block
            events.append((None, lines[0][6:]))
    assert json.loads(events[0][1])["id"] == request_id
    if resumable:  # ids are <request id>:<k>, what Last-Event-ID resumes from
        assert [e[0] for e in events] == [f"{request_id}:{i}" for i in range(len(events))]
    assert events[-1][1] == "[DONE]"
    return events


@pytest.mark.parametrize("route, body", [
    ("/v1/completions", {"prompt": "The paged KV cache", "max_tokens": 6}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}),
])
def test_sse_framing_is_openais_unless_the_client_asks_for_ids(stack: LocalStack, route, body) -> None:
    body = {"model": MODEL_NAME, "stream": True, "temperature": 0.0, **body}
    plain = asyncio.run(sse(stack.url + route, body))
    with_ids = asyncio.run(sse(stack.url + route, body, resumable=True))
    strip = [(json.loads(d).get("choices") if d != "[DONE]" else d) for _, d in plain]
    assert strip == [(json.loads(d).get("choices") if d != "[DONE]" else d) for _, d in with_ids]


def test_completion_matches_transformers(stack: LocalStack, tokenizer, hf_greedy) -> None:
    prompt = "The paged KV cache"
    ids = tokenizer.encode(prompt)
    ref_ids, ref_logprobs = hf_greedy(ids, 8)
    status, body = asyncio.run(post(f"{stack.url}/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "logprobs": 2, **GREEDY}))
    assert status == 200, body
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert choice["text"] == tokenizer.decode(ref_ids, skip_special_tokens=True)
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(ref_logprobs, abs=1e-3)
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 8, "total_tokens": len(ids) + 8,
                             "prompt_tokens_details": body["usage"]["prompt_tokens_details"]}


def test_chat_stream_matches_chat_template_and_framing(stack: LocalStack, tokenizer, hf_greedy) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo wörld 🙂"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ref_ids, _ = hf_greedy(tokenizer.encode(ids, add_special_tokens=False), 10)
    events = asyncio.run(sse(f"{stack.urls[1]}/v1/chat/completions", {
        "model": MODEL_NAME, "messages": messages, "max_tokens": 10, "stream": True,
        "stream_options": {"include_usage": True}, **GREEDY}))
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1])
    assert content == tokenizer.decode(ref_ids, skip_special_tokens=True)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10
    assert all(c["usage"] is None for c in chunks[:-1])


def test_stop_string_trims_and_ends(stack: LocalStack, tokenizer, hf_greedy) -> None:
    prompt = "stop strings"
    text = tokenizer.decode(hf_greedy(tokenizer.encode(prompt), 16)[0], skip_special_tokens=True)
    stop = text[6:8]
    expected = text[:text.find(stop)]
    base = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 16, "stop": [stop], **GREEDY}
    status, body = asyncio.run(post(f"{stack.url}/v1/completions", base))
    assert status == 200 and body["choices"][0]["text"] == expected
    assert body["choices"][0]["finish_reason"] == "stop"
    status, body = asyncio.run(post(f"{stack.url}/v1/completions", {**base, "include_stop_str_in_output": True}))
    assert body["choices"][0]["text"] == expected + stop
    events = asyncio.run(sse(f"{stack.url}/v1/completions", {**base, "stream": True}))
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_openai_client_sync(stack: LocalStack) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY)
    assert [m.id for m in client.models.list()] == [MODEL_NAME]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, n=2, seed=7, extra_body={"ignore_eos": True})
    assert len(chat.choices) == 2 and all(c.finish_reason == "length" for c in chat.choices)
    assert chat.usage.completion_tokens == 10
    stream = client.completions.create(model=MODEL_NAME, prompt="abc", max_tokens=4, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_openai_client_async(stack: LocalStack) -> None:
    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=f"{stack.urls[1]}/v1", api_key=API_KEY)
        stream = await client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True,
            logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices[0].finish_reason == "length"
        assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) == 4
        completion = await client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=3,
                                                     extra_body={"ignore_eos": True})
        assert completion.usage.prompt_tokens == 3 and completion.usage.completion_tokens == 3
        await client.close()

    asyncio.run(run())


def test_models_retrieve_a_default_model_and_unknown_routes(stack: LocalStack) -> None:
    """The SDK's models.retrieve; a body without 'model' runs on the served model (vLLM's rule); an unknown
    route's 404 names it and the routes served."""
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=API_KEY)
    card = client.models.retrieve(MODEL_NAME)
    assert card.id == MODEL_NAME and card.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("another-model")
    assert missing.value.body["code"] == "model_not_found"
    status, completion = asyncio.run(post(f"{stack.url}/v1/completions", {"prompt": "abc", "max_tokens": 2}))
    assert status == 200 and completion["model"] == MODEL_NAME and completion["usage"]["completion_tokens"] == 2
    status, body = get_json(f"{stack.url}/v1/rerank")
    assert status == 404 and body["error"]["code"] == "not_found"
    message = body["error"]["message"]
    assert "GET /v1/rerank" in message and "POST /v1/embeddings" in message and "GET /v1/models" in message


def test_requests_across_two_gateways_and_two_workers(stack: LocalStack) -> None:
    async def run() -> list[dict]:
        bodies = [{"model": MODEL_NAME, "prompt": f"request {i}", "max_tokens": 6, "ignore_eos": True,
                   "stream": i % 2 == 0} for i in range(12)]
        return await asyncio.gather(*(post(f"{stack.urls[i % 2]}/v1/completions", {**b, "stream": False})
                                      for i, b in enumerate(bodies)))

    results = asyncio.run(run())
    assert all(status == 200 and body["usage"]["completion_tokens"] == 6 for status, body in results)
    _, ready = get_json(f"{stack.url}/ready")
    assert ready["engines"] == 2


def engine_figures(base_url: str) -> dict[str, float]:
    figures: dict[str, float] = {}
    for family in text_string_to_metric_families(get_text(f"{base_url}/metrics")):
        for sample in family.samples:
            if "engine" in sample.labels:
                figures[sample.name] = figures.get(sample.name, 0.0) + sample.value
    return figures


def wait_for_figure(base_url: str, name: str, expected: float, timeout_s: float = 20.0) -> None:
    async def poll() -> None:
        while engine_figures(base_url)[name] != expected:
            await asyncio.sleep(0.2)

    asyncio.run(asyncio.wait_for(poll(), timeout_s))


def test_client_disconnect_returns_blocks(stack: LocalStack) -> None:
    wait_for_figure(stack.url, "vllm:num_requests_running", 0)  # earlier tests' requests are done
    before = engine_figures(stack.url)

    async def stream_then_hang_up() -> None:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{stack.url}/v1/completions", headers=AUTH, json={
                    "model": MODEL_NAME, "prompt": "x" * 40, "max_tokens": 2000, "ignore_eos": True,
                    "stream": True}) as response:
                await response.content.readuntil(b"\n\n")
                while engine_figures(stack.url)["vllm:num_requests_running"] != 1:
                    await asyncio.sleep(0.1)  # until a heartbeat shows the request running
            # leaving the block closed the connection mid-stream

    asyncio.run(stream_then_hang_up())
    wait_for_figure(stack.url, "vllm:num_requests_running", 0)
    wait_for_figure(stack.url, "pagedserve:num_blocks_free", before["pagedserve:num_blocks_free"])
    generated = engine_figures(stack.url)["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    assert 0 < generated < 2000  # the engine stopped early: it was aborted, not finished


def test_metrics_models_health_openapi(stack: LocalStack) -> None:
    names = {f.name for f in text_string_to_metric_families(get_text(f"{stack.url}/metrics"))}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:num_preemptions", "vllm:prefix_cache_queries",
                 "vllm:prefix_cache_hits", "pagedserve:kv_internal_frag_slots", "pagedserve:kv_external_frag_slots",
                 "pagedserve:kv_reserved_slots"):
        assert name in names
    assert get_json(f"{stack.url}/health", api_key=None) == (200, {"status": "ok"})
    status, doc = get_json(f"{stack.url}/openapi.json")
    assert status == 200 and "/v1/chat/completions" in doc["paths"]
