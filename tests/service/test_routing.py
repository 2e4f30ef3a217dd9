"""Prefix-aware routing across engines, with real processes (redis-server, two workers, one gateway):
follow-ups of a prompt land on the engine that caches it; the gateway's block hashes are the engine's;
an engine that stops reading has its routed requests stolen, one killed mid-stream has them resumed (the
text equal to an undisturbed run); a stale summary only costs a cache miss."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import random
import signal
import time

import aiohttp
import pytest
import redis

from engine.core.kv_cache_manager import KVCacheManager
from service.local_stack import LocalStack
from service.redis_keys import PREFIX_KEY_BYTES, Keys
from service.routing import RecentPrefixes, choose_engine, leading_hits, prompt_block_keys
from tests.service.conftest import API_KEY, MODEL_NAME, START_TIMEOUT_S, get_json, local_stack
from tests.service.test_e2e import AUTH, post

SECRET = "routing-test-secret"
BLOCK = 16
def random_tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(count)]


PREFIX = random_tokens(7, 160)  # 10 full blocks


def tenant_salt(request_salt: str = "") -> str:
    """The gateway's cache salt for API_KEY (tests/service run the gateways with --prefix-cache-secret)."""
    return hmac.new(SECRET.encode(), API_KEY.encode(), hashlib.sha256).hexdigest() + request_salt


def test_the_gateway_hashes_blocks_as_the_engine_caches_them() -> None:
    kv = KVCacheManager(num_device_blocks=32, num_cpu_blocks=0, block_size=BLOCK, enable_caching=True)
    prompt = PREFIX + [9, 9, 9]
    salt = tenant_salt("x")
    kv.admit(0, [], salt.encode(), len(prompt), None)
    kv.append(0, len(prompt))
    kv.mark_computed(0, len(prompt), prompt)
    keys = prompt_block_keys(prompt, salt, BLOCK, PREFIX_KEY_BYTES)
    assert len(keys) == 10 and set(keys) == {h[:PREFIX_KEY_BYTES] for h in kv.cached_block_hashes()}
    assert prompt_block_keys(prompt, None, BLOCK, PREFIX_KEY_BYTES)[0] not in keys  # another tenant's blocks
    assert prompt_block_keys(PREFIX[:16], salt, BLOCK, PREFIX_KEY_BYTES) == []  # the last token's block is never
    assert leading_hits([1, 1, 0, 1]) == 2


def test_choose_engine_weighs_hits_against_queues() -> None:
    assert choose_engine({"a": 160, "b": 32}, {"a": 0, "b": 0}, slack=2) == "a"
    assert choose_engine({"a": 160, "b": 32}, {"a": 5, "b": 1}, slack=2) == "b"  # a is too busy
    assert choose_engine({"a": 160}, {"a": 5, "b": 1}, slack=2) is None  # only a busy hit: the shared stream
    assert choose_engine({"a": 0, "b": 0}, {"a": 0, "b": 0}, slack=2) is None


def test_recent_prefixes_remember_who_took_a_block_for_a_while(monkeypatch) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    recent = RecentPrefixes(capacity=3, ttl_s=5.0)
    recent.record([b"a", b"b"], "e1")
    recent.record([b"b", b"c"], "e2")  # the latest taker owns a key
    assert recent.holds([b"a", b"b", b"c"], "e1") == [True, False, False]
    assert recent.holds([b"a", b"b", b"c"], "e2") == [False, True, True]
    recent.record([b"d"], "e1")  # over capacity: the least recently recorded key goes
    assert recent.holds([b"a", b"d"], "e1") == [False, True]
    now[0] += 5.1  # past the TTL the engine's own summary speaks for the block
    assert recent.holds([b"d"], "e1") == [False]


@pytest.fixture(scope="module")
def routed_stack(demo_model: str):
    stack = local_stack(demo_model, num_workers=2, num_gateways=0)
    stack.add_gateway(["--model", demo_model, "--served-model-name", MODEL_NAME, "--log-level", "WARNING",
                       "--prefix-cache-secret", SECRET, "--engine-poll", "0.2"])
    with stack:
        stack.wait_ready(START_TIMEOUT_S)
        yield stack


def complete(stack: LocalStack, prompt: list[int], max_tokens: int = 2) -> dict:
    status, body = asyncio.run(post(f"{stack.url}/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}))
    assert status == 200, body
    return body


def holder(stack: LocalStack, prompt: list[int]) -> tuple[int, int]:
    """(index of the worker whose prefix set holds the most of ``prompt``'s leading blocks, that count)."""
    client, keys = redis.Redis.from_url(stack.redis_url), Keys("pagedserve")
    block_keys = prompt_block_keys(prompt, tenant_salt(), BLOCK, PREFIX_KEY_BYTES)
    hits = [leading_hits(client.smismember(keys.prefixes(f"w{i}"), block_keys)) for i in range(2)]
    return max(range(2), key=hits.__getitem__), max(hits)


def entries_read(stack: LocalStack, worker: int) -> int:
    client = redis.Redis.from_url(stack.redis_url)
    groups = client.xinfo_groups(Keys("pagedserve").routed(MODEL_NAME, f"w{worker}"))
    return groups[0]["entries-read"] or 0


def wait_for_summary(stack: LocalStack, prompt: list[int]) -> int:
    deadline = time.monotonic() + 10
    while (found := holder(stack, prompt))[1] < 10:
        assert time.monotonic() < deadline, "the engine's prefix set never showed the prompt's blocks"
        time.sleep(0.1)
    return found[0]


def both_engines_live(stack: LocalStack) -> None:
    """Until the gateway sees both engines: one it does not (a heartbeat late on a loaded machine, a failed read
    of the beats) gets no routed request, which would then go to the shared stream."""
    deadline = time.monotonic() + 30
    while get_json(f"{stack.url}/ready")[1].get("engines") != 2:
        assert time.monotonic() < deadline, "the gateway never saw both engines"
        time.sleep(0.05)


def cached_tokens_of_follow_up(stack: LocalStack, prompt: list[int]) -> int:
    both_engines_live(stack)
    return complete(stack, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_follow_ups_go_to_the_engine_that_caches_the_prefix(routed_stack: LocalStack) -> None:
    assert complete(routed_stack, PREFIX + [1])["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_for_summary(routed_stack, PREFIX + [1])
    # Pulled from a shared queue, about half would land on the other engine (all ten hits: 0.1% by chance).
    cached = [cached_tokens_of_follow_up(routed_stack, PREFIX + [suffix, 5]) for suffix in range(2, 12)]
    assert cached == [160] * 10, cached


def test_a_follow_up_before_the_engines_summary_goes_where_its_prefix_went(routed_stack: LocalStack) -> None:
    """A conversation's next turn comes before the engine's next heartbeat publishes the blocks: the gateway
    remembers which engine took the previous turn (a shared queue would miss half of these)."""
    prefix = random_tokens(13, 160)
    complete(routed_stack, prefix + [1])
    cached = [cached_tokens_of_follow_up(routed_stack, prefix + [suffix, 5]) for suffix in range(2, 8)]
    assert cached == [160] * 6, cached


def test_an_engine_that_stops_reading_has_its_routed_requests_taken(routed_stack: LocalStack) -> None:
    prefix = random_tokens(11, 160)  # its own: one engine holds it (an earlier follow-up may have missed)
    complete(routed_stack, prefix + [1])
    owner = wait_for_summary(routed_stack, prefix + [1])
    read_before = entries_read(routed_stack, owner)
    worker = routed_stack.workers[owner].process
    worker.send_signal(signal.SIGSTOP)  # alive to the gateway for its heartbeat TTL, reading nothing
    try:
        body = complete(routed_stack, prefix + [42, 43], max_tokens=4)
    finally:
        worker.send_signal(signal.SIGCONT)
    assert body["usage"]["completion_tokens"] == 4  # served while its engine was stopped: by the other one
    assert entries_read(routed_stack, owner) == read_before + 1  # routed to the stopped one, read by the other


def test_a_stale_summary_costs_only_a_miss(routed_stack: LocalStack) -> None:
    """A prompt the summary says an engine holds, which it does not: routed there, computed, same answer."""
    prompt = random_tokens(3, 70)
    expected = complete(routed_stack, prompt, max_tokens=6)["choices"][0]["text"]
    client, keys = redis.Redis.from_url(routed_stack.redis_url), Keys("pagedserve")
    other = random_tokens(4, 70)
    lie = prompt_block_keys(other, tenant_salt(), BLOCK, PREFIX_KEY_BYTES)
    client.sadd(keys.prefixes("w0"), *lie)  # until w0's next beat rewrites its changes
    body = complete(routed_stack, other, max_tokens=6)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert complete(routed_stack, prompt, max_tokens=6)["choices"][0]["text"] == expected


async def streamed_text(url: str, body: dict, on_first_event) -> str:
    """The text of a streamed completion; ``on_first_event`` runs once tokens flow."""
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", json={**body, "stream": True}, headers=AUTH) as response:
            assert response.status == 200
            text, called = [], False
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
                if not called:
                    on_first_event()
                    called = True
    return "".join(text)


def test_an_engine_killed_mid_stream_has_its_routed_requests_resumed(routed_stack: LocalStack) -> None:
    prefix = random_tokens(12, 160)
    complete(routed_stack, prefix + [1])
    owner = wait_for_summary(routed_stack, prefix + [1])
    body = {"model": MODEL_NAME, "prompt": prefix + [77], "max_tokens": 120, "temperature": 0.0, "ignore_eos": True}
    child = routed_stack.workers[owner]
    text = asyncio.run(streamed_text(routed_stack.url, body, lambda: routed_stack.kill(child)))
    try:
        assert text == complete(routed_stack, prefix + [77], max_tokens=120)["choices"][0]["text"]
    finally:
        routed_stack.restart(child)
