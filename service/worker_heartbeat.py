"""A worker's heartbeat: every interval while its step loop moves, with the engine's figures (stats, cached
prefixes) as they were between the last steps. A step hung for longer than the heartbeat TTL stops the beats,
so the gateways and the other engines take this one for dead and its requests get resumed.
"""
from __future__ import annotations

import asyncio
import logging
import time

from engine.stats import EngineStats

from service.broker_api import WorkerBroker
from service.config import WorkerConfig
from service.engine_api import Engine
from service.errors import BrokerUnavailable
from service.messages import Heartbeat
from service.worker_recovery import Recovery

log = logging.getLogger(__name__)


class WorkerHeartbeat:
    def __init__(self, config: WorkerConfig, engine: Engine, model_name: str, broker: WorkerBroker,
                 recovery: Recovery) -> None:
        self.kv_wanted = False  # a dashboard watches this engine (learnt with each beat)
        self._config = config
        self._engine = engine
        self._model_name = model_name
        self._broker = broker
        self._recovery = recovery
        self._iterations = 0  # the beats stop when this stands still (a hung step)
        self._stats: EngineStats = engine.stats()
        self._stats_time = 0.0
        self._prefixes: tuple[int, set[bytes]] = engine.prefix_cache_summary()  # (block size, hashes)
        self._prefixes_time = 0.0

    def moved(self) -> None:
        """The step loop ended an iteration."""
        self._iterations += 1

    def refresh(self) -> None:
        """Between steps, on the loop thread: the engine is never read while it steps. Always when idle, so the
        last figures of a burst are not stale."""
        now = time.monotonic()
        interval = self._config.heartbeat_interval_s
        if now - self._stats_time >= interval / 2 or not self._engine.has_unfinished_requests():
            self._stats, self._stats_time = self._engine.stats(), now
        if now - self._prefixes_time >= interval:  # a copy of the hash set: once a beat
            self._prefixes, self._prefixes_time = self._engine.prefix_cache_summary(), now

    async def run(self) -> None:
        """Beats while the loop moves."""
        seen, moved_at = -1, time.monotonic()
        while True:
            if self._iterations != seen:
                seen, moved_at = self._iterations, time.monotonic()
            if time.monotonic() - moved_at < self._config.heartbeat_ttl_s:
                await self._send()
            else:
                log.error("the step loop has not moved for %.0fs: not beating", time.monotonic() - moved_at)
            await asyncio.sleep(self._config.heartbeat_interval_s)

    async def _send(self) -> None:
        try:
            block_size, hashes = self._prefixes
            beat = Heartbeat(engine_id=self._config.engine_id, incarnation=self._broker.incarnation,
                             model=self._model_name, max_model_len=self._engine.max_model_len, stats=self._stats,
                             block_size=block_size)
            self.kv_wanted = (await self._recovery.beat(self._broker.heartbeat(beat, hashes))).kv_wanted
        except BrokerUnavailable as exc:
            log.warning("heartbeat failed: %s", exc)
        except Exception:  # the beat task must outlive any bug: without it, others take this engine for dead
            log.exception("heartbeat failed")
