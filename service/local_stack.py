"""Everything on one machine: a private redis-server, engine workers and gateways,
each its own ``pagedserve worker|gateway`` process.

``pagedserve serve``, the serving benchmark and the service tests all start their
processes here. Redis listens on a unix socket in a private folder (and, when asked,
on a loopback TCP port too, so that a fault-injecting proxy can sit in front of it)
and keeps nothing on disk: a restarted Redis starts empty. Every child runs in its
own session, so a Ctrl-C reaches only the launcher, which then stops the children in
order (gateways, workers, Redis); on Linux the kernel also stops them should the
launcher die outright (the thread that started them must live as long as they do).
Secrets such as API keys go in ``env``, never in argv, where any user of the machine
could read them.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import redis

# Looked up before any fork: the child only calls it.
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
_PR_SET_PDEATHSIG = 1
_STOP_TIMEOUT_S = 10.0


class RedisServerMissing(RuntimeError):
    """There is no redis-server on PATH."""


@dataclass(slots=True)
class Child:
    role: str  # "redis-server", "worker" or "gateway"
    argv: list[str]  # the full command line
    url: str | None = None  # a gateway's base URL
    process: subprocess.Popen | None = None

    @property
    def returncode(self) -> int | None:
        return self.process.poll()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalStack:
    """Add workers and gateways, then ``start()`` (or ``with stack:``); ``stop()`` ends all."""

    def __init__(self, env: dict[str, str] | None = None, cwd: str | None = None, redis_tcp: bool = False) -> None:
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.workdir = tempfile.mkdtemp(prefix="pagedserve-")
        socket_path = os.path.join(self.workdir, "redis.sock")
        self.redis_url = f"unix://{socket_path}"
        # The same port across Redis restarts, so clients reconnect to where they were.
        self.redis_port = free_port() if redis_tcp else 0
        self.redis = Child("redis-server", [
            "redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--unixsocket", socket_path,
            "--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", self.workdir,
            "--loglevel", "warning"])
        self.children = [self.redis]
        self._started = False

    @property
    def workers(self) -> list[Child]:
        return [c for c in self.children if c.role == "worker"]

    @property
    def gateways(self) -> list[Child]:
        return [c for c in self.children if c.role == "gateway"]

    @property
    def urls(self) -> list[str]:
        return [c.url for c in self.gateways]

    @property
    def url(self) -> str:
        """The first gateway's base URL."""
        return self.urls[0]

    def add_worker(self, argv: list[str], redis_url: str | None = None) -> Child:
        """A worker on this stack's Redis, or on ``redis_url`` (e.g. a proxy in front of it)."""
        return self._add("worker", argv, redis_url=redis_url)

    def add_gateway(self, argv: list[str], host: str = "127.0.0.1", port: int | None = None,
                    redis_url: str | None = None) -> Child:
        """With no ``port``, the gateway listens on a free port of ``host``, added to its flags;
        with one, the flags already say where it listens (``serve`` forwards its own)."""
        if port is None:
            port = free_port()
            argv = [*argv, "--host", host, "--port", str(port)]
        return self._add("gateway", argv, f"http://{host}:{port}", redis_url)

    def _add(self, role: str, argv: list[str], url: str | None = None, redis_url: str | None = None) -> Child:
        """A child added to a running stack starts at once."""
        command = [sys.executable, "-m", "service.cli", role, "--redis-url", redis_url or self.redis_url, *argv]
        child = Child(role, command, url)
        self.children.append(child)
        if self._started:
            self._spawn(child)
        return child

    def start(self) -> LocalStack:
        """Redis first (until its socket exists), then every worker and gateway."""
        if shutil.which("redis-server", path=self.env.get("PATH")) is None:
            self.stop()
            raise RedisServerMissing("redis-server was not found on PATH")
        try:
            self._spawn_redis()
            for child in self.children[1:]:
                self._spawn(child)
        except BaseException:
            self.stop()
            raise
        self._started = True
        return self

    def _spawn_redis(self) -> None:
        self._spawn(self.redis)
        _wait_for_redis(self.redis_url, self.redis.process)

    def _spawn(self, child: Child) -> None:
        child.process = subprocess.Popen(child.argv, env=self.env, cwd=self.cwd, start_new_session=True,
                                         preexec_fn=_die_with_parent)

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Until every running gateway answers /ready and sees a heartbeat per running worker."""
        deadline = time.monotonic() + timeout_s
        engines = len(self.running("worker"))
        for url in [c.url for c in self.running("gateway")]:
            while not _ready(url, engines):
                if (child := self.exited()) is not None:
                    raise RuntimeError(f"the {child.role} process exited with {child.returncode} during startup")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} was not ready after {timeout_s:.0f}s")
                time.sleep(0.2)

    def running(self, role: str) -> list[Child]:
        return [c for c in self.children if c.role == role and c.process is not None and c.returncode is None]

    def exited(self) -> Child | None:
        """The first started child that is no longer running."""
        return next((c for c in self.children if c.process is not None and c.returncode is not None), None)

    def kill(self, child: Child, sig: signal.Signals = signal.SIGKILL) -> None:
        child.process.send_signal(sig)
        child.process.wait()

    def restart(self, child: Child) -> None:
        """Stops one child (SIGTERM, unless it already exited) and starts it again with the same command line."""
        _stop([child])
        if child is self.redis:
            self._spawn_redis()
        else:
            self._spawn(child)

    def redis_command(self, *args: str | int) -> object:
        """One command on this stack's Redis, e.g. ``("CLIENT", "PAUSE", 7000, "ALL")``."""
        client = redis.Redis.from_url(self.redis_url, socket_timeout=5)
        try:
            return client.execute_command(*args)
        finally:
            client.close()

    def stop(self) -> None:
        """Gateways, then workers, then Redis; each group stops in parallel."""
        for role in ("gateway", "worker", "redis-server"):
            _stop([c for c in self.children if c.role == role])
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def _die_with_parent() -> None:
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _wait_for_redis(url: str, process: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """Until it answers PING (a socket file left by a killed predecessor may already exist)."""
    client = redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1)
    deadline = time.monotonic() + timeout_s
    try:
        while not _pings(client):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)
    finally:
        client.close()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _ready(url: str, engines: int) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
            return json.loads(response.read())["engines"] >= engines
    except (OSError, ValueError):  # not listening yet, or 503 (urllib's HTTPError is an OSError)
        return False


def _stop(children: list[Child]) -> None:
    running = [c.process for c in children if c.process is not None and c.returncode is None]
    for process in running:
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    for process in running:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
