"""A Redis worker's publish, as raw commands (for the asyncio client or the step lane): one ReplyBatch entry
per gateway per call (its cost is O(gateways), not O(requests)), the Progress checkpoints after them in the
same pipeline (a checkpoint never covers an event that did not land), and a finished request's entry acked
and deleted.
"""
from __future__ import annotations

import time

from service.broker import UNFINISHED_TTL_S
from service.broker_api import Reply, RequestHandle, rows_by_gateway
from service.messages import ROW_FINISHED, Progress, encode, pack_batch
from service.redis_claims import ack_commands
from service.redis_keys import Keys
from service.step_lane import Command


class ReplyCommands:
    def __init__(self, keys: Keys, engine_id: str, incarnation: str, reply_ttl_s: int, default_stream: str) -> None:
        self._keys = keys
        self._engine_id = engine_id
        self._incarnation = incarnation
        self._reply_ttl_s = reply_ttl_s
        self._default_stream = default_stream  # of the handles that name none
        self._expire_due: dict[str, float] = {}  # gateway id -> when its out stream's TTL is renewed next

    def publish(self, items: list[Reply], checkpoints: list[Progress]) -> tuple[list[Command], list[RequestHandle]]:
        """``publish``'s commands, and the finished requests among the items (their entries acked)."""
        commands: list[Command] = []
        min_id = f"{int(time.time() * 1000) - self._reply_ttl_s * 1000}-0"
        now = time.monotonic()
        for gateway_id, rows in rows_by_gateway(items).items():
            out = self._keys.out(gateway_id)
            commands.append(("XADD", out, "MINID", "~", min_id, "*", "b",
                             pack_batch(self._engine_id, self._incarnation, rows)))
            if self._expire_due.get(gateway_id, 0.0) <= now:
                # Gone once nothing wrote to it for the retention window: renewed every second or so, not every step.
                commands.append(("EXPIRE", out, self._reply_ttl_s))
                self._expire_due[gateway_id] = now + min(1.0, self._reply_ttl_s / 4)
        for progress in checkpoints:
            commands.append(("SET", self._keys.progress(progress.request_id), encode(progress), "EX", UNFINISHED_TTL_S))
        finished = [handle for handle, row in items if row[ROW_FINISHED] and handle.entry_id]  # not a resend
        return commands + self.finish(finished), finished

    def finish(self, handles: list[RequestHandle]) -> list[Command]:
        """The requests' keys expire after the reply retention; their entries are acked and deleted."""
        if not handles:
            return []
        commands: list[Command] = [("EXPIRE", key(handle.request_id), self._reply_ttl_s) for handle in handles
                                   if handle.request_id for key in (self._keys.request, self._keys.owner,
                                                                    self._keys.progress)]
        return commands + ack_commands(handles, self._default_stream)
