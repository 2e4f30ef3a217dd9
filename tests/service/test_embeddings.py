"""OpenAI's embeddings API (/v1/embeddings). Against a stack of real processes, the official openai SDK and
LangChain's OpenAIEmbeddings: the demo checkpoint served as a pooler (no sentence-transformers files: its last
token's final hidden state, normalized), equal to transformers' pooling of the same tokens. In process, on the
memory broker: every refused body a 400 naming its field with nothing queued; another API key shares no cached
prefix; every KV block back once the requests end, a client that left included."""
from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator

import numpy as np
import openai
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoModel, AutoTokenizer

from engine.pooler_config import PoolerConfig
from engine.pooling_params import PoolingParams
from service.config import GatewayConfig
from service.errors import APIError
from service.gateway import Gateway
from service.gateway_app import build_app
from service.local_stack import LocalStack
from service.memory_broker import MemoryBus, MemoryGatewayBroker
from service.openapi import openapi_document
from service.served_model import ServedModel
from tests.service.conftest import API_KEY, MODEL_NAME, OTHER_KEY, count_calls, memory_worker, running, until
from tests.service.fake_engine import FakeEngine
from tests.service.test_gateway_unit import ready
from tests.service.test_worker_unit import free_blocks

TEXTS = ["What day comes after Friday?", "17 plus 25", "Spell the word cat."]
ATOL = 1e-5


@pytest.fixture(scope="module")
def client(roomy_stack: LocalStack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{roomy_stack.url}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def token_ids(demo_model: str):
    """A text's token ids as the gateway makes them (special tokens added)."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    return lambda text: tokenizer.encode(text, add_special_tokens=True)


@pytest.fixture(scope="module")
def reference(demo_model: str, token_ids):
    """transformers' pooling of a text (or token ids): the last token's final hidden state in fp32, L2-normalized."""
    model = AutoModel.from_pretrained(demo_model, torch_dtype=torch.float32).eval()

    def vector(text: str | list[int]) -> np.ndarray:
        ids = text if isinstance(text, list) else token_ids(text)
        with torch.no_grad():
            last = model(torch.tensor([ids])).last_hidden_state[0, -1]
        return torch.nn.functional.normalize(last, dim=0).numpy()
    return vector


def assert_vectors(got: list[list[float]], texts: list[str | list[int]], reference) -> None:
    assert len(got) == len(texts)
    for vector, text in zip(got, texts):
        np.testing.assert_allclose(vector, reference(text), rtol=0, atol=ATOL)


def test_the_sdk_s_vectors_are_transformers_pooling(client, reference, token_ids) -> None:
    """The SDK's default asks for base64 (float32 little-endian, which it decodes); encoding_format="float" gives
    the same numbers as JSON; a list comes back in input order with its prompt tokens counted."""
    raw = client.embeddings.with_raw_response.create(model=MODEL_NAME, input=TEXTS, user="someone")
    wire, listed = raw.http_response.json(), raw.parse()
    assert [item["index"] for item in wire["data"]] == [0, 1, 2] and isinstance(wire["data"][0]["embedding"], str)
    decoded = [np.frombuffer(base64.b64decode(item["embedding"]), "<f4") for item in wire["data"]]
    assert [d.tolist() for d in decoded] == [item.embedding for item in listed.data]
    assert_vectors([item.embedding for item in listed.data], TEXTS, reference)
    assert listed.model == MODEL_NAME and listed.object == "list"
    assert listed.usage.prompt_tokens == listed.usage.total_tokens == sum(len(token_ids(t)) for t in TEXTS)
    floats = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0], encoding_format="float")
    assert floats.data[0].embedding == listed.data[0].embedding  # float32 either way: equal to the bit


def test_token_ids_are_inputs_too(client, reference, token_ids) -> None:
    one = token_ids(TEXTS[0])
    assert_vectors([client.embeddings.create(model=MODEL_NAME, input=one, encoding_format="float").data[0].embedding],
                   [one], reference)
    several = [token_ids(t) for t in TEXTS[1:]]
    assert_vectors([item.embedding for item in client.embeddings.create(model=MODEL_NAME, input=several).data],
                   several, reference)


def test_langchain_embeddings(roomy_stack: LocalStack, reference) -> None:
    """check_embedding_ctx_length=False: LangChain's default splits texts with tiktoken, which downloads its
    encoding (and counts another tokenizer's tokens)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    embedder = langchain_openai.OpenAIEmbeddings(model=MODEL_NAME, base_url=f"{roomy_stack.url}/v1", api_key=API_KEY,
                                                 check_embedding_ctx_length=False, max_retries=0)
    assert_vectors(embedder.embed_documents(TEXTS), TEXTS, reference)
    assert_vectors([embedder.embed_query(TEXTS[1])], [TEXTS[1]], reference)


# ---- in process: the gateway on the memory broker, the demo engine (or a fake one) behind it --------------------
@pytest.fixture
async def served(tokenizer, request) -> AsyncIterator[tuple[TestClient, MemoryBus, Gateway]]:
    bus = MemoryBus()
    config = GatewayConfig(engine_poll_s=0.05, api_keys=(API_KEY, OTHER_KEY), **getattr(request, "param", {}))
    gateway = Gateway(config, tokenizer, MODEL_NAME, 2048, MemoryGatewayBroker(bus, config))
    async with TestClient(TestServer(build_app(gateway))) as client:
        yield client, bus, gateway


@pytest.mark.parametrize("served", [{"max_pending_requests": 2}], indirect=True)
async def test_a_batch_is_admitted_once_whatever_its_size(served) -> None:
    """More inputs than --max-pending-requests (LangChain sends 1,000 at a time) still get their vectors."""
    client, bus, _ = served
    async with running(memory_worker(bus, FakeEngine())):
        await ready(client)
        code, answer = await embed(client, {"input": [[i + 1] for i in range(7)], "encoding_format": "float"})
    assert code == 200 and [item["embedding"] for item in answer["data"]] == [[i + 1.0] for i in range(7)]


async def embed(client: TestClient, body: dict, key: str = API_KEY) -> tuple[int, dict]:
    response = await client.post("/v1/embeddings", json=body, headers={"Authorization": f"Bearer {key}"})
    return response.status, await response.json()


def refused_bodies(context: int) -> list[tuple[dict, int, str]]:
    """(body, status, the field named): each refusal after a good first input, which must not be queued either."""
    good, long_text = TEXTS[0], " ".join(["Friday"] * (context + 1))  # a token a word; far below the character cap
    return [({"input": ""}, 400, "input"), ({"input": []}, 400, "input"), ({"input": [good, ""]}, 400, "input"),
            ({"input": [[]]}, 400, "input"), ({"input": [good] * 2049}, 400, "input"),
            ({"input": [good, long_text]}, 400, "input[1]"), ({"input": [5] * (context + 1)}, 400, "input"),
            ({"input": [[5, 6], [5] * (context + 1)]}, 400, "input[1]"),
            ({"input": [[5, 6], [5, 512]]}, 400, "input[1]"),  # the demo vocabulary's 512 ids end at 511
            ({"input": good, "encoding_format": "int8"}, 400, "encoding_format"),
            ({"input": good, "dimensions": 8}, 400, "dimensions"), ({"input": good, "model": "other"}, 404, "model")]


async def test_each_refused_body_names_its_field_and_queues_nothing(served) -> None:
    client, bus, gateway = served
    submitted = count_calls(gateway.broker, "submit")
    async with running(memory_worker(bus, FakeEngine())):
        await ready(client)
        for body, status, param in refused_bodies(2048):
            code, answer = await embed(client, body)
            assert (code, answer["error"]["param"]) == (status, param), answer
            assert answer["error"]["message"] and set(answer["error"]) == {"message", "type", "param", "code"}
        assert submitted[0] == 0
        code, answer = await embed(client, {"input": [[7, 8, 9], [3]], "encoding_format": "float"})
    assert code == 200 and submitted[0] == 2 and answer["model"] == MODEL_NAME  # no model: the served one
    # The fake engine's vector: the prompt's first ids.
    assert [item["embedding"] for item in answer["data"]] == [[7.0, 8.0, 9.0], [3.0]]


def test_dimensions_are_the_checkpoint_s_matryoshka_ones() -> None:
    """The gateway refuses what the engine would (PoolerConfig from the checkpoint's files), and /openapi.json says
    the same: a model without Matryoshka fields takes no dimensions; one with matryoshka_dimensions only those."""
    listed, plain = (PoolerConfig(hidden_size=64, is_matryoshka=True, matryoshka_dimensions=(16, 32)),
                     PoolerConfig(hidden_size=64))
    any_up_to_64 = PoolerConfig(hidden_size=64, is_matryoshka=True)
    served = lambda pooler: ServedModel(MODEL_NAME, 2048, None, pooler)
    for pooler, dimensions in ((listed, 32), (any_up_to_64, 64)):
        served(pooler).check_pooling(PoolingParams(dimensions=dimensions))
    for pooler, dimensions in ((listed, 24), (plain, 32), (None, 32), (any_up_to_64, 65)):
        with pytest.raises(APIError) as refused:
            served(pooler).check_pooling(PoolingParams(dimensions=dimensions))
        assert (refused.value.status, refused.value.param) == (400, "dimensions")
    schema = lambda pooler: openapi_document(MODEL_NAME, pooler=pooler)["paths"]["/v1/embeddings"]["post"][
        "requestBody"]["content"]["application/json"]["schema"]["properties"]["dimensions"]
    assert schema(listed)["enum"] == [16, 32] and schema(any_up_to_64)["maximum"] == 64
    assert schema(plain)["not"] == {} == schema(None)["not"]


async def test_another_key_shares_no_cached_prefix(served, demo_engine) -> None:
    """Each API key's prompts are cached under its own salt: the same text from another key hits nothing (no
    timing tells it what this key embedded), while this key's repeat hits the cache; the vector is the same."""
    client, bus, _ = served
    text = " ".join(["Tuesday comes after Monday."] * 12)
    found = []
    async with running(memory_worker(bus, demo_engine)):
        await ready(client)
        for key in (API_KEY, OTHER_KEY, API_KEY):
            hits = demo_engine.stats().prefix_cache_hits_total
            code, answer = await embed(client, {"input": text, "encoding_format": "float"}, key)
            found.append((answer["data"][0]["embedding"], demo_engine.stats().prefix_cache_hits_total - hits))
    (mine, first), (theirs, stranger), (again, repeat) = found
    assert first == stranger == 0 < repeat
    np.testing.assert_allclose([theirs, again], [mine, mine], rtol=0, atol=ATOL)


async def test_every_block_returns_after_a_batch_and_after_a_client_that_left(served, demo_engine) -> None:
    client, bus, gateway = served
    before = free_blocks(demo_engine)
    async with running(memory_worker(bus, demo_engine)):
        await ready(client)
        code, answer = await embed(client, {"input": [f"{t} {i}" for i in range(4) for t in TEXTS]})
        assert code == 200 and len(answer["data"]) == 12 and free_blocks(demo_engine) == before
        leaving = asyncio.ensure_future(embed(client, {"input": [f"{i} " + " ".join(["Friday"] * 300)
                                                                 for i in range(24)]}))
        await until(demo_engine.has_unfinished_requests)
        leaving.cancel()  # the client hangs up mid-request
        # Every request it queued has ended: the gateway let go of each, the engine ran or aborted each.
        await until(lambda: gateway.broker.num_subscriptions == 0 and not bus.queued[MODEL_NAME] and not bus.unacked
                    and not demo_engine.has_unfinished_requests())
    assert free_blocks(demo_engine) == before and bus.aborts
