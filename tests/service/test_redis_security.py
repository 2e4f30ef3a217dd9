"""The broker's traffic through a least-privilege Redis ACL user and over TLS (rediss://), each against
a real redis-server of its own: a gateway and a worker in this process serve, stream and abort
completions, and the container probe finds the worker's heartbeat."""
from __future__ import annotations

import asyncio
import importlib.util
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from aiohttp.test_utils import TestClient, TestServer
from transformers import AutoTokenizer

from service.broker import ACL_COMMANDS, acl_rules
from service.config import GatewayConfig, RedisConfig, WorkerConfig
from service.redis_gateway import RedisGatewayBroker
from service.redis_worker import RedisWorkerBroker
from service.gateway import Gateway
from service.gateway_app import build_app
from service.local_stack import free_port
from service.worker import Worker
from tests.service.conftest import MODEL_NAME, ROOT, running

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
GREEDY = {"model": MODEL_NAME, "temperature": 0.0, "ignore_eos": True}


def start_redis(tmp_path: Path, *args: str) -> subprocess.Popen:
    server = subprocess.Popen(["redis-server", "--save", "", "--appendonly", "no", "--dir", str(tmp_path),
                               "--bind", "127.0.0.1", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    return server


def wait_listening(server: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(server.stdout.read().decode(errors="replace"))
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not listen")


def stop(server: subprocess.Popen) -> None:
    server.terminate()
    server.wait(timeout=10)


@pytest.fixture(scope="module")
def tokenizer(demo_model: str):
    return AutoTokenizer.from_pretrained(demo_model)


async def broker_traffic(config: RedisConfig, tokenizer, engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole completion, a streamed one, an aborted one, and the worker probe, all through ``config``."""
    worker_config = WorkerConfig(redis=config, engine_id=f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}",
                                 heartbeat_interval_s=0.05, heartbeat_ttl_s=2.0)
    worker = Worker(worker_config, engine, MODEL_NAME, RedisWorkerBroker(
        config, worker_config.engine_id, MODEL_NAME, reply_ttl_s=60, heartbeat_ttl_s=2.0))
    gateway_config = GatewayConfig(redis=config, engine_poll_s=0.05)
    gateway = Gateway(gateway_config, tokenizer, MODEL_NAME, 2048, RedisGatewayBroker(gateway_config))
    async with running(worker), TestClient(TestServer(build_app(gateway))) as client:
        while (await client.get("/ready")).status != 200:
            await asyncio.sleep(0.05)
        whole = await client.post("/v1/completions", json={**GREEDY, "prompt": "paged", "max_tokens": 4})
        assert whole.status == 200 and (await whole.json())["usage"]["completion_tokens"] == 4
        streamed = await client.post("/v1/completions", json={**GREEDY, "prompt": "kv", "max_tokens": 3,
                                                              "stream": True})
        assert (await streamed.read()).decode().rstrip().endswith("data: [DONE]")
        hung_up = await client.post("/v1/completions", json={**GREEDY, "prompt": "long", "max_tokens": 1500,
                                                             "stream": True})
        await hung_up.content.readline()
        hung_up.close()  # the gateway publishes an abort; the engine drops the request
        deadline = time.monotonic() + 20
        while engine.has_unfinished_requests():
            assert time.monotonic() < deadline, "the abort never reached the engine"
            await asyncio.sleep(0.05)
        assert await asyncio.to_thread(container_probe, config, monkeypatch)


def container_probe(config: RedisConfig, monkeypatch: pytest.MonkeyPatch) -> bool:
    """docker/healthcheck.py's worker check, with the worker's settings in its environment."""
    spec = importlib.util.spec_from_file_location("healthcheck", Path(ROOT) / "docker" / "healthcheck.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    monkeypatch.delenv("PAGEDSERVE_ENGINE_ID", raising=False)  # found by hostname, through SMEMBERS
    env = {"PAGEDSERVE_REDIS_URL": config.url, "PAGEDSERVE_REDIS_PREFIX": config.prefix,
           "PAGEDSERVE_REDIS_USERNAME": config.username, "PAGEDSERVE_REDIS_PASSWORD": config.password,
           "PAGEDSERVE_REDIS_SSL_CA": config.ssl_ca_certs, "PAGEDSERVE_REDIS_SSL_CERT": config.ssl_certfile,
           "PAGEDSERVE_REDIS_SSL_KEY": config.ssl_keyfile}
    for name, value in env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return probe.worker_ok()


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[int]:
    port = free_port()
    server = start_redis(tmp_path, "--port", str(port))
    try:
        wait_listening(server, port)
        yield port
    finally:
        stop(server)


async def test_an_acl_user_with_only_the_documented_commands_runs_the_broker(
        acl_redis: int, tokenizer, demo_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    prefix, password = f"t{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    admin = redis.Redis(port=acl_redis)
    admin.execute_command("ACL", "SETUSER", "pagedserve", "reset", "on", f">{password}", *acl_rules(prefix).split())
    admin.set("other:secret", "x")
    config = RedisConfig(url=f"redis://127.0.0.1:{acl_redis}/0", prefix=prefix, block_ms=200,
                         username="pagedserve", password=password)
    await broker_traffic(config, tokenizer, demo_engine, monkeypatch)
    denied = [(e[b"reason"], e[b"object"]) for e in
              (dict(zip(entry[::2], entry[1::2])) for entry in admin.execute_command("ACL", "LOG"))]
    assert denied == [], denied  # every command the service sent was on the list
    user = redis.Redis(port=acl_redis, username="pagedserve", password=password)
    for command in (("FLUSHALL",), ("KEYS", "*"), ("GET", "other:secret"), ("CONFIG", "GET", "*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.execute_command(*command)
    assert len(ACL_COMMANDS) == len(set(ACL_COMMANDS))


def make_certs(folder: Path) -> dict[str, Path]:
    """A CA, a server certificate for localhost / 127.0.0.1 and a client certificate, with the openssl CLI."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl("req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=test-ca")
    (folder / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.crt", "-days", "1", "-extfile", "san.ext")
    return {name: folder / name for name in ("ca.crt", "server.crt", "server.key", "client.crt", "client.key")}


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[int, dict[str, Path]]]:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl CLI to make test certificates")
    certs = make_certs(tmp_path)
    port = free_port()
    server = start_redis(tmp_path, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs["server.crt"]),
                         "--tls-key-file", str(certs["server.key"]), "--tls-ca-cert-file", str(certs["ca.crt"]),
                         "--tls-auth-clients", "yes")
    try:
        wait_listening(server, port)
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server was built without TLS: {str(exc).strip()[:200]}")
        raise
    try:
        yield port, certs
    finally:
        stop(server)


async def test_the_broker_runs_over_tls(tls_redis, tokenizer, demo_engine, monkeypatch: pytest.MonkeyPatch) -> None:
    port, certs = tls_redis
    config = RedisConfig(url=f"rediss://localhost:{port}/0", prefix=f"t{uuid.uuid4().hex[:8]}", block_ms=200,
                         ssl_ca_certs=str(certs["ca.crt"]), ssl_certfile=str(certs["client.crt"]),
                         ssl_keyfile=str(certs["client.key"]))
    await broker_traffic(config, tokenizer, demo_engine, monkeypatch)
    # The port speaks only TLS, and only to clients that trust its CA and show a certificate.
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis(port=port, socket_timeout=2).ping()
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(f"rediss://localhost:{port}/0", ssl_certfile=str(certs["client.crt"]),
                             ssl_keyfile=str(certs["client.key"]), socket_timeout=2).ping()
    with pytest.raises(redis.exceptions.ConnectionError):
        redis.Redis.from_url(f"rediss://localhost:{port}/0", ssl_ca_certs=str(certs["ca.crt"]),
                             socket_timeout=2).ping()


def test_the_deployment_doc_documents_the_acl_rules() -> None:
    page = (Path(ROOT) / "docs" / "deployment.md").read_text()
    assert f"ACL SETUSER pagedserve on >PASSWORD {acl_rules('pagedserve')}\n" in page
