"""Drives one LLMEngine from the broker's request queue (Redis in deployments,
``service.memory_broker`` in unit tests).

Each iteration: pull new requests only if the engine has room (so idle engines
take the work: pull-based balancing), apply aborts, run one engine step in a
dedicated thread (torch is synchronous; the event loop keeps beating), and
publish every output of the step in one pipeline.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

from service.broker_api import BrokerUnavailable, Pulled, RequestHandle, WorkerBroker
from service.config import WorkerConfig
from service.messages import ChoiceDelta, EventKind, Heartbeat, ReplyEvent

log = logging.getLogger(__name__)

_RECENT_ABORTS = 10_000  # ids remembered so a request aborted while queued is never started
_RETRY_S = 0.5

Published = list[tuple[RequestHandle, ReplyEvent]]


@runtime_checkable
class Engine(Protocol):
    """What the worker needs of an engine; ``LLMEngine`` is one. Never called
    while a step runs: the worker steps it on one thread and reads it between steps."""

    max_model_len: int

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    cache_salt: str | None = None) -> None: ...

    def abort_request(self, request_ids: list[str]) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def has_capacity(self) -> bool: ...

    def stats(self) -> EngineStats: ...


class Worker:
    def __init__(self, config: WorkerConfig, engine: Engine, model_name: str, broker: WorkerBroker) -> None:
        self.config = config
        self.engine = engine
        self.model_name = model_name
        self.incarnation = uuid.uuid4().hex[:12]
        self.broker = broker
        self._owned: dict[str, RequestHandle] = {}
        self._recent_aborts: dict[str, None] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._stats: EngineStats = engine.stats()
        self._stats_time = 0.0
        self._publishing: asyncio.Task | None = None
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        await self.broker.start()
        beat = asyncio.create_task(self._beat())
        log.info("worker %s serving %s", self.config.engine_id, self.model_name)
        try:
            while not self._stopping.is_set():
                await self._iterate_safely()
        finally:
            beat.cancel()
            await self._shutdown()

    async def _iterate_safely(self) -> None:
        try:
            await self._iterate()
        except BrokerUnavailable as exc:
            log.warning("worker loop: %s", exc)
            await asyncio.sleep(_RETRY_S)

    async def _iterate(self) -> None:
        room = self.config.max_pull if self.engine.has_capacity() else 0
        if self.engine.has_unfinished_requests():
            events, (pulled, aborts) = await self._step_while_polling(room)
        else:
            await self._publish_later([])  # nothing may linger while idle
            if not room:
                await asyncio.sleep(_RETRY_S)  # idle yet full should not happen; never spin
            events, (pulled, aborts) = [], await self.broker.poll(room, block=True)
        # Between steps: the engine is only ever touched while no step runs.
        self._remember_aborts(aborts)
        if pulled:
            await self.broker.publish(await self._admit(pulled))  # "accepted" goes out at once
        await self._publish_later(events + self._abort_owned(aborts))
        self._refresh_stats()

    async def _step_while_polling(self, room: int) -> tuple[Published, tuple[list[Pulled], list[str]]]:
        """The Redis round trip for new requests and aborts overlaps the engine step."""
        step = asyncio.ensure_future(self._step())
        try:
            polled = await self.broker.poll(room, block=False)
        except BrokerUnavailable as exc:
            log.warning("polling: %s", exc)
            polled = ([], [])
        return await step, polled

    async def _publish_later(self, events: Published) -> None:
        """Publishes while the next step runs; waits for the previous batch first,
        so each reply stream stays in order."""
        previous, self._publishing = self._publishing, None
        if previous is not None:
            await previous
        if events:
            self._publishing = asyncio.create_task(self.broker.publish(events))

    async def _admit(self, pulled: list[Pulled]) -> Published:
        events: Published = []
        for item in pulled:
            if item.msg is None:
                log.error("dropping %s", item.error)
                await self.broker.ack(item.handle.entry_id)
                continue
            events.append((item.handle, self._event(EventKind.ACCEPTED)))
            if (reply := self._add(item)) is not None:
                events.append((item.handle, reply))
        return events

    def _add(self, item: Pulled) -> ReplyEvent | None:
        msg = item.msg
        if msg.request_id in self._recent_aborts:
            return self._event(EventKind.OUTPUT, finished=True)
        if msg.model != self.model_name:  # the per-model request streams keep this from happening
            return self._event(EventKind.ERROR, finished=True, status=404,
                               error=f"this engine serves {self.model_name!r}, not {msg.model!r}")
        try:
            params = SamplingParams(**msg.params)
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, cache_salt=msg.cache_salt)
        except (ValueError, TypeError) as exc:
            return self._event(EventKind.ERROR, finished=True, error=str(exc), status=400)
        except Exception as exc:  # a bad request must not take the worker down
            log.exception("add_request failed for %s", msg.request_id)
            return self._event(EventKind.ERROR, finished=True, error=f"engine error: {exc}", status=500)
        self._owned[msg.request_id] = item.handle
        return None

    def _remember_aborts(self, aborts: list[str]) -> None:
        for request_id in aborts:
            self._recent_aborts[request_id] = None
        while len(self._recent_aborts) > _RECENT_ABORTS:
            del self._recent_aborts[next(iter(self._recent_aborts))]

    def _abort_owned(self, aborts: list[str]) -> Published:
        owned = [rid for rid in aborts if rid in self._owned]
        if owned:
            self.engine.abort_request(owned)  # blocks go back to the pool now
        return [(self._owned.pop(rid), self._event(EventKind.OUTPUT, finished=True)) for rid in owned]

    async def _step(self) -> Published:
        loop = asyncio.get_running_loop()
        try:
            outputs = await loop.run_in_executor(self._executor, self.engine.step)
        except Exception as exc:
            log.exception("engine step failed; failing its requests")
            return self._fail_all(f"engine step failed: {exc}", status=500)
        return [item for out in outputs if (item := self._output_event(out)) is not None]

    def _output_event(self, out: RequestOutput) -> tuple[RequestHandle, ReplyEvent] | None:
        handle = self._owned.get(out.request_id)
        if handle is None:
            return None  # aborted here already
        if out.finished:
            del self._owned[out.request_id]
        if out.error:
            return handle, self._event(EventKind.ERROR, finished=True, error=out.error, status=500)
        choices = [ChoiceDelta(c.index, list(c.token_ids), c.logprobs, c.finish_reason)
                   for c in out.outputs]
        return handle, self._event(EventKind.OUTPUT, choices=choices, finished=out.finished,
                                   num_cached_tokens=out.num_cached_tokens)

    def _fail_all(self, error: str, status: int) -> Published:
        failed = list(self._owned)
        try:
            self.engine.abort_request(failed)
        except Exception:
            log.exception("abort after failure failed")
        return [(self._owned.pop(rid), self._event(EventKind.ERROR, finished=True, error=error, status=status))
                for rid in failed]

    def _refresh_stats(self) -> None:
        # Between steps, on the loop thread: the engine is never read while it steps.
        # Always when idle, so the last figures of a burst are not stale.
        now = time.monotonic()
        if now - self._stats_time >= self.config.heartbeat_interval_s / 2 or not self.engine.has_unfinished_requests():
            self._stats, self._stats_time = self.engine.stats(), now

    def _event(self, kind: EventKind, **fields: Any) -> ReplyEvent:
        return ReplyEvent(kind, self.config.engine_id, self.incarnation, **fields)

    async def _beat(self) -> None:
        while True:
            try:
                await self.broker.heartbeat(Heartbeat(self.config.engine_id, self.incarnation, self.model_name,
                                                      self.engine.max_model_len, self._stats))
            except BrokerUnavailable as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _shutdown(self) -> None:
        try:
            await self._publish_later([])
            await self.broker.publish(self._fail_all("the engine is shutting down", status=503))
        except BrokerUnavailable:
            pass
        await self.broker.close()
        self._executor.shutdown(wait=True)
