"""How one iteration of the worker's loop reaches the broker around the engine step: the outbox and its due
checkpoints go out, the step runs, new requests and aborts come back (``Transport.exchange``).

Two ways, one shape. ``BrokerTransport`` goes through the broker's asyncio calls (Redis, or the in-process
``service.memory_broker``): the publish and the poll overlap the step, which runs in the step thread.
``LaneTransport`` puts the publish and the poll on the thread that steps (the Redis step lane,
``service.step_lane``), in one exchange around the step, whenever the lane is ready; otherwise it goes the
first way.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from engine.outputs import RequestOutput

from service.broker_api import LaneBroker, LaneExchange, Pulled, WorkerBroker
from service.config import WorkerConfig
from service.engine_api import Engine
from service.errors import BrokerUnavailable
from service.messages import GatewayBeat
from service.outbox import Outbox, Outgoing

log = logging.getLogger(__name__)

StepOutputs = list[RequestOutput] | Exception  # a step's outputs, or what it raised


@dataclass(slots=True)
class Polled:
    pulled: list[Pulled]
    aborts: list[str]
    gateways: dict[str, GatewayBeat] | None = None  # read every heartbeat interval


class Transport(Protocol):
    async def exchange(self, room: int, step: bool) -> tuple[StepOutputs, Polled | None]:
        """The outbox goes out, the step runs (``step``; else no outputs), up to ``room`` new requests and the
        new aborts come back. Polled None: the exchange failed around a step (the outputs stand); without a
        step, a failed poll raises ``BrokerUnavailable``."""

    async def settle(self) -> None:
        """Until a publish still in flight has landed or failed: the outbox may change after."""

    async def flush(self) -> None:
        """The outbox goes out now (the last replies, at shutdown)."""


def transport_for(config: WorkerConfig, broker: WorkerBroker, engine: Engine, outbox: Outbox,
                  executor: ThreadPoolExecutor, room: Callable[[], int]) -> Transport:
    """The step lane's when the broker has one and ``config.step_lane``; ``room()``: how many requests the
    engine takes now (a drain begun during a step pulls nothing after it)."""
    plain = BrokerTransport(broker, engine, outbox, executor)
    if config.step_lane and isinstance(broker, LaneBroker):
        return LaneTransport(config, broker, engine, outbox, plain, executor, room)
    return plain


class BrokerTransport:
    """The publish goes out as a task that overlaps the step and the poll; each waits for the one before, so
    each request's replies stay in order."""

    def __init__(self, broker: WorkerBroker, engine: Engine, outbox: Outbox, executor: ThreadPoolExecutor) -> None:
        self._broker = broker
        self._engine = engine
        self._outbox = outbox
        self._executor = executor
        self._publishing: asyncio.Task | None = None

    async def exchange(self, room: int, step: bool) -> tuple[StepOutputs, Polled | None]:
        if not step:
            await self.settle()  # nothing may linger while idle
            self._publish_later()
            return [], Polled(*await self._broker.poll(room, block=True))
        self._publish_later()
        stepping = asyncio.ensure_future(self._step())
        try:
            polled = Polled(*await self._broker.poll(room, block=False))
        except BrokerUnavailable as exc:
            log.warning("polling: %s", exc)
            polled = None
        return await stepping, polled

    async def settle(self) -> None:
        previous, self._publishing = self._publishing, None
        if previous is not None:
            await previous

    async def flush(self) -> None:
        await self.settle()
        self._publish_later()
        await self.settle()

    def _publish_later(self) -> None:
        if self._publishing is None and self._outbox.pending:
            self._publishing = asyncio.create_task(self._publish())

    async def _publish(self) -> None:
        out = self._outbox.outgoing()
        try:
            await self._broker.publish(out.items, out.checkpoints)
        except BrokerUnavailable as exc:
            self._outbox.failed(exc)
            return
        self._outbox.sent(out)

    async def _step(self) -> StepOutputs:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, self._engine.step)
        except Exception as exc:
            return exc


class LaneTransport:
    """One exchange on the step lane around the step: the outbox and the due checkpoints go out just before
    it, new requests and aborts come back just after; no event-loop round trip in between. While steps are
    long the poll goes out after the step instead: a request that arrives during one then joins the next
    step, not the one after. A step after a short one runs on the event loop's thread (no hand-off), a long
    one in the step thread, so the heartbeat keeps going."""

    def __init__(self, config: WorkerConfig, broker: LaneBroker, engine: Engine, outbox: Outbox,
                 fallback: BrokerTransport, executor: ThreadPoolExecutor, room: Callable[[], int]) -> None:
        self._broker = broker
        self._engine = engine
        self._outbox = outbox
        self._fallback = fallback  # while the lane is not ready, and without a step
        self._executor = executor
        self._room = room
        self._inline_below_s = config.heartbeat_interval_s / 5
        self._poll_after_step_s = config.poll_after_step_s
        self._last_step_s = float("inf")  # the last lane step's duration: the next runs inline after a short one

    async def exchange(self, room: int, step: bool) -> tuple[StepOutputs, Polled | None]:
        lane = self._broker.lane
        if not step or lane is None or not lane.ready():
            return await self._fallback.exchange(room, step)
        await self._fallback.settle()  # a publish from an idle moment lands (or fails) first
        out = self._outbox.outgoing()
        if self._last_step_s < self._inline_below_s:
            # On the loop thread: the hand-off to the step thread and back costs more than the rest of a
            # short step's broker work (~1.3 us a token at 256 streams). The beat waits for the step, so
            # only a step after a short one runs here: a long one (a large prefill) goes to the thread.
            call, outputs = self._step(lane, out, room)
            await asyncio.sleep(0)  # the beat and other tasks get their turn
        else:
            loop = asyncio.get_running_loop()
            call, outputs = await loop.run_in_executor(self._executor, self._step, lane, out, room)
        return outputs, await self._received(lane, call, out)

    async def settle(self) -> None:
        await self._fallback.settle()

    async def flush(self) -> None:
        await self._fallback.flush()

    def _step(self, lane: LaneExchange, out: Outgoing, room: int) -> tuple[Any, StepOutputs]:
        """(the lane's call, the step's outputs or the exception it raised), on either thread."""
        long_steps = self._last_step_s >= self._poll_after_step_s
        call = lane.send(out.items, out.checkpoints, None if long_steps else room)
        started = time.monotonic()
        try:
            return call, self._engine.step()
        except Exception as exc:
            return call, exc
        finally:
            self._last_step_s = time.monotonic() - started
            lane.receive(call, self._room())  # a drain begun during the step pulls nothing

    async def _received(self, lane: LaneExchange, call: Any, out: Outgoing) -> Polled | None:
        """The poll's part of the exchange once its publish landed; None if either failed."""
        try:
            lane.published(call)
        except BrokerUnavailable as exc:
            self._outbox.failed(exc)
            return None
        self._outbox.sent(out)
        try:
            return Polled(*await lane.polled(call))
        except BrokerUnavailable as exc:
            log.warning("polling: %s", exc)
            return None
