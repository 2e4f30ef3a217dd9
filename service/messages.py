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
import numpy as np
import torch

from engine.core.kv_snapshot import KVSnapshot, PoolSnapshot
from engine.multimodal.inputs import ImagePatches
from engine.outputs import CompletionOutput, TokenLogprobs
from engine.pooling_params import PoolingParams
from engine.stats import EngineStats

# 2: a Heartbeat's figures are EngineStats fields; 3: a RequestMsg names its model; 4: its params carry
# beam search (use_beam_search, best_of, length_penalty, early_stopping); 5: replies travel in one
# ReplyBatch per gateway per step, events carry their index; GatewayBeat, StreamRecord, Progress; 6: params
# carry structured_output (a map), logit_bias ([id, bias] pairs) and prompt_logprobs, events prompt_logprobs;
# 7: a RequestMsg carries its priority, a Heartbeat its prefix-cache block size; 8: a RequestMsg carries its tenant,
# a KV snapshot's requests theirs; 9: a RequestMsg may carry pooling (an embedding request), events an embedding;
# 10: a RequestMsg may carry images (each one's patches as float32 bytes, their shape and grid: ``images_to_wire``),
# a KV snapshot's requests the blocks holding image tokens
SCHEMA_VERSION = 10

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
    priority: int = 0  # lower is scheduled first (vLLM's convention)
    tenant: str = ""  # HMAC of the API key: whose request it is (the KV snapshot hides other tenants' ids)
    # PoolingParams fields: an embedding request (its prompt's prefill only; ``params`` is then empty).
    pooling: dict[str, Any] | None = None
    # A vision-language model's preprocessed images, in prompt order (``images_to_wire``).
    images: list[dict[str, Any]] | None = None


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
    # The request's event sequence number: OUTPUT and ERROR events count 0, 1, 2, ... per request, whichever
    # engine sends them (a resuming engine continues the count), so a gateway drops a duplicate (index below
    # the next expected) and detects a gap (above it). ACCEPTED is not counted (CONTROL_INDEX): a resumer's
    # ACCEPTED must reach the gateway even if the dead engine's late events took its place in the sequence.
    index: int = -1
    # The prompt's logprobs (RequestOutput.prompt_logprobs), on the first OUTPUT event of a request that asked.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # An embedding request's vector (RequestOutput.embedding) as float32 little-endian bytes, on its final event.
    embedding: bytes | None = None

    def __post_init__(self) -> None:
        if type(self.kind) is not EventKind:  # a decoded event carries the plain string (the check: 10x cheaper)
            try:
                self.kind = _EVENT_KINDS[self.kind]
            except (KeyError, TypeError):
                raise ValueError(f"{self.kind!r} is not an EventKind") from None


# EventKind(value) runs the enum machinery in Python (~1.5 us a call on a gateway's hot path); a dict is ~0.05.
_EVENT_KINDS = {kind.value: kind for kind in EventKind}


CONTROL_INDEX = -1


@dataclass(slots=True)
class ReplyBatch:
    """Everything one engine step says to one gateway, one stream entry: the worker's cost per step is
    O(gateways), not O(requests). On the wire the events are arrays, not maps (a step carries hundreds):
    ``[request_id, index, kind, choices, finished, num_cached_tokens, error, status, prompt_logprobs, embedding]``
    with each choice ``[index, token_ids, logprobs, finish_reason]``; the engine id and incarnation are said once."""

    engine_id: str
    incarnation: str
    events: list[tuple[str, ReplyEvent]]  # (request id, event), in publishing order


@dataclass(slots=True)
class GatewayBeat:
    """A gateway's liveness (its key expires when it stops beating), and the requests of other, possibly
    dead, gateways that clients resumed here: an engine keeps a request running while its gateway or an
    adopting gateway is alive."""

    gateway_id: str
    adopted: list[str] = field(default_factory=list)


@dataclass(slots=True)
class StreamRecord:
    """What a gateway stores per request at submission, so that any gateway can resume the client's stream
    (SSE ``Last-Event-ID``) and any engine can find the request's replies: the original request body
    (the new gateway re-parses it for stop strings, formats and n), the prompt's token ids, where the
    replies go, and whose API key may resume it (HMAC, never the key)."""

    request_id: str
    gateway_id: str
    body: bytes  # the HTTP request body as received (JSON)
    prompt_token_ids: list[int]
    created: int  # the response objects' ``created``
    arrival_ms: int  # wall clock at submission; replies are in the gateway stream from then on
    tenant: str


@dataclass(slots=True)
class StoredResponse:
    """A Responses API response kept for ``previous_response_id`` and ``GET /v1/responses/{id}`` (the gateway's
    ``--response-ttl``): the Response object and the conversation that led to it, as chat messages (JSON), and
    whose API key may read it (HMAC, never the key)."""

    response_id: str
    tenant: str
    response: bytes  # the Response object (JSON)
    conversation: bytes  # the chat messages of the input and the output, instructions left out (JSON)


@dataclass(slots=True)
class Progress:
    """An engine's periodic checkpoint of one request: the events below ``next_index`` folded into
    per-choice tokens, so a replay reads this plus the gateway stream's tail since ``time_ms`` instead of
    every entry since arrival. Written every few seconds per request, never per token."""

    request_id: str
    next_index: int
    output_token_ids: list[list[int]]  # per choice index
    finish_reasons: list[str | None]
    logprobs: list[list[TokenLogprobs]] | None  # per choice, when the request asked for them
    num_cached_tokens: int
    time_ms: int  # the engine's wall clock when the snapshot was taken: later events are newer than this


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
    block_size: int = 0  # of its prefix cache, whose block hashes it publishes for routing; 0: no prefix caching


@dataclass(slots=True)
class KVSnapshotMsg:
    """An engine's KV snapshot (``engine.core.kv_snapshot``), published while a dashboard watches. Each pool
    is a map of per-block arrays as raw little-endian bytes (``POOL_ARRAYS``: name -> dtype), each request
    ``[request_id, state, num_seqs, block ids as <u4 bytes, tenant, image block ids as <u4 bytes]``: a few bytes a
    block, whatever the pool size."""

    engine_id: str
    model: str
    time: float
    block_size: int
    device: dict[str, bytes]
    cpu: dict[str, bytes]
    requests: list[list]
    stats: EngineStats  # a map of its field names on the wire


POOL_ARRAYS = {"state": "<u1", "ref_count": "<u2", "owner": "<u2", "filled": "<u2", "computed": "<u2"}


def kv_snapshot_msg(engine_id: str, model: str, snap: KVSnapshot, tenants: dict[str, str]) -> KVSnapshotMsg:
    """``tenants``: each request's tenant (RequestMsg.tenant), so a gateway can hide other tenants' ids."""
    rows = [[r.request_id, r.state, r.num_seqs, np.asarray(r.block_ids, "<u4").tobytes(),
             tenants.get(r.request_id, ""), np.asarray(r.image_block_ids, "<u4").tobytes()] for r in snap.requests]
    return KVSnapshotMsg(engine_id=engine_id, model=model, time=snap.time, block_size=snap.block_size,
                         device=_pool_wire(snap.device), cpu=_pool_wire(snap.cpu), requests=rows, stats=snap.stats)


def _pool_wire(pool: PoolSnapshot) -> dict[str, bytes]:
    return {name: getattr(pool, name).astype(dtype, copy=False).tobytes() for name, dtype in POOL_ARRAYS.items()}


def decode_kv_snapshot(payload: bytes) -> KVSnapshotMsg:
    """The message, each pool's arrays checked to cover the same blocks."""
    msg = decode(KVSnapshotMsg, payload)
    for pool in (msg.device, msg.cpu):
        if not isinstance(pool, dict) or pool.keys() != POOL_ARRAYS.keys():
            raise SchemaError(f"a KVSnapshotMsg pool is not a map of {sorted(POOL_ARRAYS)}")
        counts = [len(pool[name]) / np.dtype(dtype).itemsize if isinstance(pool[name], bytes) else -1.0
                  for name, dtype in POOL_ARRAYS.items()]
        if len(set(counts)) != 1 or counts[0] < 0 or not counts[0].is_integer():
            raise SchemaError("a KVSnapshotMsg pool's arrays are not one entry per block")
    if not all(isinstance(r, list) and len(r) == 6 and isinstance(r[3], bytes) and len(r[3]) % 4 == 0
               and isinstance(r[4], str) and isinstance(r[5], bytes) and len(r[5]) % 4 == 0 for r in msg.requests):
        raise SchemaError("malformed KVSnapshotMsg requests")
    return msg


# A ReplyBatch event on the wire: ``[request_id, index, kind, choices, finished, num_cached_tokens, error,
# status, prompt_logprobs, embedding]``, each choice ``[index, token_ids, logprobs, finish_reason]``. The worker
# builds rows directly (``output_row`` runs per request per step, its hottest line); gateways decode them into
# ReplyEvents.
EventRow = list
ROW_FINISHED = 4
EMBEDDING_DTYPE = "<f4"  # what the openai SDK decodes a base64 embedding as (numpy float32, little-endian)
_OUTPUT = EventKind.OUTPUT.value


def event_row(request_id: str, e: ReplyEvent) -> EventRow:
    return [request_id, e.index, e.kind.value, _choice_rows(e.choices), e.finished, e.num_cached_tokens, e.error,
            e.status, e.prompt_logprobs, e.embedding]


def output_row(request_id: str, index: int, outputs: list[CompletionOutput], finished: bool,
               num_cached_tokens: int, prompt_logprobs: list[TokenLogprobs | None] | None = None,
               embedding: list[float] | None = None) -> EventRow:
    """An OUTPUT event's row straight from the engine's outputs (no ReplyEvent, no ChoiceDelta)."""
    return [request_id, index, _OUTPUT, _choice_rows(outputs), finished, num_cached_tokens, None, 500,
            prompt_logprobs, None if embedding is None else np.asarray(embedding, EMBEDDING_DTYPE).tobytes()]


def _choice_rows(choices: list[ChoiceDelta] | list[CompletionOutput]) -> list[list]:
    """Each choice as ``[index, token_ids, logprobs, finish_reason]`` (both types carry those fields)."""
    return [[c.index, c.token_ids, c.logprobs, c.finish_reason] for c in choices]


def pack_batch(engine_id: str, incarnation: str, rows: list[EventRow]) -> bytes:
    return msgpack.packb({"v": SCHEMA_VERSION, "engine_id": engine_id, "incarnation": incarnation, "events": rows},
                         use_bin_type=True)


def encode_batch(batch: ReplyBatch) -> bytes:
    return pack_batch(batch.engine_id, batch.incarnation, [event_row(rid, e) for rid, e in batch.events])


def decode_batch(payload: bytes) -> ReplyBatch:
    body = _unpack(ReplyBatch, payload)
    try:
        engine_id, incarnation = body["engine_id"], body["incarnation"]
        events = [(rid, ReplyEvent(kind=_EVENT_KINDS[kind], engine_id=engine_id, incarnation=incarnation,
                                   choices=[ChoiceDelta(i, t, lp, r) for i, t, lp, r in choices], finished=finished,
                                   num_cached_tokens=cached, error=error, status=status, index=index,
                                   prompt_logprobs=prompt_lps, embedding=embedding))
                  for rid, index, kind, choices, finished, cached, error, status, prompt_lps, embedding
                  in body["events"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise SchemaError(f"malformed ReplyBatch: {exc!r}") from exc
    return ReplyBatch(engine_id, incarnation, events)


def encode(msg: Any) -> bytes:
    body = _fields(msg)
    if isinstance(msg, ReplyEvent):
        body["choices"] = [_fields(c) for c in msg.choices]
    elif isinstance(msg, (Heartbeat, KVSnapshotMsg)):
        body["stats"] = _fields(msg.stats)
    body["v"] = SCHEMA_VERSION
    return msgpack.packb(body, use_bin_type=True)


def params_to_wire(params: Any) -> dict[str, Any]:
    """SamplingParams as a plain map; the worker rebuilds (and re-validates) it. The structured output
    travels as its own map, logit_bias as [id, bias] pairs (msgpack maps with int keys are avoided)."""
    wire = _fields(params)
    if wire["structured_output"] is not None:
        wire["structured_output"] = wire["structured_output"].to_wire()
    if wire["logit_bias"] is not None:
        wire["logit_bias"] = [[token, bias] for token, bias in wire["logit_bias"].items()]
    return wire


def images_to_wire(images: list[ImagePatches]) -> list[dict[str, Any]] | None:
    """Each image as ``{"pixels": float32 little-endian bytes, "shape": [patches, features], "grid": [t, h, w]}``."""
    return [{"pixels": image.pixel_values.numpy().astype("<f4").tobytes(),
             "shape": list(image.pixel_values.shape), "grid": list(image.grid_thw)} for image in images] or None


def images_from_wire(rows: list[Any]) -> list[ImagePatches]:
    """``images_to_wire``'s maps back, each checked against its schema (SchemaError)."""
    images = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or set(row) != {"pixels", "shape", "grid"}:
            raise SchemaError(f"image {i}: expected a map of pixels, shape and grid")
        pixels, shape, grid = row["pixels"], row["shape"], row["grid"]
        if not (isinstance(pixels, bytes) and _ints(shape, 2) and _ints(grid, 3)
                and len(pixels) == 4 * shape[0] * shape[1]):
            raise SchemaError(f"image {i}: pixels must be float32 bytes of its [patches, features] shape, grid 3 ints")
        values = torch.from_numpy(np.frombuffer(pixels, dtype="<f4").reshape(shape).copy())
        images.append(ImagePatches(values, tuple(grid)))
    return images


def _ints(values: Any, count: int) -> bool:
    return (isinstance(values, list) and len(values) == count
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values))


def pooling_to_wire(params: PoolingParams) -> dict[str, Any]:
    """PoolingParams as a plain map; the worker rebuilds (and re-validates) it."""
    return _fields(params)


def _fields(msg: Any) -> dict[str, Any]:
    return {f.name: getattr(msg, f.name) for f in fields(msg)}


def _unpack(cls: type, payload: bytes) -> dict[str, Any]:
    """The payload's map, version checked (and removed)."""
    try:
        body = msgpack.unpackb(payload, raw=False)
    except (msgpack.UnpackException, ValueError) as exc:
        raise SchemaError(f"undecodable {cls.__name__} payload: {exc}") from exc
    if not isinstance(body, dict):
        raise SchemaError(f"{cls.__name__} payload is not a map")
    version = body.pop("v", None)
    if version != SCHEMA_VERSION:
        raise SchemaError(f"{cls.__name__} schema version {version!r}, expected {SCHEMA_VERSION}")
    return body


def decode(cls: type[T], payload: bytes) -> T:
    body = _unpack(cls, payload)
    if cls is ReplyEvent:
        body["choices"] = [_from_fields(ChoiceDelta, c) for c in body.get("choices", [])]
    elif cls in (Heartbeat, KVSnapshotMsg) and "stats" in body:
        body["stats"] = _from_fields(EngineStats, body["stats"])
    return _from_fields(cls, body)


def decode_or_none(cls: type[T], payload: bytes | None) -> T | None:
    """A stored message, or None when the key is missing or holds another release's (unreadable) one."""
    if payload is None:
        return None
    try:
        return decode(cls, payload)
    except SchemaError:
        return None


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
