"""Redis high-availability setups on loopback ports for the tests: a Sentinel-managed primary with a replica
and sentinels, and a Redis Cluster of primaries. Each process keeps nothing on disk but its config."""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable

import redis

from service.local_stack import free_port
from tests.service.fault_proxy import FaultProxy

SERVICE = "pagedserve"
_START_TIMEOUT_S = 15.0


class _Processes:
    def __init__(self) -> None:
        self.workdir = tempfile.mkdtemp(prefix="pagedserve-ha-")
        self.processes: dict[int, subprocess.Popen] = {}  # port -> redis-server (or sentinel)

    def _spawn(self, port: int, *args: str) -> None:
        with open(self.log_path(port), "wb") as log:  # the child keeps its own handle
            self.processes[port] = subprocess.Popen(["redis-server", *args], cwd=self.workdir,
                                                    start_new_session=True, stdout=log, stderr=subprocess.STDOUT)

    def log_path(self, port: int) -> str:
        return os.path.join(self.workdir, f"{port}.log")

    def log(self, port: int) -> str:
        """What the process on ``port`` logged (warnings and up: a Sentinel's events), for failure messages."""
        with open(self.log_path(port), errors="replace") as log:
            return log.read()

    def _server(self, port: int, *args: str) -> None:
        folder = os.path.join(self.workdir, str(port))
        os.makedirs(folder)
        self._spawn(port, "--port", str(port), "--bind", "127.0.0.1", "--dir", folder, "--save", "",
                    "--appendonly", "no", "--loglevel", "warning", *args)

    def kill(self, port: int) -> None:
        self.processes[port].send_signal(signal.SIGKILL)
        self.processes[port].wait()

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __exit__(self, *_: object) -> None:
        self.stop()


class SentinelSet(_Processes):
    """A primary, one replica and ``sentinels`` sentinels (quorum: a majority) that fail over within seconds
    of the primary's death. The replica replicates through a ``FaultProxy``, which can hold the primary's
    writes back from it (``hold_replication``): the replica promoted then lacks them, as asynchronous
    replication allows. The Sentinels leave the replica's odd master address (the proxy's) alone for the
    failover timeout, so it is long; with more than one Sentinel a split vote waits twice that."""

    def __init__(self, sentinels: int = 1, down_after_ms: int = 500, failover_timeout_ms: int = 60_000) -> None:
        super().__init__()
        self.primary, self.replica = free_port(), free_port()
        self.sentinel_ports = [free_port() for _ in range(sentinels)]
        self._down_after_ms, self._failover_timeout_ms = down_after_ms, failover_timeout_ms
        self.proxy = FaultProxy(self.primary)

    @property
    def url(self) -> str:
        return "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + f"/{SERVICE}"

    def __enter__(self) -> SentinelSet:
        try:
            self._server(self.primary, "--repl-diskless-sync-delay", "0")  # the replica syncs at once
            self.proxy.start()
            self._server(self.replica, "--replicaof", "127.0.0.1", str(self.proxy.port))
            for port in self.sentinel_ports:
                self._sentinel(port)
            until(lambda: self.replicated() and self.watched(), "the sentinel set did not come up")
        except BaseException:
            self.stop()
            raise
        return self

    def _sentinel(self, port: int) -> None:
        path = os.path.join(self.workdir, f"sentinel-{port}.conf")
        quorum = len(self.sentinel_ports) // 2 + 1
        with open(path, "w") as conf:  # a sentinel rewrites its config file: each needs its own
            conf.write(f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
                       f"sentinel monitor {SERVICE} 127.0.0.1 {self.primary} {quorum}\n"
                       f"sentinel down-after-milliseconds {SERVICE} {self._down_after_ms}\n"
                       f"sentinel failover-timeout {SERVICE} {self._failover_timeout_ms}\n")
        self._spawn(port, path, "--sentinel", "--loglevel", "warning")

    def replicated(self) -> bool:
        return _ask(self.replica, "INFO", "replication").get("master_link_status") == "up"

    def watched(self) -> bool:
        """Every sentinel knows the primary and its replica."""
        return all(self.master_address(p) == ("127.0.0.1", self.primary) and _ask(p, "SENTINEL", "REPLICAS", SERVICE)
                   for p in self.sentinel_ports)

    def master_address(self, sentinel_port: int) -> tuple[str, int] | None:
        answer = _ask(sentinel_port, "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
        return (answer[0].decode(), int(answer[1])) if answer else None

    def promoted(self) -> bool:
        """Every sentinel names the replica as the primary, and it accepts writes."""
        return (all(self.master_address(p) == ("127.0.0.1", self.replica) for p in self.sentinel_ports)
                and _ask(self.replica, "ROLE") and _ask(self.replica, "ROLE")[0] == b"master")

    def wait_promoted(self, timeout_s: float, force_after_s: float = 10) -> None:
        """Until ``promoted``. A Sentinel that finds no replica fit at that moment (its INFO a little stale, or a
        ping late on a loaded machine) aborts the failover and retries only after twice the failover timeout:
        past ``force_after_s`` a ``SENTINEL FAILOVER`` every few seconds asks again (it is what pagedserve does
        on a failover that these tests judge, not how soon Sentinel starts one). The Sentinels' event logs
        name what held a failover back when none came."""
        deadline, force_at = time.monotonic() + timeout_s, time.monotonic() + force_after_s
        while not self.promoted():
            if time.monotonic() > deadline:
                logs = "\n".join(f"sentinel {p}:\n{self.log(p)}" for p in self.sentinel_ports)
                raise RuntimeError(f"the replica was not promoted; replica's log:\n{self.log(self.replica)}\n{logs}")
            if time.monotonic() > force_at:
                _ask(self.sentinel_ports[0], "SENTINEL", "FAILOVER", SERVICE)  # an error (in progress...) is no matter
                force_at = time.monotonic() + 5
            time.sleep(0.05)

    def hold_replication(self) -> None:
        """From now on the primary's writes reach the replica only after an hour."""
        self.proxy.delay(3600)

    def kill_primary(self) -> None:
        """SIGKILL, and the writes held back are dropped with the replica's link."""
        self.kill(self.primary)
        self.proxy.reset()

    def stop(self) -> None:
        super().stop()
        if self.proxy.port:
            self.proxy.stop()


class Cluster(_Processes):
    """``size`` primaries sharing the 16384 slots, no replicas."""

    def __init__(self, size: int = 3) -> None:
        super().__init__()
        self.ports = [_cluster_port() for _ in range(size)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def __enter__(self) -> Cluster:
        try:
            for port in self.ports:
                self._server(port, "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf")
            until(lambda: all(_ask(p, "PING") for p in self.ports), "the cluster nodes did not start")
            subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True,
                           timeout=_START_TIMEOUT_S)
            until(lambda: all(_ask(p, "CLUSTER", "INFO").startswith(b"cluster_state:ok") for p in self.ports),
                   "the cluster did not reach state ok")
        except BaseException:
            self.stop()
            raise
        return self

    def keys(self, port: int) -> list[bytes]:
        """The keys held by the node on ``port``."""
        return _ask(port, "KEYS", "*")


def _cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it) is free too and below 65536."""
    while True:
        port = random.randrange(20_000, 50_000)
        if _bindable(port) and _bindable(port + 10_000):
            return port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _ask(port: int, *command: str) -> object:
    """One command to the server on ``port``; None if it cannot answer."""
    client = redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1)
    try:
        return client.execute_command(*command)
    except redis.RedisError:
        return None
    finally:
        client.close()


def until(condition: Callable[[], object], what: str, timeout_s: float = _START_TIMEOUT_S) -> None:
    """Polls ``condition`` until it holds; raises naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(what)
        time.sleep(0.05)

