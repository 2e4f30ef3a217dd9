"""A hostile tenant against real processes (redis-server, an engine worker, a gateway), with several keys:
key B can neither see nor change anything of key A's streams, a poisoned request costs its key nothing,
and every malformed input is a 400 in OpenAI's shape, never a 5xx."""
from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from service.local_stack import LocalStack
from tests.service.conftest import HEARTBEAT_FLAGS, MODEL_NAME, ROOT, START_TIMEOUT_S
from engine import EngineConfig
from service.flags import config_argv

A, B, LIMITED, ADMIN = "sk-tenant-a", "sk-tenant-b", "sk-tenant-limited", "sk-admin"
ENGINE = EngineConfig(num_device_blocks=256, max_num_seqs=8, num_threads=1, attention_backend="torch")
# Long enough that key B's tries all land while A's stream is live (a few ms a token on the demo model).
LONG = {"model": MODEL_NAME, "prompt": "The days of the week are", "max_tokens": 600, "temperature": 0.0,
        "ignore_eos": True, "stream": True}
LONE = "\\udcff"  # a lone surrogate, as a JSON escape: valid JSON, but no text can be made of it


@pytest.fixture(scope="module")
def tenants(demo_model: str) -> Iterator[str]:
    env = {"PAGEDSERVE_API_KEY": f"{A},{B},{LIMITED}", "PAGEDSERVE_ADMIN_KEY": ADMIN,
           "PAGEDSERVE_KEY_POLICY": f"{LIMITED}:max_concurrent=2"}
    common = ["--model", demo_model, "--served-model-name", MODEL_NAME, "--log-level", "WARNING"]
    with LocalStack(env=env, cwd=ROOT) as stack:
        stack.add_worker([*common, *config_argv(ENGINE), *HEARTBEAT_FLAGS, "--engine-id", "w0"])
        stack.add_gateway(common)
        stack.wait_ready(START_TIMEOUT_S)
        yield stack.url


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def auth(key: str, **headers: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **headers}


def sse_text(raw: bytes) -> tuple[str, list[dict]]:
    """The stream's text and its error events."""
    text, errors = [], []
    for frame in raw.decode().split("\n\n"):
        data = [line[6:] for line in frame.split("\n") if line.startswith("data: ")]
        if not data or data[0] == "[DONE]":
            continue
        body = json.loads(data[0])
        if "error" in body:
            errors.append(body["error"])
        else:
            text += [c["text"] for c in body["choices"]]
    return "".join(text), errors


async def undisturbed_text(http: aiohttp.ClientSession, url: str) -> str:
    async with http.post(f"{url}/v1/completions", json=LONG, headers=auth(A)) as response:
        text, errors = sse_text(await response.read())
    assert not errors
    return text


async def test_another_key_cannot_freeze_or_take_over_a_live_stream(tenants, http) -> None:
    reference = await undisturbed_text(http, tenants)
    async with http.post(f"{tenants}/v1/completions", json=LONG, headers=auth(A)) as stream:
        first = await stream.content.readuntil(b"\n\n")  # it runs
        request_id = stream.headers["X-Request-Id"]  # the resume token, without id: lines
        for _ in range(3):  # each of B's ways in, while A's stream runs
            tries = [http.get(f"{tenants}/v1/streams/{request_id}", headers=auth(B)),
                     http.get(f"{tenants}/v1/streams/{request_id}", headers=auth(B, **{"Last-Event-ID": f"{request_id}:0"})),
                     http.post(f"{tenants}/v1/completions", json=LONG,
                               headers=auth(B, **{"Last-Event-ID": f"{request_id}:0"}))]
            for attempt in tries:
                async with attempt as refused:
                    assert refused.status == 404 and (await refused.json())["error"]["code"] == "stream_not_found"
        rest = await stream.read()
    text, errors = sse_text(first + rest)
    assert not errors and text == reference and rest.endswith(b"data: [DONE]\n\n")


async def snapshot_requests(http: aiohttp.ClientSession, url: str, key: str) -> list[dict]:
    """The engine's snapshot's requests as ``key`` sees them, once the snapshot shows a request."""
    for _ in range(300):
        async with http.get(f"{url}/v1/kv_snapshot", headers=auth(key)) as response:
            assert response.status == 200
            snapshot = (await response.json())["snapshot"]
        if snapshot is not None and snapshot["requests"]:
            return snapshot["requests"]
        await asyncio.sleep(0.05)
    raise AssertionError("the KV snapshot never showed the running request")


async def test_the_kv_snapshot_hides_other_tenants_ids(tenants, http) -> None:
    async with http.post(f"{tenants}/v1/completions", json=LONG, headers=auth(A)) as stream:
        await stream.content.readuntil(b"\n\n")  # it runs
        request_id = stream.headers["X-Request-Id"]  # the resume token, without id: lines
        seen_by = {key: await snapshot_requests(http, tenants, key) for key in (B, A, ADMIN)}
        stream.close()
    assert [r["id"] for r in seen_by[B]] == [""] and base64.b64decode(seen_by[B][0]["blocks"])  # blocks, no id
    assert [r["id"] for r in seen_by[A]] == [request_id] == [r["id"] for r in seen_by[ADMIN]]


async def test_metrics_need_an_admin_key_once_there_is_one(tenants, http) -> None:
    async with http.get(f"{tenants}/metrics", headers=auth(A)) as tenant, \
            http.get(f"{tenants}/metrics", headers=auth(ADMIN)) as admin:
        assert tenant.status == 403 and (await tenant.json())["error"]["code"] == "admin_key_required"
        assert admin.status == 200 and "vllm:num_requests_running" in await admin.text()


async def test_poisoned_requests_cost_their_key_no_slot(tenants, http) -> None:
    body = json.dumps({"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "cache_salt": "SALT"})
    for _ in range(10):
        async with http.post(f"{tenants}/v1/completions", data=body.replace("SALT", LONE),
                             headers=auth(LIMITED)) as poisoned:
            assert poisoned.status == 400 and (await poisoned.json())["error"]["code"] == "invalid_unicode"
    for _ in range(3):  # more than max_concurrent in a row: each slot came back
        async with http.post(f"{tenants}/v1/completions", data=body.replace("SALT", "ok"),
                             headers=auth(LIMITED)) as fine:
            assert fine.status == 200, await fine.text()


POISONED = [
    ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"hi {LONE}"}]}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": f"hi {LONE}"}),
    ("/tokenize", {"model": MODEL_NAME, "prompt": f"hi {LONE}"}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "cache_salt": LONE}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "guided_choice": ["yes", LONE]}),
    ("/v1/completions", {"model": MODEL_NAME, "prompt": "hi", f"x{LONE}": 1}),
]


@pytest.mark.parametrize("route, body", POISONED, ids=lambda v: v if isinstance(v, str) else "")
async def test_lone_surrogates_are_a_400(tenants, http, route, body) -> None:
    raw = json.dumps(body).replace("\\\\udcff", LONE)  # json.dumps escaped the backslash: undo it
    async with http.post(f"{tenants}{route}", data=raw, headers=auth(A)) as response:
        error = (await response.json())["error"]
    assert response.status == 400 and error["code"] == "invalid_unicode"
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("last_event_id", ["cmpl-" + "0" * 32 + ":" + "9" * 5000, "cmpl-" + "0" * 32 + ":\u00b2",
                                           "cmpl-" + "0" * 32 + ":", ":7", "x:1:2"])
async def test_a_malformed_last_event_id_is_a_400(tenants, http, last_event_id) -> None:
    request_id = "cmpl-" + "0" * 32
    for call in (http.get(f"{tenants}/v1/streams/{request_id}", headers=auth(A, **{"Last-Event-ID": last_event_id})),
                 http.post(f"{tenants}/v1/completions", json=LONG, headers=auth(A, **{"Last-Event-ID": last_event_id}))):
        async with call as response:
            assert response.status == 400 and (await response.json())["error"]["code"] == "invalid_last_event_id"


async def test_the_gateways_work_is_capped_not_just_the_text(tenants, http) -> None:
    """A 1 MB /tokenize prompt, or 31,755 empty messages (< 1 MiB), are refused before tokenizing."""
    huge = {"model": MODEL_NAME, "prompt": "a" * 1_000_000}
    empty = {"model": MODEL_NAME, "messages": [{"role": "user", "content": ""}] * 31_755, "max_tokens": 1}
    for route, body in (("/tokenize", huge), ("/v1/chat/completions", empty),
                        ("/tokenize", {"model": MODEL_NAME, "messages": empty["messages"]})):
        async with http.post(f"{tenants}{route}", json=body, headers=auth(A)) as response:
            error = (await response.json())["error"]
            assert response.status == 400 and error["code"] == "context_length_exceeded", error
    async with http.post(f"{tenants}/detokenize", json={"model": MODEL_NAME, "tokens": [1] * 5000},
                         headers=auth(A)) as response:
        assert response.status == 400
