"""Drives one LLMEngine from the broker's request queue (Redis in deployments,
``service.memory_broker`` in unit tests).

Each iteration: pull new requests only if the engine has room (so idle engines
take the work: pull-based balancing), apply aborts, run one engine step, and
publish every reply of the step in one call, overlapping the next step. With the
Redis broker and ``step_lane`` on, the publish and the poll ride on the step itself
(the step lane, ``service.step_lane``): sent just before the step, read just after it, on the
thread that steps (while steps are long, the poll goes out after the step instead: a request that
arrives during one then joins the next step, not the one after); a step after a short one runs on
the event loop's thread (no hand-off), a long one in a dedicated thread, so the heartbeat keeps going. When
the lane is down, the same calls go through the broker's asyncio client while the
step runs in the thread. Every heartbeat interval, between steps, it
also takes over the requests of dead engines (resuming each where its transcript
ends) and aborts requests whose gateway has been gone for ``orphan_grace_s``
unless a live gateway adopted them (a client resumed its stream there).

Replies are never dropped on a broker error: they stay in the outbox, in order,
and go out with the next try (the gateway drops what landed twice, by index),
for up to ``reply_ttl_s``. A request's counted events (OUTPUT, ERROR) are
numbered 0, 1, 2, ... across engines: a resumed one continues the count.

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
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from engine.core.kv_snapshot import KVSnapshot
from engine.outputs import RequestOutput, ResumeState
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

from service.broker_api import (BrokerUnavailable, LaneBroker, Pulled, Reply, RequestHandle, WorkerBroker,
                                kv_snapshot_ttl_s)
from service.config import WorkerConfig
from service.messages import (EventKind, EventRow, GatewayBeat, Heartbeat, Progress, ReplyEvent, encode, event_row,
                              kv_snapshot_msg, output_row)

log = logging.getLogger(__name__)

_RECENT_ABORTS = 10_000  # ids remembered so a request aborted while queued is never started
_RETRY_S = 0.5
EXIT_FAILED_STEPS = 3
KV_SNAPSHOT_INTERVAL_S = 0.5  # at most 2 Hz
KV_SNAPSHOT_SHARE = 0.005  # of the wall clock spent taking them, at most

Published = list[Reply]


@runtime_checkable
class Engine(Protocol):
    """What the worker needs of an engine; ``LLMEngine`` is one. Never called
    while a step runs: the worker steps it on one thread and reads it between steps."""

    max_model_len: int

    def prefix_cache_summary(self) -> tuple[int, set[bytes]]: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    cache_salt: str | None = None, resume: ResumeState | None = None, priority: int = 0) -> None: ...

    def abort_request(self, request_ids: list[str]) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def has_capacity(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def kv_snapshot(self) -> KVSnapshot: ...


@dataclass(slots=True)
class _Run:
    """A request this worker answers: where its replies go, and what it delivered (for checkpoints)."""

    handle: RequestHandle
    next_index: int
    tokens: list[list[int]]  # per choice
    reasons: list[str | None]
    num_cached_tokens: int = 0
    checkpointed: int = 0  # next_index at the last checkpoint that landed
    tenant: str = ""  # RequestMsg.tenant: shown with its blocks in the KV snapshot

    def progress(self, time_ms: int) -> Progress:
        # No logprobs: a resuming engine needs the tokens only, a gateway replay reads every event.
        return Progress(self.handle.request_id, self.next_index, [list(t) for t in self.tokens], list(self.reasons),
                        None, self.num_cached_tokens, time_ms)


@dataclass(slots=True)
class _Polled:
    pulled: list[Pulled]
    aborts: list[str]
    gateways: dict[str, GatewayBeat] | None = None  # read every heartbeat interval


class Worker:
    def __init__(self, config: WorkerConfig, engine: Engine, model_name: str, broker: WorkerBroker) -> None:
        self.config = config
        self.engine = engine
        self.model_name = model_name
        self.incarnation = broker.incarnation
        self.broker = broker
        self._lane = broker if config.step_lane and isinstance(broker, LaneBroker) else None
        self.exit_code = 0
        self._owned: dict[str, _Run] = {}
        self._recent_aborts: dict[str, None] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-step")
        self._stats: EngineStats = engine.stats()
        self._stats_time = 0.0
        self._prefixes: tuple[int, set[bytes]] = engine.prefix_cache_summary()  # (block size, hashes)
        self._prefixes_time = 0.0
        self._kv_snapshot_at = 0.0  # monotonic: the next KV snapshot is due then
        self._kv_publishing: asyncio.Task | None = None
        self._publishing: asyncio.Task | None = None
        self._outbox: Published = []
        self._outbox_failing_since: float | None = None
        self._sent_log: deque[tuple[float, Published]] = deque()  # (monotonic, items): what may need resending
        self._outage_since: float | None = None  # the first failed publish since the last good beat
        self._checkpoint_at = 0.0
        self._housekeeping_at = 0.0
        self._gateway_gone_since: dict[str, float] = {}
        self._iterations = 0  # the heartbeat stops when this stands still (a hung step)
        self._beat_ok_at = time.monotonic()
        self._failed_steps = 0
        self._last_step_s = float("inf")  # the last lane step's duration: the next runs inline after a short one
        self._drain_deadline: float | None = None

    def stop(self) -> None:
        """Drains: no new requests; those in flight finish for up to ``drain_timeout_s``."""
        if self._drain_deadline is None:
            self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
            log.info("draining: %d requests in flight", len(self._owned))

    async def run(self) -> int:
        """Serves until drained or failed; the process's exit code."""
        await self.broker.start()
        beat = asyncio.create_task(self._beat())
        log.info("worker %s serving %s", self.config.engine_id, self.model_name)
        try:
            while not self._done():
                await self._iterate_safely()
                self._iterations += 1
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
        room = self._room()
        if self.engine.has_unfinished_requests():
            events, polled = await self._step_while_polling(room)
        else:
            await self._publish_later([])  # nothing may linger while idle
            if not room:
                await asyncio.sleep(_RETRY_S)  # idle yet full (or draining) should not happen; never spin
            events, polled = [], await self._poll(room, block=True)
        # Between steps: the engine is only ever touched while no step runs.
        self._remember_aborts(polled.aborts)
        events += await self._admit(polled.pulled) + self._abort_owned(polled.aborts)
        if polled.gateways is not None:
            events += self._abort_orphans(polled.gateways)
        dropped, resent = await self._taken_over(events)
        await self._publish_later(resent + events, dropped,
                                  for_lane=self.engine.has_unfinished_requests() and self._lane_ready())
        self._refresh_stats()
        if self.broker.kv_wanted:
            self._take_kv_snapshot()

    def _room(self) -> int:
        """How many new requests to pull: none while full or draining."""
        return self.config.max_pull if self.engine.has_capacity() and self._drain_deadline is None else 0

    def _lane_ready(self) -> bool:
        return self._lane is not None and self._lane.lane_ready()

    async def _step_while_polling(self, room: int) -> tuple[Published, _Polled]:
        """The Redis round trips for new requests and aborts, and the last replies' publish, overlap the
        engine step: on the broker's step lane when it has one, else on the event loop."""
        if self._lane_ready():
            return await self._step_on_lane(room)
        if self._publishing is None and self._outbox:  # kept for the lane, which is down now
            self._publishing = asyncio.create_task(self._flush())
        step = asyncio.ensure_future(self._step())
        try:
            polled = await self._poll(room, block=False)
        except BrokerUnavailable as exc:
            log.warning("polling: %s", exc)
            polled = _Polled([], [])
        return await step, polled

    async def _step_on_lane(self, room: int) -> tuple[Published, _Polled]:
        """One exchange on the step thread around the step: the outbox and the due checkpoints go out just
        before it, new requests and aborts come back just after; no event-loop round trip in between."""
        if self._publishing is not None:  # a flush from an idle moment: it lands (or fails) first
            previous, self._publishing = self._publishing, None
            await previous
        items, runs, checkpoints = self._outgoing()
        if self._last_step_s < self.config.heartbeat_interval_s / 5:
            # On the loop thread: the hand-off to the step thread and back costs more than the rest of a
            # short step's broker work (~1.3 us a token at 256 streams). The beat waits for the step, so
            # only a step after a short one runs here: a long one (a large prefill) goes to the thread.
            call, outputs = self._lane_step(items, checkpoints, room)
            await asyncio.sleep(0)  # the beat and other tasks get their turn
        else:
            loop = asyncio.get_running_loop()
            call, outputs = await loop.run_in_executor(self._executor, self._lane_step, items, checkpoints, room)
        try:
            self._lane.lane_published(call)
        except BrokerUnavailable as exc:
            self._keep_outbox(exc)
            return self._step_outputs(outputs), _Polled([], [])
        self._sent(len(items), runs)
        try:
            polled = await self._housekeep(_Polled(*await self._lane.lane_polled(call)), room)
        except BrokerUnavailable as exc:
            log.warning("polling: %s", exc)
            polled = _Polled([], [])
        return self._step_outputs(outputs), polled

    def _lane_step(self, items: Published, checkpoints: list[Progress], room: int) -> tuple[Any, Any]:
        """(the lane's call, the step's outputs or the exception it raised), on either thread."""
        long_steps = self._last_step_s >= self.config.poll_after_step_s
        call = self._lane.lane_send(items, checkpoints, None if long_steps else room)
        started = time.monotonic()
        try:
            return call, self.engine.step()
        except Exception as exc:
            return call, exc
        finally:
            self._last_step_s = time.monotonic() - started
            self._lane.lane_receive(call, self._room())  # a drain begun during the step pulls nothing

    async def _poll(self, room: int, block: bool) -> _Polled:
        pulled, aborts = await self.broker.poll(room, block)
        return await self._housekeep(_Polled(pulled, aborts), room)

    async def _housekeep(self, polled: _Polled, room: int) -> _Polled:
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

    async def _taken_over(self, events: Published) -> tuple[set[str], Published]:
        """After a gap in the beats longer than their TTL (a hung step, Redis out of reach), other engines may
        have resumed some of this one's requests: those are dropped here, their replies unpublished. After
        Redis lost its state (restarted empty), ownership of the rest is re-asserted, their checkpoints are
        written again with the next publish, and the replies it may have lost unread go out again (the
        gateways drop what they had, by index). Returns (dropped ids, replies to send again)."""
        lost_state = self.broker.lost_state
        if time.monotonic() - self._beat_ok_at <= self.config.heartbeat_ttl_s and not lost_state:
            return set(), []
        handles = {h.request_id: h for h, _ in self._outbox + events}
        handles |= {rid: run.handle for rid, run in self._owned.items()}
        try:
            lost = {h.request_id for h in await self.broker.taken_over(list(handles.values()))}
        except BrokerUnavailable:
            return set(), []
        for run in self._owned.values():
            run.checkpointed = -1
        self._checkpoint_at = 0.0  # with the next publish, not an interval later: until then a resume has a hole
        if lost:
            log.warning("%d requests were resumed by other engines while this one stalled: dropping them", len(lost))
            self._end([rid for rid in lost if rid in self._owned], EventKind.OUTPUT)
        # A beat that lapsed (a hung step) expired its key: no restart, nothing lost, unless a publish failed.
        return lost, self._resend(lost) if lost_state and self._outage_since is not None else []

    def _resend(self, dropped: set[str]) -> Published:
        """The replies sent in the last ``replay_window_s`` before the outage, as replays: no queue entry
        is acked again (the handle's entry id is empty)."""
        items = [(RequestHandle(h.request_id, h.gateway_id, b""), row)
                 for _, sent in self._sent_log for h, row in sent if h.request_id not in dropped]
        self._sent_log.clear()
        self._outage_since = None
        if items:
            log.warning("Redis lost its state: sending the last %d replies again", len(items))
        return items

    async def _publish_later(self, events: Published, dropped: set[str] = frozenset(), for_lane: bool = False) -> None:
        """Publishes while the next step runs (``for_lane``: the next step's lane exchange carries the
        outbox); waits for the previous call first, so each request's replies stay in order. What failed
        to go out goes first next time."""
        previous, self._publishing = self._publishing, None
        if previous is not None:
            await previous
        self._outbox += events
        if dropped:
            self._outbox = [item for item in self._outbox if item[0].request_id not in dropped]
        if self._outbox and not for_lane:
            self._publishing = asyncio.create_task(self._flush())

    async def _flush(self) -> None:
        items, runs, checkpoints = self._outgoing()
        try:
            await self.broker.publish(items, checkpoints)
        except BrokerUnavailable as exc:
            self._keep_outbox(exc)
            return
        self._sent(len(items), runs)

    def _outgoing(self) -> tuple[Published, list[_Run], list[Progress]]:
        """The outbox and the checkpoints due with it; the outbox is only added to until ``_sent``."""
        runs, now_ms = self._checkpoint_due(), int(time.time() * 1000)
        return self._outbox, runs, [run.progress(now_ms) for run in runs]

    def _sent(self, count: int, runs: list[_Run]) -> None:
        sent, self._outbox, self._outbox_failing_since = self._outbox[:count], self._outbox[count:], None
        for run in runs:
            run.checkpointed = run.next_index
        self._log_sent(sent)

    def _log_sent(self, sent: Published) -> None:
        """Keeps the last ``replay_window_s`` of sent replies: Redis without persistence may ack them and
        die before a gateway reads them. Counted back from the first failed publish while an outage lasts,
        so the publishes into a restarted Redis (before a beat finds it empty) do not push them out."""
        now = time.monotonic()
        if sent:
            self._sent_log.append((now, sent))
        horizon = min(now, self._outage_since or now) - self.config.replay_window_s
        while self._sent_log and self._sent_log[0][0] < horizon:
            self._sent_log.popleft()

    def _checkpoint_due(self) -> list[_Run]:
        """The requests whose delivered count moved since their last checkpoint, every checkpoint interval.
        Taken with the outbox: a checkpoint never covers an event that has not gone out with it."""
        now = time.monotonic()
        if now < self._checkpoint_at:
            return []
        self._checkpoint_at = now + self.config.checkpoint_interval_s
        return [run for run in self._owned.values() if run.next_index != run.checkpointed]

    def _keep_outbox(self, exc: BrokerUnavailable) -> None:
        now = time.monotonic()
        self._outage_since = self._outage_since or now
        self._outbox_failing_since = self._outbox_failing_since or now
        if now - self._outbox_failing_since < self.config.reply_ttl_s:
            log.warning("publishing %d replies failed, retrying: %s", len(self._outbox), exc)
            return
        log.error("giving up on %d replies after %ds of broker errors", len(self._outbox), self.config.reply_ttl_s)
        self._outbox, self._outbox_failing_since = [], None

    async def _admit(self, pulled: list[Pulled]) -> Published:
        events: Published = []
        for item in pulled:
            if item.msg is None or (item.resume is not None and item.resume.finished):
                if item.msg is None:
                    log.error("dropping %s", item.error)
                await self._quietly(self.broker.ack(item.handle))  # nothing left to say
                continue
            run = self._new_run(item)
            if item.deliveries >= self.config.max_deliveries:
                reason = f"failed on {item.deliveries} engines"
                await self._quietly(self.broker.dead_letter(item.handle, reason))
                events.append((item.handle, self._counted(run, EventKind.ERROR, finished=True, error=reason)))
                continue
            events.append((item.handle, self._row(item.handle, EventKind.ACCEPTED)))
            if (reply := self._add(item, run)) is not None:
                events.append((item.handle, reply))
        return events

    async def _quietly(self, call: Any) -> None:
        try:
            await call
        except BrokerUnavailable as exc:  # the entry stays pending; a later reclaim meets it again
            log.warning("broker call failed: %s", exc)

    def _new_run(self, item: Pulled) -> _Run:
        n, tenant = item.msg.params.get("n", 1), item.msg.tenant
        if item.resume is None:
            return _Run(item.handle, 0, [[] for _ in range(n)], [None] * n, tenant=tenant)
        tokens, reasons = item.resume.choices(n)
        return _Run(item.handle, item.resume.next_index, tokens, reasons, tenant=tenant)

    def _add(self, item: Pulled, run: _Run) -> EventRow | None:
        msg = item.msg
        if msg.request_id in self._recent_aborts:
            return self._counted(run, EventKind.OUTPUT, finished=True)
        if msg.model != self.model_name:  # the per-model request streams keep this from happening
            return self._counted(run, EventKind.ERROR, finished=True, status=404,
                                 error=f"this engine serves {self.model_name!r}, not {msg.model!r}")
        try:  # a map of another release, or values the gateway let through: a 400 for this request alone
            params = SamplingParams(**msg.params)
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, cache_salt=msg.cache_salt,
                                    resume=_resume_state(run, params), priority=msg.priority)
        except (ValueError, TypeError) as exc:
            return self._counted(run, EventKind.ERROR, finished=True, error=str(exc), status=400)
        except Exception as exc:  # a bad request must not take the worker down
            log.exception("add_request failed for %s", msg.request_id)
            return self._counted(run, EventKind.ERROR, finished=True, error=f"engine error: {exc}")
        if item.resume is not None:
            log.info("resuming %s at event %d", msg.request_id, run.next_index)
        self._owned[msg.request_id] = run
        return None

    def _remember_aborts(self, aborts: list[str]) -> None:
        for request_id in aborts:
            self._recent_aborts[request_id] = None
        while len(self._recent_aborts) > _RECENT_ABORTS:
            del self._recent_aborts[next(iter(self._recent_aborts))]

    def _abort_owned(self, aborts: list[str]) -> Published:
        owned = [rid for rid in dict.fromkeys(aborts) if rid in self._owned]  # a gateway may abort twice
        return self._end(owned, EventKind.OUTPUT)

    def _abort_orphans(self, gateways: dict[str, GatewayBeat]) -> Published:
        """Requests whose gateway has been gone for ``orphan_grace_s`` have no reader, unless a live gateway
        adopted them (their client resumed its stream there): the others are aborted."""
        now = time.monotonic()
        gone = {run.handle.gateway_id for run in self._owned.values()} - gateways.keys()
        self._gateway_gone_since = {g: self._gateway_gone_since.get(g, now) for g in gone}
        expired = {g for g, since in self._gateway_gone_since.items() if now - since >= self.config.orphan_grace_s}
        adopted = {rid for beat in gateways.values() for rid in beat.adopted}
        orphans = [rid for rid, run in self._owned.items() if run.handle.gateway_id in expired and rid not in adopted]
        if orphans:
            log.warning("aborting %d requests whose gateway is gone", len(orphans))
        return self._end(orphans, EventKind.ERROR, error="the request's gateway is gone", status=503)

    def _end(self, request_ids: list[str], kind: EventKind, **fields: Any) -> Published:
        """Aborts owned requests in the engine (their blocks go back to the pool now), with a final event each."""
        if request_ids:
            self.engine.abort_request(request_ids)
        return self._final_events(request_ids, kind, **fields)

    def _final_events(self, request_ids: list[str], kind: EventKind, **fields: Any) -> Published:
        runs = [self._owned.pop(rid) for rid in request_ids]
        return [(run.handle, self._counted(run, kind, finished=True, **fields)) for run in runs]

    async def _step(self) -> Published:
        loop = asyncio.get_running_loop()
        try:
            outputs = await loop.run_in_executor(self._executor, self.engine.step)
        except Exception as exc:
            outputs = exc
        return self._step_outputs(outputs)

    def _step_outputs(self, outputs: list[RequestOutput] | Exception) -> Published:
        if isinstance(outputs, Exception):
            log.error("engine step failed; failing its requests", exc_info=outputs)
            self._count_step(failed=True)
            return self._fail_all(f"engine step failed: {outputs}", status=500)
        # The engine fails a bad request alone, not the step: a step that failed requests and produced no
        # token failed too (a broken device fails every request it runs, one after the other).
        if any(out.error for out in outputs):
            self._count_step(failed=not any(c.token_ids for out in outputs for c in out.outputs))
        elif outputs:
            self._failed_steps = 0
        return [item for out in outputs if (item := self._output_reply(out)) is not None]

    def _count_step(self, failed: bool) -> None:
        self._failed_steps = self._failed_steps + 1 if failed else 0
        if self._failed_steps >= self.config.max_failed_steps:
            log.error("%d engine steps failed in a row: exiting for the supervisor to restart the engine",
                      self._failed_steps)
            self.exit_code = EXIT_FAILED_STEPS

    def _output_reply(self, out: RequestOutput) -> Reply | None:
        run = self._owned.get(out.request_id)
        if run is None:
            return None  # aborted here already
        if out.finished:
            del self._owned[out.request_id]
        if out.error:
            return run.handle, self._counted(run, EventKind.ERROR, finished=True, error=out.error)
        for c in out.outputs:
            run.tokens[c.index] += c.token_ids
            run.reasons[c.index] = c.finish_reason
        run.num_cached_tokens = out.num_cached_tokens
        run.next_index += 1
        return run.handle, output_row(out.request_id, run.next_index - 1, out.outputs, out.finished,
                                      out.num_cached_tokens, out.prompt_logprobs)

    def _fail_all(self, error: str, status: int) -> Published:
        """Every owned request ends with an error event, even if the engine cannot abort them (a broken step)."""
        request_ids = list(self._owned)
        try:
            if request_ids:
                self.engine.abort_request(request_ids)
        except Exception:
            log.exception("abort after failure failed")
        return self._final_events(request_ids, EventKind.ERROR, error=error, status=status)

    def _refresh_stats(self) -> None:
        # Between steps, on the loop thread: the engine is never read while it steps.
        # Always when idle, so the last figures of a burst are not stale.
        now = time.monotonic()
        if now - self._stats_time >= self.config.heartbeat_interval_s / 2 or not self.engine.has_unfinished_requests():
            self._stats, self._stats_time = self.engine.stats(), now
        if now - self._prefixes_time >= self.config.heartbeat_interval_s:  # a copy of the hash set: once a beat
            self._prefixes, self._prefixes_time = self.engine.prefix_cache_summary(), now

    def _take_kv_snapshot(self) -> None:
        """Between steps, on the loop thread, when due and the last one has gone out; published meanwhile."""
        now = time.monotonic()
        if now < self._kv_snapshot_at or (self._kv_publishing is not None and not self._kv_publishing.done()):
            return
        try:
            tenants = {request_id: run.tenant for request_id, run in self._owned.items()}
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

    def _row(self, handle: RequestHandle, kind: EventKind, **fields: Any) -> EventRow:
        return event_row(handle.request_id, ReplyEvent(kind, self.config.engine_id, self.incarnation, **fields))

    def _counted(self, run: _Run, kind: EventKind, **fields: Any) -> EventRow:
        """An OUTPUT or ERROR event, numbered in its request's sequence."""
        row = self._row(run.handle, kind, index=run.next_index, **fields)
        run.next_index += 1
        return row

    async def _beat(self) -> None:
        """Beats while the loop moves: a step hung for longer than the heartbeat TTL stops the beats, so
        the gateways and the other engines take this one for dead and its requests get resumed."""
        seen, moved_at = -1, time.monotonic()
        while True:
            if self._iterations != seen:
                seen, moved_at = self._iterations, time.monotonic()
            if time.monotonic() - moved_at < self.config.heartbeat_ttl_s:
                await self._send_beat()
            else:
                log.error("the step loop has not moved for %.0fs: not beating", time.monotonic() - moved_at)
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def _send_beat(self) -> None:
        previous_ok, was_lost = self._beat_ok_at, self.broker.lost_state
        try:
            block_size, hashes = self._prefixes
            await self.broker.heartbeat(Heartbeat(self.config.engine_id, self.incarnation, self.model_name,
                                                  self.engine.max_model_len, self._stats, block_size), hashes)
            self._beat_ok_at = time.monotonic()
            if not self.broker.lost_state:
                self._outage_since = None  # Redis kept its state: nothing sent before the outage was lost
            elif not was_lost and (self.broker.server_changed
                                   or self._beat_ok_at - previous_ok <= self.config.heartbeat_ttl_s):
                # This beat found the key gone before its TTL (Redis restarted empty), or another server (a
                # promoted replica, which may lack the last writes): replies may have been lost unread.
                self._outage_since = self._outage_since or previous_ok
        except BrokerUnavailable as exc:
            log.warning("heartbeat failed: %s", exc)
        except Exception:  # the beat task must outlive any bug: without it, others take this engine for dead
            log.exception("heartbeat failed")

    async def _shutdown(self) -> None:
        """The last replies go out; requests still running are left pending, and the heartbeat is deleted,
        so another engine resumes them at once."""
        await self._publish_later([])
        if self._publishing is not None:
            await self._publishing
        if self._kv_publishing is not None:
            await self._kv_publishing
        if self._owned:
            log.warning("leaving %d unfinished requests to other engines", len(self._owned))
        await self.broker.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


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


def _resume_state(run: _Run, params: SamplingParams) -> ResumeState | None:
    """The engine continues from the delivered tokens; beam search (published only at its end) restarts."""
    if params.use_beam_search or not any(run.tokens):
        run.tokens, run.reasons = [[] for _ in run.tokens], [None] * len(run.reasons)
        return None
    return ResumeState([list(t) for t in run.tokens], list(run.reasons))
