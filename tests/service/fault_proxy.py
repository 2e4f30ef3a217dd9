"""A TCP proxy between a client (a worker process) and Redis that injects faults on command:
it passes bytes through, holds the server's replies back for a while (past the client's socket
timeout, so a command that Redis did run looks failed to the client, who may retry it), or resets
every open connection (RST, as a dying peer or a middlebox does). Its own event loop runs in a
thread, so synchronous tests drive it while their subprocesses talk through it.
"""
from __future__ import annotations

import asyncio
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

_CHUNK = 65536


@dataclass(slots=True, eq=False)  # kept in a set by identity
class _Link:
    """One client connection and its upstream twin."""

    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    tasks: list[asyncio.Task] = field(default_factory=list)


class FaultProxy:
    """``with FaultProxy(upstream_port) as proxy:`` listens on ``proxy.port`` of 127.0.0.1."""

    def __init__(self, upstream_port: int, host: str = "127.0.0.1") -> None:
        self.host, self.upstream_port = host, upstream_port
        self.port = 0
        self.resets = 0  # connections reset so far
        self.delayed_chunks = 0  # server replies held back so far
        self._delay_s = 0.0
        self._links: set[_Link] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}"

    @property
    def connections(self) -> int:
        return len(self._links)

    def start(self) -> FaultProxy:
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._accept, self.host, 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        self.reset()
        self._loop.call_soon_threadsafe(self._server.close)  # the loop's objects are touched on its thread only
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def delay(self, seconds: float) -> None:
        """From now on, each reply chunk reaches the client ``seconds`` after Redis sent it (0: pass through)."""
        self._delay_s = seconds

    def reset(self) -> int:
        """Resets every open connection (both sides); returns how many. New connections are accepted as usual."""
        return self._call(self._reset_all())

    def _call(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(self.host, self.upstream_port)
        except OSError:  # Redis is down: the client sees its connection refused, as it would without us
            _abort(client_writer)
            return
        link = _Link(client_writer, server_writer)
        self._links.add(link)
        link.tasks = [asyncio.create_task(self._pump(client_reader, server_writer, delayed=False)),
                      asyncio.create_task(self._pump(server_reader, client_writer, delayed=True))]
        await asyncio.wait(link.tasks, return_when=asyncio.FIRST_COMPLETED)
        self._close(link)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delayed: bool) -> None:
        """Copies bytes in order; a delayed direction holds each chunk until its own due time (the
        delay does not add up over chunks that arrived close together)."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.create_task(self._send(queue, writer))
        try:
            while data := await reader.read(_CHUNK):
                delay = self._delay_s if delayed else 0.0
                self.delayed_chunks += delay > 0
                queue.put_nowait((time.monotonic() + delay, data))
            queue.put_nowait((0.0, b""))
            await sender
        finally:
            sender.cancel()

    @staticmethod
    async def _send(queue: asyncio.Queue[tuple[float, bytes]], writer: asyncio.StreamWriter) -> None:
        while True:
            due, data = await queue.get()
            if not data:
                return
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            writer.write(data)
            await writer.drain()

    async def _reset_all(self) -> int:
        links = list(self._links)
        for link in links:
            _abort(link.client)
            _abort(link.server)
            self._close(link)
        self.resets += len(links)
        return len(links)

    def _close(self, link: _Link) -> None:
        if link in self._links:
            self._links.discard(link)
            for task in link.tasks:
                task.cancel()
            link.client.close()
            link.server.close()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Closes with RST (SO_LINGER 0), not FIN: the peer gets ECONNRESET."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
