"""Where a gateway's submissions go over Redis: each to the engine that holds the longest part of its prompt
(``service.routing``'s rule, asked of the engines' published prefix sets in one round trip a batch), or to the
shared stream. It remembers which engine each live request went to, fresher than the engines' beats."""
from __future__ import annotations

from collections import Counter

from redis.asyncio import Redis

from service.broker import BROKER_ERRORS
from service.config import GatewayConfig
from service.messages import Heartbeat, RequestMsg
from service.redis_keys import PREFIX_KEY_BYTES, Keys
from service.routing import RecentPrefixes, choose_engine, leading_hits, prompt_block_keys

# Prompt blocks remembered with the engine that took them: about a minute of a busy gateway's prompts, each
# believed for a few engine heartbeats (its published summary covers it by then).
_RECENT_KEYS = 1 << 17
_RECENT_TTL_S = 5.0


class PrefixRouter:
    def __init__(self, keys: Keys, config: GatewayConfig) -> None:
        self._keys = keys
        self._enabled = config.prefix_routing
        self._slack = config.route_slack
        self._recent = RecentPrefixes(_RECENT_KEYS, _RECENT_TTL_S)
        self._prompt_keys: dict[str, dict[int, list[bytes]]] = {}  # request id -> block size -> keys, until taken
        # request id -> the engine this gateway's live request was routed to or taken by (fresher than beats)
        self._engine_of: dict[str, str] = {}

    async def routes(self, client: Redis, batch: list[RequestMsg], engines: dict[str, Heartbeat]) -> list[str | None]:
        """Each request's engine by cached prefix, None for the shared stream: one round trip for the batch;
        a failed one routes nothing."""
        plan, pipe = [], client.pipeline(transaction=False)
        for i, msg in enumerate(batch):
            for engine_id, beat in engines.items() if self._enabled else ():
                if beat.block_size and beat.model == msg.model:
                    keys = self._block_keys(msg, beat.block_size)
                    if keys:
                        pipe.smismember(self._keys.prefixes(engine_id), keys)
                        plan.append((i, engine_id, keys, beat.block_size))
        if not plan:
            return [None] * len(batch)
        try:
            found = await pipe.execute()
        except BROKER_ERRORS:
            return [None] * len(batch)
        hits: list[dict[str, int]] = [{} for _ in batch]
        for (i, engine_id, keys, block_size), members in zip(plan, found):
            recent = self._recent.holds(keys, engine_id)
            hits[i][engine_id] = leading_hits([m or r for m, r in zip(members, recent)]) * block_size
        loads = self._loads(engines)
        return [choose_engine(h, loads, self._slack) for h in hits]

    def routed(self, request_id: str, engine_id: str) -> None:
        self._engine_of[request_id] = engine_id

    def accepted(self, request_id: str, engine_id: str, beat: Heartbeat | None) -> None:
        """The engine that took a request holds its prompt's blocks from now on (its summary says so later)."""
        by_size = self._prompt_keys.pop(request_id, None)
        if by_size and beat is not None and beat.block_size in by_size:
            self._recent.record(by_size[beat.block_size], engine_id)
        self._engine_of[request_id] = engine_id

    def forget(self, request_id: str) -> None:
        self._prompt_keys.pop(request_id, None)
        self._engine_of.pop(request_id, None)

    def _block_keys(self, msg: RequestMsg, block_size: int) -> list[bytes]:
        """The prompt's block keys at ``block_size``, kept until an engine takes the request (``accepted``)."""
        by_size = self._prompt_keys.setdefault(msg.request_id, {})
        if block_size not in by_size:
            by_size[block_size] = prompt_block_keys(msg.prompt_token_ids, msg.cache_salt, block_size, PREFIX_KEY_BYTES)
        return by_size[block_size]

    def _loads(self, engines: dict[str, Heartbeat]) -> dict[str, int]:
        """Each live engine's requests (running or waiting): as its last beat said, or as this gateway counts
        its own there if more (the beat is up to an interval old); a nearly full KV pool counts as busy."""
        local = Counter(self._engine_of.values())
        return {engine_id: max(beat.stats.num_requests_running + beat.stats.num_requests_waiting, local[engine_id])
                + (self._slack + 1 if beat.stats.kv_cache_usage >= 0.95 else 0)
                for engine_id, beat in engines.items()}
