"""Service fixtures: the demo model built once, a private redis-server, a
``LocalStack`` of worker and gateway processes started once, and in-process
workers on the memory broker for unit tests."""
from __future__ import annotations

import asyncio
import json
import os
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import fields, replace
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer

from engine import EngineConfig, LLMEngine
from engine.demo_model import write_demo_model
from engine.stats import EngineStats
from service.config import GatewayConfig, RedisConfig, WorkerConfig
from service.gateway import Gateway
from service.gateway_app import build_app
from service.flags import config_argv
from service.local_stack import LocalStack
from service.memory_broker import MemoryBus, MemoryGatewayBroker, MemoryWorkerBroker
from service.worker import Worker

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_NAME = "pagedserve-demo"
API_KEY = "test-key-123"
OTHER_KEY = "test-key-456"  # another tenant's (the roomy stack takes both)
START_TIMEOUT_S = 120
ENGINE = EngineConfig(num_device_blocks=96, max_num_seqs=8, num_threads=1, attention_backend="torch")
HEARTBEAT_FLAGS = ["--heartbeat-interval", "0.25", "--heartbeat-ttl", "2"]
# A client that hangs up mid-stream has its request aborted 1 s later, not 10: no test resumes a stream on these
# stacks, and the disconnect tests wait for the abort.
RECONNECT_FLAGS = ["--reconnect-grace", "1"]


def get_json(url: str, api_key: str | None = API_KEY) -> tuple[int, dict]:
    return _json_call(urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {}))


def post_json(url: str, body: dict, api_key: str = API_KEY) -> tuple[int, dict]:
    return _json_call(urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers={
        "Authorization": f"Bearer {api_key}", "Content-Type": "application/json"}))


def _json_call(request: urllib.request.Request) -> tuple[int, dict]:
    """(status, JSON body) of a request, an HTTP error's too."""
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def get_text(url: str) -> str:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read().decode()


def engine_stats(**figures: float) -> EngineStats:
    """An engine's figures: zero but for ``figures``."""
    return EngineStats(**{f.name: 0 for f in fields(EngineStats)} | figures)


def local_stack(model: str, num_workers: int, num_gateways: int, engine: EngineConfig = ENGINE,
                redis_url: str | None = None, worker_flags: tuple[str, ...] = (),
                gateway_flags: tuple[str, ...] = ()) -> LocalStack:
    """Workers (engine ids w0, w1, ...) and gateways on the demo model; the API key in the environment. On the
    stack's own redis-server, or on ``redis_url`` (a Sentinel set, a Cluster)."""
    stack = LocalStack(env={"PAGEDSERVE_API_KEY": API_KEY}, cwd=ROOT)
    common = ["--model", model, "--served-model-name", MODEL_NAME, "--log-level", "WARNING"]
    for i in range(num_workers):
        stack.add_worker([*common, *config_argv(engine), *HEARTBEAT_FLAGS, "--engine-id", f"w{i}", *worker_flags],
                         redis_url=redis_url)
    for _ in range(num_gateways):
        stack.add_gateway([*common, *RECONNECT_FLAGS, *gateway_flags], redis_url=redis_url)
    return stack


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    with LocalStack() as redis_only:
        yield redis_only.redis_url


@pytest.fixture
def redis_config(redis_url: str) -> RedisConfig:
    """A fresh key prefix per test on the session's redis-server."""
    return RedisConfig(url=redis_url, prefix=f"t{uuid.uuid4().hex[:8]}", block_ms=50)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_demo_model(str(tmp_path_factory.mktemp("model") / "demo"))


@pytest.fixture(scope="session")
def stack(demo_model: str) -> Iterator[LocalStack]:
    """Two gateways and two workers on their own Redis, shared by the end-to-end tests."""
    with local_stack(demo_model, num_workers=2, num_gateways=2) as stack:
        stack.wait_ready(START_TIMEOUT_S)
        yield stack


@pytest.fixture(scope="session")
def roomy_stack(demo_model: str) -> Iterator[LocalStack]:
    """One gateway and one worker whose KV pool holds several long requests at once (the structured-output
    and tools tests: a tools listing alone is ~860 tokens of the demo tokenizer, which never saw JSON)."""
    roomy = replace(ENGINE, num_device_blocks=512)
    with local_stack(demo_model, num_workers=1, num_gateways=1, engine=roomy,
                     gateway_flags=("--api-key", API_KEY, "--api-key", OTHER_KEY)) as stack:
        stack.wait_ready(START_TIMEOUT_S)
        yield stack


@pytest.fixture(scope="session")
def demo_engine(demo_model: str) -> LLMEngine:
    """One real engine for the unit tests; each test leaves it idle."""
    return LLMEngine(EngineConfig(model=demo_model, num_device_blocks=64, attention_backend="torch",
                                  num_threads=1, show_progress=False))


def memory_worker(bus: MemoryBus, engine: Any) -> Worker:
    config = WorkerConfig(engine_id="w0", heartbeat_interval_s=0.05, heartbeat_ttl_s=1.0)
    return Worker(config, engine, MODEL_NAME, MemoryWorkerBroker(bus, config.engine_id, MODEL_NAME,
                                                                 config.heartbeat_ttl_s, block_s=0.02))


@asynccontextmanager
async def running(worker: Worker) -> AsyncIterator[asyncio.Task]:
    """The worker's run, stopped on exit; the task tells how it ended (an exit code, an exception)."""
    task = asyncio.create_task(worker.run())
    try:
        yield task
    finally:
        worker.stop()
        await asyncio.wait_for(task, 5)


async def until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Until ``condition()`` holds; the timeout only ends a test that would hang (a slow machine is no failure)."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.01)

    await asyncio.wait_for(poll(), timeout_s)


def count_calls(obj: object, name: str) -> list[int]:
    """Counts the calls of ``obj``'s async method ``name`` from now on (the list's one item): a test waits for
    some more (a worker's polls, a gateway's beats), not for a time in which they may or may not happen."""
    calls, method = [0], getattr(obj, name)

    async def counted(*args, **kwargs):
        result = await method(*args, **kwargs)
        calls[0] += 1
        return result

    setattr(obj, name, counted)
    return calls


@pytest.fixture(scope="module")
def tokenizer(demo_model: str):
    return AutoTokenizer.from_pretrained(demo_model)


@asynccontextmanager
async def gateway_client(config: GatewayConfig, tokenizer: Any, bus: MemoryBus,
                         context: int = 2048) -> AsyncIterator[TestClient]:
    """An in-process gateway over the memory broker, with an HTTP test client."""
    gateway = Gateway(config, tokenizer, MODEL_NAME, context, MemoryGatewayBroker(bus, config))
    async with TestClient(TestServer(build_app(gateway))) as client:
        yield client
