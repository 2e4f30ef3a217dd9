"""Service fixtures: a private redis-server on a free port, the demo model
built once, and a stack of worker and gateway processes started once."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

import pytest

from engine.config import EngineConfig
from engine.demo_model import write_demo_model
from engine.stats import EngineStats
from service.flags import engine_argv

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL_NAME = "pagedserve-demo"
API_KEY = "test-key-123"
START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, api_key: str | None = API_KEY) -> tuple[int, dict]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
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


def stop_process(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (apt-get install redis-server)")
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(workdir)], stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline or process.poll() is not None:
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    stop_process(process)


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_demo_model(str(tmp_path_factory.mktemp("model") / "demo"))


ENGINE = EngineConfig(num_device_blocks=96, max_num_seqs=8, num_threads=1, attention_backend="torch")
WORKER_FLAGS = [*engine_argv(ENGINE), "--heartbeat-interval", "0.25", "--heartbeat-ttl", "2"]


def spawn(command: str, redis_url: str, prefix: str, model: str, *flags: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "service.cli", command, "--redis-url", redis_url, "--redis-prefix", prefix,
            "--model", model, "--served-model-name", MODEL_NAME, "--log-level", "WARNING", *flags]
    env = {**os.environ, "PAGEDSERVE_API_KEY": API_KEY}
    return subprocess.Popen(argv, cwd=ROOT, env=env)


def wait_ready(base_url: str, processes: list[subprocess.Popen], engines: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            pytest.fail("a service process exited during startup")
        try:
            status, body = get_json(f"{base_url}/ready")
            if status == 200 and body["engines"] >= engines:
                return
        except OSError:
            pass
        time.sleep(0.25)
    pytest.fail(f"{base_url} not ready after {START_TIMEOUT_S}s")


@dataclass
class Stack:
    """Worker and gateway processes sharing one Redis prefix."""

    gateways: list[str]  # base URLs
    workers: list[subprocess.Popen]
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.gateways[0]


def start_stack(redis_url: str, prefix: str, model: str, num_gateways: int, num_workers: int) -> Stack:
    workers = [spawn("worker", redis_url, prefix, model, *WORKER_FLAGS, "--engine-id", f"{prefix}-w{i}")
               for i in range(num_workers)]
    ports = [free_port() for _ in range(num_gateways)]
    gateways = [spawn("gateway", redis_url, prefix, model, "--port", str(p)) for p in ports]
    stack = Stack([f"http://127.0.0.1:{p}" for p in ports], workers, workers + gateways)
    for url in stack.gateways:
        wait_ready(url, stack.processes, num_workers)
    return stack


@pytest.fixture(scope="session")
def stack(redis_url: str, demo_model: str) -> Iterator[Stack]:
    """Two gateways and two workers on one Redis, shared by the end-to-end tests."""
    stack = start_stack(redis_url, "main", demo_model, num_gateways=2, num_workers=2)
    yield stack
    for process in stack.processes:
        stop_process(process)
