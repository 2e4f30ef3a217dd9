"""Issue 27's request surface through an in-process gateway and worker on the demo engine (memory broker,
no Redis): echo and prompt logprobs against transformers' own forward pass and as lm-eval reads them,
lists of prompts, /tokenize and /detokenize, logit_bias, and the 400s the gateway decides."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import pytest
import torch
from aiohttp.test_utils import TestClient
from transformers import AutoModelForCausalLM

from engine.sampling_params import SamplingParams
from service.config import GatewayConfig
from service.memory_broker import MemoryBus, MemoryGatewayBroker
from service.messages import EventKind, RequestMsg, params_to_wire
from tests.service.conftest import MODEL_NAME, gateway_client, memory_worker, running
from tests.service.fake_engine import FakeEngine

GREEDY = {"model": MODEL_NAME, "temperature": 0.0, "ignore_eos": True}
CONFIG = GatewayConfig(engine_poll_s=0.05, resume_deadline_s=0.3, max_structured_output_chars=200)


@pytest.fixture
async def client(tokenizer, demo_engine) -> AsyncIterator[TestClient]:
    bus = MemoryBus()
    async with gateway_client(CONFIG, tokenizer, bus) as client, running(memory_worker(bus, demo_engine)):
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.02)
        yield client


@pytest.fixture(scope="module")
def reference(demo_model: str):
    return AutoModelForCausalLM.from_pretrained(demo_model, torch_dtype=torch.float32).eval()


def reference_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= 1, from transformers."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lps = torch.log_softmax(logits, -1)
    return [lps[i - 1, ids[i]].item() for i in range(1, len(ids))]


async def post(client: TestClient, route: str, body: dict) -> tuple[int, dict]:
    response = await client.post(route, json=body)
    return response.status, await response.json()


async def test_lm_eval_loglikelihood_matches_transformers(client, tokenizer, reference) -> None:
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    contexts = [tokenizer.encode("The cat", add_special_tokens=False), tokenizer.encode("Paged", add_special_tokens=False)]
    continuations = [tokenizer.encode(" sat", add_special_tokens=False), tokenizer.encode(" memory", add_special_tokens=False)]
    prompts = [c + k for c, k in zip(contexts, continuations)]
    for max_tokens in (1, 0):  # lm-eval's request, and vLLM's prompt-only form of it
        status, body = await post(client, "/v1/completions", {
            "model": MODEL_NAME, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
            "seed": 1234, "echo": True})
        assert status == 200, body
        assert [c["index"] for c in body["choices"]] == [0, 1]
        for prompt, choice in zip(prompts, body["choices"]):
            lp = choice["logprobs"]
            assert lp["tokens"][:len(prompt)] == [tokenizer.decode([t]) for t in prompt]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert lp["token_logprobs"][1:len(prompt)] == pytest.approx(reference_logprobs(reference, prompt), abs=1e-3)
            assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
            assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
            assert choice["text"].startswith(tokenizer.decode(prompt))
            assert len(lp["tokens"]) == len(prompt) + (max_tokens or 0)
        if max_tokens == 0:
            assert body["usage"]["completion_tokens"] == 0
            assert [c["text"] for c in body["choices"]] == [tokenizer.decode(p) for p in prompts]
        # lm-eval drops the last entry (the generated token); with max_tokens=0 it would drop a prompt token,
        # so lm-eval's own request (max_tokens=1) is the one its parser is checked against.
        if max_tokens == 1:
            scores = LocalCompletionsAPI.parse_logprobs(body, prompts, [len(c) for c in contexts])
            for (score, _), context, prompt in zip(scores, contexts, prompts):
                assert score == pytest.approx(sum(reference_logprobs(reference, prompt)[len(context) - 1:]), abs=1e-3)


async def test_echo_prepends_the_prompt(client, tokenizer) -> None:
    plain = (await post(client, "/v1/completions", {**GREEDY, "prompt": "paged", "max_tokens": 4, "logprobs": 0}))[1]
    echoed = (await post(client, "/v1/completions", {**GREEDY, "prompt": "paged", "max_tokens": 4, "echo": True,
                                                     "logprobs": 0}))[1]
    generated, choice = plain["choices"][0], echoed["choices"][0]
    assert choice["text"] == "paged" + generated["text"]
    lp, prompt = choice["logprobs"], [tokenizer.decode([t]) for t in tokenizer.encode("paged")]
    assert lp["tokens"] == prompt + generated["logprobs"]["tokens"]
    assert lp["text_offset"][len(prompt):] == [o + 5 for o in generated["logprobs"]["text_offset"]]
    assert lp["token_logprobs"][len(prompt):] == pytest.approx(generated["logprobs"]["token_logprobs"])
    assert echoed["usage"] == plain["usage"]
    no_logprobs = (await post(client, "/v1/completions", {**GREEDY, "prompt": "paged", "max_tokens": 4, "echo": True}))[1]
    assert no_logprobs["choices"][0]["text"] == choice["text"] and no_logprobs["choices"][0]["logprobs"] is None


async def test_prompt_logprobs_per_choice(client, tokenizer, reference) -> None:
    status, body = await post(client, "/v1/chat/completions", {
        **GREEDY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 2, "prompt_logprobs": 2})
    assert status == 200, body
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tokenize=False)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    expected = reference_logprobs(reference, ids)
    for choice in body["choices"]:
        listed = choice["prompt_logprobs"]
        assert len(listed) == len(ids) and listed[0] is None
        for token_id, entry, lp in zip(ids[1:], listed[1:], expected):
            assert entry[str(token_id)]["logprob"] == pytest.approx(lp, abs=1e-3)
            assert entry[str(token_id)]["decoded_token"] == tokenizer.decode([token_id])
            assert sorted(e["rank"] for e in entry.values() if "rank" in e) == [1, 2]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_list_of_prompts_is_one_response(client, stream: bool) -> None:
    prompts, n = ["ab", [99, 100, 101], "xyz"], 2
    singles = [(await post(client, "/v1/completions", {**GREEDY, "prompt": p, "max_tokens": 3}))[1] for p in prompts]
    body = {**GREEDY, "prompt": prompts, "max_tokens": 3, "n": n}
    if not stream:
        status, merged = await post(client, "/v1/completions", body)
        assert status == 200, merged
        texts = {c["index"]: c["text"] for c in merged["choices"]}
        assert merged["usage"]["prompt_tokens"] == sum(s["usage"]["prompt_tokens"] for s in singles)
        assert merged["usage"]["completion_tokens"] == 3 * n * len(prompts)
    else:
        response = await client.post("/v1/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}})
        raw = (await response.read()).decode()
        events = [json.loads(b.split("data: ", 1)[1]) for b in raw.strip().split("\n\n")[:-1]]
        assert len({e["id"] for e in events}) == 1
        texts: dict[int, str] = {}
        for event in events:
            for c in event["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        assert events[-1]["usage"]["completion_tokens"] == 3 * n * len(prompts)
    assert texts == {k * n + i: s["choices"][0]["text"] for k, s in enumerate(singles) for i in range(n)}


async def test_tokenize_and_detokenize(client, tokenizer) -> None:
    status, body = await post(client, "/tokenize", {"model": MODEL_NAME, "prompt": "héllo", "add_special_tokens": False})
    assert status == 200 and body == {"count": len(body["tokens"]), "max_model_len": 2048,
                                      "tokens": tokenizer.encode("héllo", add_special_tokens=False)}
    messages = [{"role": "user", "content": "hi"}]
    status, chat = await post(client, "/tokenize", {"messages": messages, "add_generation_prompt": True})
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert (await post(client, "/detokenize", {"tokens": body["tokens"]}))[1] == {"prompt": "héllo"}
    status, error = await post(client, "/detokenize", {"tokens": [10**6]})
    assert status == 400 and error["error"]["param"] == "tokens"
    status, error = await post(client, "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404


async def test_auth_covers_the_tokenizer_routes(tokenizer) -> None:
    config = GatewayConfig(api_keys=("k",))
    async with gateway_client(config, tokenizer, MemoryBus()) as client:
        for route, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
            assert (await client.post(route, json=body)).status == 401
            assert (await client.post(route, json=body, headers={"Authorization": "Bearer k"})).status == 200


async def test_logit_bias_steers_and_is_checked_against_the_vocabulary(client, tokenizer) -> None:
    (a_id,) = tokenizer.encode("A", add_special_tokens=False)
    status, body = await post(client, "/v1/completions", {**GREEDY, "prompt": "a", "max_tokens": 3,
                                                          "logit_bias": {str(a_id): 100}})
    assert status == 200 and body["choices"][0]["text"] == "AAA"
    status, error = await post(client, "/v1/completions", {**GREEDY, "prompt": "a",
                                                           "logit_bias": {str(len(tokenizer)): 1}})
    assert status == 400 and error["error"]["param"] == "logit_bias"


@pytest.mark.parametrize("fields, param", [
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "guided_grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": {
        "type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20)}}}}}, "response_format"),
])
async def test_structured_outputs_that_cannot_compile_are_400(client, fields: dict, param: str) -> None:
    status, error = await post(client, "/v1/chat/completions", {
        **GREEDY, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, **fields})
    assert status == 400 and error["error"]["param"] == param, error


async def test_structured_output_reaches_the_engine(client) -> None:
    status, body = await post(client, "/v1/completions", {**GREEDY, "prompt": "a", "max_tokens": 8,
                                                          "guided_choice": ["yes", "no"]})
    assert status == 200, body
    assert body["choices"][0]["text"] in ("yes", "no")


async def test_worker_answers_bad_wire_params_with_a_400() -> None:
    bus = MemoryBus()
    gateway = MemoryGatewayBroker(bus, GatewayConfig(engine_poll_s=0.05))
    await gateway.start()
    async with running(memory_worker(bus, FakeEngine())):
        wire = params_to_wire(SamplingParams()) | {"logit_bias": [[1, 500.0]]}
        queue = await gateway.submit(RequestMsg("bad", [1], wire, gateway.gateway_id, time.time(), MODEL_NAME))
        events = [await asyncio.wait_for(queue.get(), 5) for _ in range(2)]
    await gateway.close()
    assert events[-1].kind is EventKind.ERROR and events[-1].status == 400 and "logit_bias" in events[-1].error
