"""What travels over Redis: msgpack maps with a schema version (explicit fields, no code objects).

Each message type is a dataclass; ``encode`` writes its fields plus ``v`` and
``decode`` checks the version and the field set, so a gateway and a worker of
different releases fail loudly instead of misreading each other.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import msgpack

from engine.outputs import TokenLogprobs
from engine.stats import EngineStats

# 2: a Heartbeat's figures are EngineStats fields; 3: a RequestMsg names its model; 4: its params carry
# beam search (use_beam_search, best_of, length_penalty, early_stopping)
SCHEMA_VERSION = 4

T = TypeVar("T")


class SchemaError(ValueError):
    """A payload that is not a valid message of the expected type."""


@dataclass(slots=True)
class RequestMsg:
    """A generation request, gateway -> request stream."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams fields
    gateway_id: str
    arrival_time: float
    model: str  # the served model it is for: only an engine serving that model may take it
    cache_salt: str | None = None


@dataclass(slots=True)
class ChoiceDelta:
    """New tokens of one choice since the previous event. ``logprobs`` holds one
    list of ``(token_id, logprob)`` pairs per new token, the engine's
    ``TokenLogprobs`` (msgpack carries the pairs as 2-lists; maps with int keys
    are avoided on purpose)."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None


class EventKind(enum.StrEnum):
    """What a ReplyEvent says; travels as its string value."""

    ACCEPTED = "accepted"  # an engine owns the request now
    OUTPUT = "output"  # token deltas
    ERROR = "error"  # the request failed; ``status`` is an HTTP-like code


@dataclass(slots=True)
class ReplyEvent:
    """One event on a request's reply stream, worker -> gateway."""

    kind: EventKind
    engine_id: str
    incarnation: str = ""  # of the engine process, see Heartbeat
    choices: list[ChoiceDelta] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    status: int = 500

    def __post_init__(self) -> None:
        self.kind = EventKind(self.kind)  # a decoded event carries the plain string


@dataclass(slots=True)
class Heartbeat:
    """An engine's liveness and figures; the key holding it expires when the
    engine stops beating, which is how gateways notice a dead engine. A restarted
    engine keeps its id (e.g. a pod name) but not its incarnation: the requests of
    the one before are failed, not waited for."""

    engine_id: str
    incarnation: str
    model: str
    max_model_len: int
    stats: EngineStats  # a map of its field names on the wire


def encode(msg: Any) -> bytes:
    body = _fields(msg)
    if isinstance(msg, ReplyEvent):
        body["choices"] = [_fields(c) for c in msg.choices]
    elif isinstance(msg, Heartbeat):
        body["stats"] = _fields(msg.stats)
    body["v"] = SCHEMA_VERSION
    return msgpack.packb(body, use_bin_type=True)


def params_to_wire(params: Any) -> dict[str, Any]:
    """SamplingParams as a plain map; the worker rebuilds (and re-validates) it."""
    return _fields(params)


def _fields(msg: Any) -> dict[str, Any]:
    return {f.name: getattr(msg, f.name) for f in fields(msg)}


def decode(cls: type[T], payload: bytes) -> T:
    try:
        body = msgpack.unpackb(payload, raw=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise SchemaError(f"undecodable {cls.__name__} payload: {exc}") from exc
    if not isinstance(body, dict):
        raise SchemaError(f"{cls.__name__} payload is not a map")
    version = body.pop("v", None)
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{cls.__name__} schema version {version!r}, expected {SCHEMA_VERSION}")
    if cls is ReplyEvent:
        body["choices"] = [_from_fields(ChoiceDelta, c) for c in body.get("choices", [])]
    elif cls is Heartbeat and "stats" in body:
        body["stats"] = _from_fields(EngineStats, body["stats"])
    return _from_fields(cls, body)


def _from_fields(cls: type[T], body: Any) -> T:
    if not isinstance(body, dict):
        raise SchemaError(f"{cls.__name__} is not a map")
    names = {f.name for f in fields(cls)}
    unknown = set(body) - names
    if unknown:
        raise SchemaError(f"{cls.__name__} has unknown fields {sorted(unknown)}")
    try:
        return cls(**body)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"{cls.__name__}: {exc}") from exc
