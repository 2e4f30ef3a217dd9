"""Redis high availability with real processes: a Sentinel-managed primary SIGKILLed mid-stream (its replica
promoted, lacking the last writes), and a 3-primary Redis Cluster under the end-to-end checks."""
from __future__ import annotations

import asyncio
import importlib.util
import signal
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from loadtest.chaos import judge
from loadtest.stream_client import Outcome, completion_body, sse_stream
from service.config import RedisConfig
from service.local_stack import LocalStack, free_port
from service.redis_url import RedisNodes
from tests.service import test_e2e, test_sse_resume
from tests.service.conftest import API_KEY, MODEL_NAME, ROOT, START_TIMEOUT_S, local_stack
from tests.service.redis_ha import Cluster, SentinelSet, until

# Tests of other modules, collected here too: they run against this module's fixtures (the Cluster's).
tokenizer, hf_greedy = test_e2e.tokenizer, test_e2e.hf_greedy
test_completion_matches_transformers = test_e2e.test_completion_matches_transformers
test_chat_stream_matches_chat_template_and_framing = test_e2e.test_chat_stream_matches_chat_template_and_framing
test_openai_client_sync = test_e2e.test_openai_client_sync
test_openai_client_async = test_e2e.test_openai_client_async
test_client_disconnect_returns_blocks = test_e2e.test_client_disconnect_returns_blocks
test_resume_on_another_gateway_continues_the_text = test_sse_resume.test_resume_on_another_gateway_continues_the_text
test_a_client_bouncing_between_gateways_gets_the_whole_text_once = (
    test_sse_resume.test_a_client_bouncing_between_gateways_gets_the_whole_text_once)

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPTS = [f"failover {i}: the paged cache" for i in range(4)]
MAX_TOKENS = 300
# Beats that outlive the failover: no expired key tells the processes that Redis changed, the server does.
WORKER_FLAGS = ("--heartbeat-ttl", "60", "--redis-block-ms", "200")
GATEWAY_FLAGS = ("--gateway-ttl", "60", "--engine-poll", "0.2", "--redis-block-ms", "200")


def test_a_sentinel_failover_mid_stream_loses_and_duplicates_nothing(demo_model: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The Sentinel URL names a port where no Sentinel listens first: discovery moves on to the next."""
    with SentinelSet() as sentinels:
        url = sentinels.url.replace("://", f"://127.0.0.1:{free_port()},")  # no Sentinel there
        with local_stack(demo_model, 1, 1, redis_url=url, worker_flags=WORKER_FLAGS,
                         gateway_flags=GATEWAY_FLAGS) as stack:
            stack.wait_ready(START_TIMEOUT_S)
            expected = {o.prompt: o.text for o in asyncio.run(streams(stack))}
            assert all(expected.values())
            outcomes = asyncio.run(streams(stack, sentinels))
            assert container_probe(url, "w0", monkeypatch)  # the worker beats on the promoted replica
    assert all(o.done for o in outcomes), [o.error for o in outcomes]
    assert [judge(o, expected[o.prompt]) for o in outcomes] == [(0, 0)] * len(PROMPTS)  # (duplicated, lost)
    assert [o.text for o in outcomes] == [expected[p] for p in PROMPTS]


async def streams(stack: LocalStack, sentinels: SentinelSet | None = None) -> list[Outcome]:
    """Greedy streams of PROMPTS; with ``sentinels``, their primary is SIGKILLed once each stream has some
    text (none finished), and the replica promoted lacks the last writes."""
    outcomes = [Outcome(p) for p in PROMPTS]
    async with aiohttp.ClientSession(headers=AUTH, timeout=aiohttp.ClientTimeout(total=150)) as session:
        tasks = [asyncio.create_task(sse_stream(session, "POST", f"{stack.url}/v1/completions", o,
                                                completion_body(MODEL_NAME, o.prompt, MAX_TOKENS)))
                 for o in outcomes]
        if sentinels is not None:
            await fail_over(stack, sentinels, outcomes)
        await asyncio.gather(*tasks)
    return outcomes


async def fail_over(stack: LocalStack, sentinels: SentinelSet, outcomes: list[Outcome]) -> None:
    while not all(o.text for o in outcomes):
        await asyncio.sleep(0.02)
    assert not any(o.done or o.error for o in outcomes), "a stream ended before the failover"
    # The gateway stalls while the replica stops receiving writes: the replies the engine publishes
    # meanwhile reach neither (only the engine has them) when the primary dies.
    gateway = stack.gateways[0].process
    gateway.send_signal(signal.SIGSTOP)
    held = sentinels.proxy.delayed_chunks
    sentinels.hold_replication()
    await asyncio.to_thread(until, lambda: sentinels.proxy.delayed_chunks >= held + 5,
                            "the primary took no writes the replica lacks", 30)
    sentinels.kill_primary()
    gateway.send_signal(signal.SIGCONT)
    await asyncio.to_thread(sentinels.wait_promoted, 60)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with Cluster() as three_primaries:
        yield three_primaries


@pytest.fixture(scope="module")
def redis_url(cluster: Cluster) -> str:
    """The resume tests imported above (in-process gateways, a fake engine) run on the Cluster."""
    return cluster.url


@pytest.fixture(scope="module")
def stack(demo_model: str, cluster: Cluster) -> Iterator[LocalStack]:
    """The end-to-end tests imported above run on this module's stack: a worker and two gateways on the
    Cluster."""
    with local_stack(demo_model, 1, 2, redis_url=cluster.url) as on_cluster:
        on_cluster.wait_ready(START_TIMEOUT_S)
        yield on_cluster


def test_the_container_probe_finds_the_worker_on_the_cluster(stack: LocalStack, cluster: Cluster,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    assert container_probe(cluster.url, "w0", monkeypatch)
    assert not container_probe(cluster.url, "w9", monkeypatch)


def container_probe(url: str, engine_id: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    """docker/healthcheck.py's worker check (loaded from its file, as the image runs it)."""
    spec = importlib.util.spec_from_file_location("healthcheck", Path(ROOT) / "docker" / "healthcheck.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    monkeypatch.setenv("PAGEDSERVE_REDIS_URL", url)
    monkeypatch.setenv("PAGEDSERVE_ENGINE_ID", engine_id)
    return probe.worker_ok()


@pytest.mark.parametrize("url, nodes", [
    ("redis+sentinel://h1:26379,h2:26380/main", RedisNodes("sentinel", (("h1", 26379), ("h2", 26380)), "main")),
    ("redis+sentinel://u:p%40ss@h1:26379/main/2", RedisNodes("sentinel", (("h1", 26379),), "main", 2, "u", "p@ss")),
    ("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7000",
     RedisNodes("cluster", (("10.0.0.1", 7000), ("10.0.0.2", 7000)), password="pw")),
    ("redis://h1:6379/0", None), ("unix:///tmp/redis.sock", None), ("rediss://h1:6380", None)])
def test_sentinel_and_cluster_urls_are_read(url: str, nodes: RedisNodes | None) -> None:
    assert RedisConfig(url=url).nodes() == nodes


@pytest.mark.parametrize("url", ["redis+sentinel://h1:26379", "redis+sentinel://h1/main", "redis+sentinel:///main",
                                 "redis+cluster://h1:7000/main", "redis+sentinel://h1:1/main/0/x"])
def test_malformed_sentinel_and_cluster_urls_fail_at_start(url: str) -> None:
    with pytest.raises(ValueError):
        RedisConfig(url=url)


def test_the_url_credentials_are_the_datas_and_the_sentinels_have_their_own() -> None:
    config = RedisConfig(url="redis+sentinel://app:secret@h1:26379/main", sentinel_password="s3")
    assert config.connection_options() == {"username": "app", "password": "secret"}
    assert "secret" not in repr(config) and "s3" not in repr(config)


def test_the_cluster_spreads_the_streams_and_keeps_each_requests_keys_together(stack: LocalStack,
                                                                              cluster: Cluster) -> None:
    test_openai_client_sync(stack)
    keys = {port: [k.decode() for k in cluster.keys(port)] for port in cluster.ports}
    streams = {k: port for port, names in keys.items() for k in names if ":out:" in k or ":requests:" in k}
    assert len(streams) >= 3 and len(set(streams.values())) >= 2  # two gateways' out streams, a request stream
    by_request: dict[str, set[int]] = {}
    for port, names in keys.items():
        for name in names:
            if name.endswith("}"):
                by_request.setdefault(name[name.index("{"):], set()).add(port)
    assert by_request and all(len(ports) == 1 for ports in by_request.values())
