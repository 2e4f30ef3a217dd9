"""Drives one LLMEngine from the broker's request queue (Redis in deployments,
``service.memory_broker`` in unit tests).

Each iteration has one shape: one exchange with the broker around one engine step
(``service.worker_transport``): the replies of the last step go out (``service.outbox``), the step
runs, new requests come back (only if the engine has room, so idle engines take the work: pull-based
balancing) with the aborts. Between steps, the worker applies them. With the Redis broker and
``step_lane`` on, the exchange rides on the step itself (the step lane, ``service.step_lane``): sent just
before the step, read just after it, on the thread that steps (while steps are long, the poll goes out
after the step instead: a request that arrives during one then joins the next step, not the one after);
a step after a short one runs on the event loop's thread (no hand-off), a long one in a dedicated thread,
so the heartbeat keeps going. When the lane is down, or without it, the same calls go through the
broker's asyncio client: the publish and the poll overlap the step, which runs in the thread. Every
heartbeat interval, between steps, it also takes over the requests of dead engines (resuming each where
its transcript ends) and aborts requests whose gateway has been gone for ``orphan_grace_s`` unless a live
gateway adopted them (a client resumed its stream there; ``service.worker_runs``).

Replies are never dropped on a broker error: they stay in the outbox, in order,
and go out with the next try (the gateway drops what landed twice, by index),
for up to ``reply_ttl_s``. A request's counted events (OUTPUT, ERROR) are
numbered 0, 1, 2, ... across engines: a resumed one continues the count. After a
gap in the beats or a Redis that lost its state, ``service.worker_recovery`` says
what to drop and what to send again.

SIGTERM drains: no new pulls, in-flight requests finish for up to
``drain_timeout_s``, then the heartbeat is deleted so other engines resume the
rest at once. ``max_failed_steps`` consecutive failed steps end the worker with
``EXIT_FAILED_STEPS`` for its supervisor to restart it.

While a dashboard watches this engine (the broker says so with each heartbeat), the worker takes the
engine's KV snapshot between steps and publishes it: at most every ``KV_SNAPSHOT_INTERVAL_S``, and
never more often than keeps the time spent taking them under ``KV_SNAPSHOT_SHARE`` of the wall clock
(a larger pool is sampled less often), so the steps slow by less than that.
"""
from __future__ import annotations

import asyncio
import gc
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams

from service.broker_api import Pulled, Reply, WorkerBroker, kv_snapshot_ttl_s
from service.config import WorkerConfig
from service.engine_api import Engine
from service.errors import BrokerUnavailable
from service.messages import EventKind, EventRow, RequestMsg, encode, images_from_wire, kv_snapshot_msg
from service.outbox import Outbox
from service.worker_heartbeat import WorkerHeartbeat
from service.worker_recovery import Recovery
from service.worker_runs import Run, Runs
from service.worker_transport import Polled, StepOutputs, transport_for

log = logging.getLogger(__name__)

_RETRY_S = 0.5
EXIT_FAILED_STEPS = 3
KV_SNAPSHOT_INTERVAL_S = 0.5  # at most 2 Hz
KV_SNAPSHOT_SHARE = 0.005  # of the wall clock spent taking them, at most


class Worker:
    def __init__(self, config: WorkerConfig, engine: Engine, model_name: str, broker: WorkerBroker) -> None:
        self.config = config
        self.engine = engine
        self.model_name = model_name
        self.incarnation = broker.incarnation
        self.broker = broker
        self.exit_code = 0
        self._drain_deadline: float | None = None
        self._runs = Runs(engine, config.engine_id, broker.incarnation, config.orphan_grace_s)
        self._outbox = Outbox(config, self._runs.owned)
        self._recovery = Recovery(broker, self._runs, self._outbox, config.heartbeat_ttl_s)
        self._heartbeat = WorkerHeartbeat(config, engine, model_name, broker, self._recovery)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._transport = transport_for(config, broker, engine, self._outbox, self._executor, self._room)
        self._kv_snapshot_at = 0.0  # monotonic: the next KV snapshot is due then
        self._kv_publishing: asyncio.Task | None = None
        self._housekeeping_at = 0.0
        self._failed_steps = 0

    def stop(self) -> None:
        """Drains: no new requests; those in flight finish for up to ``drain_timeout_s``."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
            log.info("draining: %d requests in flight", len(self._runs.owned))

    async def run(self) -> int:
        """Serves until drained or failed; the process's exit code."""
        await self.broker.start()
        beat = asyncio.create_task(self._heartbeat.run())
        log.info("worker %s serving %s", self.config.engine_id, self.model_name)
        try:
            while not self._done():
                await self._iterate_safely()
                self._heartbeat.moved()
        finally:
            beat.cancel()
            await self._shutdown()
        return self.exit_code

    def _done(self) -> bool:
        if self.exit_code or self._drain_deadline is None:
            return bool(self.exit_code)
        return not self.engine.has_unfinished_requests() or time.monotonic() >= self._drain_deadline

    async def _iterate_safely(self) -> None:
        try:
            await self._iterate()
        except BrokerUnavailable as exc:
            log.warning("worker loop: %s", exc)
            await asyncio.sleep(_RETRY_S)

    async def _iterate(self) -> None:
        room, stepping = self._room(), self.engine.has_unfinished_requests()
        outputs, polled = await self._transport.exchange(room, stepping)
        if not stepping and not room:
            await asyncio.sleep(_RETRY_S)  # idle yet full (or draining) should not happen; never spin
        events = self._step_outputs(outputs)
        polled = await self._housekeep(polled, room) if polled is not None else Polled([], [])
        # Between steps: the engine is only ever touched while no step runs.
        self._runs.remember_aborts(polled.aborts)
        events += await self._admit(polled.pulled) + self._runs.abort(polled.aborts)
        if polled.gateways is not None:
            events += self._runs.abort_orphans(polled.gateways)
        dropped, resent = await self._recovery.after_gap(events)
        await self._transport.settle()  # the outbox changes only while none of it is in flight
        self._outbox.add(resent + events, dropped)
        self._heartbeat.refresh()
        if self._heartbeat.kv_wanted:
            self._take_kv_snapshot()

    def _room(self) -> int:
        """How many new requests to pull: none while full or draining."""
        return self.config.max_pull if self.engine.has_capacity() and self._drain_deadline is None else 0

    async def _housekeep(self, polled: Polled, room: int) -> Polled:
        """Every heartbeat interval: dead engines' requests (with room for them) and the live gateways."""
        if time.monotonic() >= self._housekeeping_at:
            self._housekeeping_at = time.monotonic() + self.config.heartbeat_interval_s
            try:
                if room > len(polled.pulled):
                    polled.pulled += await self.broker.reclaim(room - len(polled.pulled))
                polled.gateways = await self.broker.gateways()
            except BrokerUnavailable as exc:
                log.warning("reading dead engines and live gateways: %s", exc)
        return polled

    async def _admit(self, pulled: list[Pulled]) -> list[Reply]:
        events: list[Reply] = []
        for item in pulled:
            if item.msg is None or (item.resume is not None and item.resume.finished):
                if item.msg is None:
                    log.error("dropping %s", item.error)
                await self._quietly(self.broker.ack(item.handle))  # nothing left to say
                continue
            params = _engine_params(item.msg)
            run = Run.pulled(item, params.n if isinstance(params, SamplingParams) else 1)
            if item.deliveries >= self.config.max_deliveries:
                reason = f"failed on {item.deliveries} engines"
                await self._quietly(self.broker.dead_letter(item.handle, reason))
                events.append((item.handle, self._runs.counted(run, EventKind.ERROR, finished=True, error=reason)))
                continue
            events.append((item.handle, self._runs.row(item.handle, EventKind.ACCEPTED)))
            if (reply := self._add(item, run, params)) is not None:
                events.append((item.handle, reply))
        return events

    async def _quietly(self, call: Any) -> None:
        try:
            await call
        except BrokerUnavailable as exc:  # the entry stays pending; a later reclaim meets it again
            log.warning("broker call failed: %s", exc)

    def _add(self, item: Pulled, run: Run, params: SamplingParams | PoolingParams | Exception) -> EventRow | None:
        """The request into the engine, or the event that ends it at once."""
        msg = item.msg
        if self._runs.aborted(msg.request_id):
            return self._runs.counted(run, EventKind.OUTPUT, finished=True)
        if msg.model != self.model_name:  # the per-model request streams keep this from happening
            return self._runs.counted(run, EventKind.ERROR, finished=True, status=404,
                                      error=f"this engine serves {self.model_name!r}, not {msg.model!r}")
        if isinstance(params, Exception):
            return self._rejected(msg, run, params)
        try:
            images = {"images": images_from_wire(msg.images)} if msg.images else {}  # a text request: the old call
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, cache_salt=msg.cache_salt,
                                    resume=run.resume_state(params), priority=msg.priority, **images)
        except Exception as exc:
            return self._rejected(msg, run, exc)
        if item.resume is not None:
            log.info("resuming %s at event %d", msg.request_id, run.next_index)
        self._runs.own(run)
        return None

    def _rejected(self, msg: RequestMsg, run: Run, exc: Exception) -> EventRow:
        """The error event of a request the engine could not take: a map of another release, or values the
        gateway let through, are a 400 for this request alone; anything else must not take the worker down."""
        if isinstance(exc, (ValueError, TypeError)):
            return self._runs.counted(run, EventKind.ERROR, finished=True, error=str(exc), status=400)
        log.error("add_request failed for %s", msg.request_id, exc_info=exc)
        return self._runs.counted(run, EventKind.ERROR, finished=True, error=f"engine error: {exc}")

    def _step_outputs(self, outputs: StepOutputs) -> list[Reply]:
        if isinstance(outputs, Exception):
            log.error("engine step failed; failing its requests", exc_info=outputs)
            self._count_step(failed=True)
            return self._runs.fail_all(f"engine step failed: {outputs}", status=500)
        # The engine fails a bad request alone, not the step: a step that failed requests and produced no
        # token failed too (a broken device fails every request it runs, one after the other).
        if any(out.error for out in outputs):
            self._count_step(failed=not any(c.token_ids for out in outputs for c in out.outputs))
        elif outputs:
            self._failed_steps = 0
        return [item for out in outputs if (item := self._runs.output(out)) is not None]

    def _count_step(self, failed: bool) -> None:
        self._failed_steps = self._failed_steps + 1 if failed else 0
        if self._failed_steps >= self.config.max_failed_steps:
            log.error("%d engine steps failed in a row: exiting for the supervisor to restart the engine",
                      self._failed_steps)
            self.exit_code = EXIT_FAILED_STEPS

    def _take_kv_snapshot(self) -> None:
        """Between steps, on the loop thread, when due and the last one has gone out; published meanwhile."""
        now = time.monotonic()
        if now < self._kv_snapshot_at or (self._kv_publishing is not None and not self._kv_publishing.done()):
            return
        try:
            tenants = {request_id: run.tenant for request_id, run in self._runs.owned.items()}
            payload, interval = take_kv_snapshot(self.engine, self.config.engine_id, self.model_name, tenants)
        except Exception:  # the dashboard's picture must never cost the engine its requests
            log.exception("taking the KV snapshot failed")
            payload, interval = None, KV_SNAPSHOT_INTERVAL_S
        self._kv_snapshot_at = now + interval
        if payload is not None:
            ttl_s = kv_snapshot_ttl_s(interval)
            self._kv_publishing = asyncio.create_task(self._publish_kv_snapshot(payload, ttl_s))

    async def _publish_kv_snapshot(self, payload: bytes, ttl_s: float) -> None:
        try:
            await self.broker.publish_kv_snapshot(payload, ttl_s)
        except BrokerUnavailable as exc:
            log.debug("publishing the KV snapshot failed: %s", exc)

    async def _shutdown(self) -> None:
        """The last replies go out; requests still running are left pending, and the heartbeat is deleted,
        so another engine resumes them at once."""
        await self._transport.flush()
        if self._kv_publishing is not None:
            await self._kv_publishing
        if self._runs.owned:
            log.warning("leaving %d unfinished requests to other engines", len(self._runs.owned))
        await self.broker.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _engine_params(msg: RequestMsg) -> SamplingParams | PoolingParams | Exception:
    """Built once per request, before its run (``n`` sizes it); what the build raised fails the request alone
    (``Worker._rejected``). An embedding request carries PoolingParams instead of sampling ones."""
    try:
        return SamplingParams(**msg.params) if msg.pooling is None else PoolingParams(**msg.pooling)
    except Exception as exc:
        return exc


def take_kv_snapshot(engine: Engine, engine_id: str, model: str, tenants: dict[str, str]) -> tuple[bytes, float]:
    """The engine's KV snapshot encoded, and the seconds until the next may be taken: KV_SNAPSHOT_INTERVAL_S,
    or longer when this one's CPU time was over KV_SNAPSHOT_SHARE of that (a pause of this thread while
    another process ran is no cost of it)."""
    started = time.thread_time()
    payload = encode(kv_snapshot_msg(engine_id, model, engine.kv_snapshot(), tenants))
    return payload, max(KV_SNAPSHOT_INTERVAL_S, (time.thread_time() - started) / KV_SNAPSHOT_SHARE)


def tune_gc() -> None:
    """For a worker process, once its engine is loaded. The worker allocates a few objects per token per
    step: with the default thresholds, young collections run several times a step and full ones walk every
    object of torch and the model (measured: ~1.2 us of worker CPU per token at 256 streams,
    loadtest/bench_broker.py). Frozen, those are out of the collector's reach; collections get rarer."""
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)
