"""Redis high availability with real processes: a Sentinel-managed primary SIGKILLed mid-stream (its replica
promoted, lacking the last writes), and a 3-primary Redis Cluster under the end-to-end checks."""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import aiohttp
import pytest

from loadtest.chaos import judge
from loadtest.stream_client import Outcome, completion_body, sse_stream
from service.local_stack import LocalStack, free_port
from tests.service.conftest import API_KEY, MODEL_NAME, START_TIMEOUT_S, local_stack
from tests.service.redis_ha import Cluster, SentinelSet, until
from tests.service.test_e2e import (hf_greedy, test_chat_stream_matches_chat_template_and_framing,  # noqa: F401
                                    test_client_disconnect_returns_blocks, test_completion_matches_transformers,
                                    test_openai_client_async, test_openai_client_sync, tokenizer)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [f"failover {i}: the paged cache" for i in range(4)]
MAX_TOKENS = 300
# Beats that outlive the failover: no expired key tells the processes that Redis changed, the server does.
WORKER_FLAGS = ("--heartbeat-ttl", "10", "--redis-block-ms", "200")
GATEWAY_FLAGS = ("--gateway-ttl", "10", "--engine-poll", "0.2", "--redis-block-ms", "200")


async def streams(url: str, prompts: list[str]) -> list[Outcome]:
    outcomes = [Outcome(p) for p in prompts]
    async with aiohttp.ClientSession(headers=AUTH, timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(sse_stream(session, "POST", f"{url}/v1/completions", o,
                                          completion_body(MODEL_NAME, o.prompt, MAX_TOKENS)) for o in outcomes))
    return outcomes


def test_a_sentinel_failover_mid_stream_loses_and_duplicates_nothing(demo_model: str) -> None:
    """The Sentinel URL names a port where no Sentinel listens first: discovery moves on to the next."""
    with SentinelSet() as sentinels:
        url = sentinels.url.replace("://", f"://127.0.0.1:{free_port()},")  # no Sentinel there
        with local_stack(demo_model, 1, 1, redis_url=url, worker_flags=WORKER_FLAGS,
                         gateway_flags=GATEWAY_FLAGS) as stack:
            stack.wait_ready(START_TIMEOUT_S)
            expected = {o.prompt: o.text for o in asyncio.run(streams(stack.url, PROMPTS))}
            assert all(expected.values())
            outcomes = asyncio.run(failover_during(stack, sentinels))
    assert all(o.done for o in outcomes), [o.error for o in outcomes]
    assert [judge(o, expected[o.prompt]) for o in outcomes] == [(0, 0)] * len(PROMPTS)
    assert [o.text for o in outcomes] == [expected[p] for p in PROMPTS]


async def failover_during(stack: LocalStack, sentinels: SentinelSet) -> list[Outcome]:
    """The streams, with the primary SIGKILLed once each has some text (none finished); the replica
    promoted lacks the last writes."""
    outcomes = [Outcome(p) for p in PROMPTS]
    async with aiohttp.ClientSession(headers=AUTH, timeout=aiohttp.ClientTimeout(total=60)) as session:
        tasks = [asyncio.create_task(sse_stream(session, "POST", f"{stack.url}/v1/completions", o,
                                                completion_body(MODEL_NAME, o.prompt, MAX_TOKENS)))
                 for o in outcomes]
        while not all(o.text for o in outcomes):
            await asyncio.sleep(0.02)
        assert not any(o.done or o.error for o in outcomes), "a stream ended before the failover"
        # The gateway stalls while the replica stops receiving writes: the replies the engine publishes
        # meanwhile reach neither (only the engine has them) when the primary dies.
        gateway = stack.gateways[0].process
        gateway.send_signal(signal.SIGSTOP)
        sentinels.hold_replication()
        await asyncio.sleep(0.3)
        sentinels.kill_primary()
        gateway.send_signal(signal.SIGCONT)
        await asyncio.to_thread(until, sentinels.promoted, "the replica was not promoted", 30)
        await asyncio.gather(*tasks)
    return outcomes


@pytest.fixture(scope="module")
def stack(demo_model: str) -> Iterator[LocalStack]:
    """The end-to-end tests imported above run on this module's stack: a worker and a gateway on a
    3-primary Redis Cluster."""
    with Cluster() as cluster, local_stack(demo_model, 1, 1, redis_url=cluster.url) as on_cluster:
        on_cluster.wait_ready(START_TIMEOUT_S)
        yield on_cluster
