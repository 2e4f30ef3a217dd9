"""A Redis worker's publish and poll on the step lane (``service.step_lane``), around the engine step: the
publish's commands and the poll's go out just before the step, their replies are read just after it, on the
thread that steps; the new entries are claimed there too, in an exchange of their own. What the exchange
read is handed to the event loop (``published``, ``polled``). See ``service.broker_api.LaneExchange``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from redis.exceptions import ResponseError

from service.broker import _unavailable_on_error
from service.broker_api import Pulled, Reply, RequestHandle
from service.errors import BrokerUnavailable
from service.messages import Progress
from service.redis_claims import Claims, Entry, read_entries, stream_entries
from service.redis_intake import Intake
from service.redis_replies import ReplyCommands
from service.step_lane import StepLane


@dataclass(slots=True)
class LaneCall:
    """One exchange on the step lane: the publish's commands first, then the poll's (sent with them, or in an
    exchange of their own after the step: ``poll_after``)."""

    publish: int  # how many commands are the publish's
    pulls: bool  # the poll asked for new entries (XREADGROUP), before the aborts (XREAD)
    finished: list[RequestHandle]
    sent: bool
    poll_after: bool = False  # the poll waits for the step, in an exchange of its own
    replies: list | None = None  # None: the exchange failed
    fresh: list[Entry] = field(default_factory=list)  # the entries the poll delivered
    pulled: list[Pulled] = field(default_factory=list)  # read from them
    owners: list | None = None  # ``Claims.own``'s replies for the readable ones; None: that exchange failed


class WorkerLane:
    def __init__(self, connection: StepLane, intake: Intake, claims: Claims, replies: ReplyCommands) -> None:
        self._connection = connection
        self._intake = intake
        self._claims = claims
        self._replies = replies

    def ready(self) -> bool:
        """The lane may carry the next step's exchange: it is connected (or due for a try) and no failed
        read left entries to recover (the asyncio ``poll`` does that)."""
        return not self._intake.recovering and self._connection.ready()

    def send(self, items: list[Reply], checkpoints: list[Progress], count: int | None) -> LaneCall:
        """Step thread, before the step: the publish's commands, then the poll's (non-blocking) for up to
        ``count`` new entries. None: the poll waits for the step (``receive``), so that what arrives during a
        long step joins the next one, not the one after (an exchange more per step)."""
        commands, finished = self._replies.publish(items, checkpoints)
        if count is None:
            return LaneCall(len(commands), False, finished, self._connection.send(commands), poll_after=True)
        return LaneCall(len(commands), bool(count), finished,
                        self._connection.send(commands + self._intake.poll_commands(count)))

    def receive(self, call: LaneCall, count: int) -> None:
        """Step thread, after the step: the replies; the poll for up to ``count`` entries if it waited for the
        step (``count`` as the step left room); new entries claimed (``Claims.own``) in another exchange at once."""
        call.replies = self._connection.receive() if call.sent else None
        if call.replies is not None and call.poll_after:
            poll, call.pulls = self._intake.poll_commands(count), bool(count)
            polled = self._connection.receive() if self._connection.send(poll) else None
            # Failed, the poll may still have delivered entries: its errors have ``polled`` recover them.
            call.replies += polled or [ResponseError("the step lane's poll failed")] * len(poll)
        if not call.pulls or call.replies is None or isinstance(reply := call.replies[call.publish], ResponseError):
            return
        call.fresh = self._claims.not_running(stream_entries(_stream_reply(reply)))
        call.pulled = read_entries(call.fresh)
        ids = [p.msg.request_id for p in call.pulled if p.msg is not None]
        if ids and self._connection.send(self._claims.own_commands(ids)):
            owners = self._connection.receive()
            call.owners = None if owners is None or any(isinstance(o, ResponseError) for o in owners) else owners
        elif not ids:
            call.owners = []

    def published(self, call: LaneCall) -> None:
        """Raises BrokerUnavailable unless the whole publish landed (the caller keeps its items then)."""
        if call.replies is None or any(isinstance(r, ResponseError) for r in call.replies[:call.publish]):
            self._intake.reply_lost()  # the poll's entries may have been delivered, their reply lost
            raise BrokerUnavailable("cannot reach Redis: the step lane's exchange failed")
        self._claims.release(call.finished)

    @_unavailable_on_error
    async def polled(self, call: LaneCall) -> tuple[list[Pulled], list[str]]:
        """The poll's part of a published call, as ``poll`` returns it. A command's error (say NOGROUP after
        Redis restarted empty) is left to the next ``poll``, which recovers."""
        replies = call.replies[call.publish:]
        # A failed claim may have landed: the entries stay pending here, and the next poll's recovery
        # claims them as this consumer's own.
        if any(isinstance(r, ResponseError) for r in replies) or (call.pulls and call.owners is None):
            self._intake.reply_lost()
            return [], []
        try:
            pulled = await self._claims.claimed(call.fresh, call.pulled, call.owners, mine_ok=False)
        except Exception:
            self._intake.reply_lost()
            raise
        return pulled, self._intake.read_aborts(_stream_reply(replies[-1]))

    def close(self) -> None:
        self._connection.close()


def _stream_reply(reply: list | None) -> list[tuple[bytes, list[tuple[bytes, dict]]]]:
    """A raw XREAD/XREADGROUP reply in redis-py's shape: per stream, (entry id, fields as a dict)."""
    return [(name, [(entry_id, dict(zip(flat[::2], flat[1::2])) if flat else {}) for entry_id, flat in entries])
            for name, entries in reply or []]
