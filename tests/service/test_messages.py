"""The Redis wire format: msgpack with a schema version, strict on the way in."""
from __future__ import annotations

from dataclasses import fields

import msgpack
import numpy as np
import pytest

from engine.outputs import CompletionOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from service.messages import (CONTROL_INDEX, SCHEMA_VERSION, ChoiceDelta, EventKind, GatewayBeat, Heartbeat, Progress,
                              ReplyBatch, ReplyEvent, RequestMsg, SchemaError, StreamRecord, decode, decode_batch, encode,
                              encode_batch, output_row, pack_batch, params_to_wire, pooling_to_wire)
from service.transcript import Transcript
from tests.service.conftest import engine_stats


def test_round_trips_and_params_survive() -> None:
    params = SamplingParams(n=2, temperature=0.5, top_k=3, stop_token_ids=[7], logprobs=1, seed=9)
    msg = RequestMsg("r1", [1, 2, 3], params_to_wire(params), "gw", 12.5, "m", "salt")
    back = decode(RequestMsg, encode(msg))
    assert back == msg and SamplingParams(**back.params) == params
    event = ReplyEvent(EventKind.OUTPUT, "e1", "i1", [ChoiceDelta(1, [5], [[[5, -0.1], [6, -2.0]]], "stop")], True, 4)
    assert decode(ReplyEvent, encode(event)) == event
    assert msgpack.unpackb(encode(event))["kind"] == "output"  # the wire carries the string
    beat = Heartbeat("e1", "i1", "m", 2048, engine_stats(num_blocks_free=3, kv_cache_usage=0.25))
    assert decode(Heartbeat, encode(beat)) == beat
    assert msgpack.unpackb(encode(beat))["stats"]["kv_cache_usage"] == 0.25  # a plain map of field names


_STATS = {f.name: 0 for f in fields(EngineStats)}
_BEAT = {"v": SCHEMA_VERSION, "engine_id": "e", "incarnation": "i", "model": "m", "max_model_len": 1,
         "stats": _STATS}


def test_a_well_formed_heartbeat_decodes() -> None:  # so each bad payload below fails for its own reason
    assert decode(Heartbeat, msgpack.packb(_BEAT)).stats == EngineStats(**_STATS)


@pytest.mark.parametrize("payload", [
    msgpack.packb(_BEAT | {"v": SCHEMA_VERSION + 1}),  # newer schema
    msgpack.packb(_BEAT | {"v": SCHEMA_VERSION - 1}),  # older schema: its figures had other names
    msgpack.packb({k: v for k, v in _BEAT.items() if k != "v"}),  # no version
    msgpack.packb(_BEAT | {"x": 1}),
    msgpack.packb({"v": SCHEMA_VERSION, "engine_id": "e"}),  # missing fields
    msgpack.packb(_BEAT | {"stats": _STATS | {"kv_cache_usage_perc": 0.5}}),  # an unknown figure
    msgpack.packb(_BEAT | {"stats": {"num_blocks_free": 3}}),  # missing figures
    msgpack.packb(_BEAT | {"stats": [1, 2]}),  # figures not a map
    msgpack.packb([1, 2]), b"\xc1",  # not a map; not msgpack
])
def test_bad_payloads_are_schema_errors(payload: bytes) -> None:
    with pytest.raises(SchemaError):
        decode(Heartbeat, payload)


def test_unknown_event_kind_is_a_schema_error() -> None:
    payload = encode(ReplyEvent(EventKind.ACCEPTED, "e1")).replace(b"accepted", b"accepten")
    with pytest.raises(SchemaError):
        decode(ReplyEvent, payload)


def test_a_reply_batch_round_trips_as_arrays() -> None:
    events = [("r1", ReplyEvent(EventKind.ACCEPTED, "e1", "i1")),
              ("r2", ReplyEvent(EventKind.OUTPUT, "e1", "i1", [ChoiceDelta(0, [5, 6], [[[5, -0.5]], [[6, -0.25]]]),
                                                               ChoiceDelta(1, [7], None, "length")], False, 16,
                                index=3)),
              ("r1", ReplyEvent(EventKind.ERROR, "e1", "i1", finished=True, error="boom", status=503, index=0))]
    payload = encode_batch(ReplyBatch("e1", "i1", events))
    body = msgpack.unpackb(payload)
    assert isinstance(body["events"][1], list) and body["events"][1][:3] == ["r2", 3, "output"]
    back = decode_batch(payload)
    assert back == ReplyBatch("e1", "i1", events)
    assert back.events[0][1].index == CONTROL_INDEX


_TAIL = [False, 0, None, 500, None, None]  # finished, num_cached_tokens, error, status, prompt_logprobs, embedding


@pytest.mark.parametrize("events", [[["r1", 0, "outputz", [], *_TAIL]],  # unknown kind
                                    [["r1", 0, ["output"], [], *_TAIL]],  # a kind not a string
                                    [["r1", 0, "output", [], *_TAIL[:-1]]],  # a field missing
                                    [["r1", 0, "output", [[0, [1]]], *_TAIL]],  # a choice short
                                    "not a list"])
def test_malformed_batches_are_schema_errors(events: object) -> None:
    payload = msgpack.packb({"v": SCHEMA_VERSION, "engine_id": "e", "incarnation": "i", "events": events})
    with pytest.raises(SchemaError):
        decode_batch(payload)


def test_an_embedding_request_and_its_vector_travel() -> None:
    """PoolingParams as a map beside empty sampling params; the vector as float32 little-endian bytes (msgpack bin),
    on the final event only."""
    msg = RequestMsg("r", [1, 2], {}, "gw", 1.0, "m", pooling=pooling_to_wire(PoolingParams(dimensions=8)))
    assert PoolingParams(**decode(RequestMsg, encode(msg)).pooling) == PoolingParams(dimensions=8)
    final = output_row("r", 0, [CompletionOutput(0, [], finish_reason="stop")], True, 0, embedding=[0.5, -0.25])
    (_, event), = decode_batch(pack_batch("e", "i", [final])).events
    assert event.embedding == np.asarray([0.5, -0.25], "<f4").tobytes() and event.finished
    assert decode_batch(pack_batch("e", "i", [output_row("r", 0, [], False, 0)])).events[0][1].embedding is None


def test_progress_stream_record_and_gateway_beat_round_trip() -> None:
    for msg in (Progress("r1", 4, [[1, 2], [3]], [None, "stop"], None, 8, 123),
                StreamRecord("r1", "gw", b'{"model": "m"}', [1, 2], 7, 99, "t"), GatewayBeat("gw", ["r1"])):
        assert decode(type(msg), encode(msg)) == msg


def test_a_transcript_folds_a_checkpoint_and_later_events_without_duplicates() -> None:
    out = lambda index, *choices, finished=False: ReplyEvent(EventKind.OUTPUT, "e", "i", list(choices), finished,
                                                               index=index)
    transcript = Transcript(Progress("r", 2, [[1, 2], [3]], [None, None], None, 0, 0))
    for event in (out(1, ChoiceDelta(0, [9])), out(2, ChoiceDelta(0, [4]), ChoiceDelta(1, [5], None, "stop")),
                  out(2, ChoiceDelta(0, [4])), out(4, ChoiceDelta(0, [8])), out(3, ChoiceDelta(0, [6], None, "length"),
                                                                              finished=True)):
        transcript.add(event)
    assert [e.index for e in transcript.events] == [2, 3] and transcript.next_index == 4 and transcript.finished
    assert transcript.choices(2) == ([[1, 2, 4, 6], [3, 5]], ["length", "stop"])
    assert Transcript(None).choices(2) == ([[], []], [None, None]) and Transcript(None).next_index == 0
