"""The Redis wire format: msgpack with a schema version, strict on the way in."""
from __future__ import annotations

import msgpack
import pytest

from engine.sampling_params import SamplingParams
from service.messages import (ChoiceDelta, EventKind, Heartbeat, ReplyEvent, RequestMsg, SchemaError, decode, encode,
                              params_to_wire)


def test_round_trips_and_params_survive() -> None:
    params = SamplingParams(n=2, temperature=0.5, top_k=3, stop_token_ids=[7], logprobs=1, seed=9)
    msg = RequestMsg("r1", [1, 2, 3], params_to_wire(params), "gw", 12.5, "salt")
    back = decode(RequestMsg, encode(msg))
    assert back == msg and SamplingParams(**back.params) == params
    event = ReplyEvent(EventKind.OUTPUT, "e1", "i1", [ChoiceDelta(1, [5], [[[5, -0.1], [6, -2.0]]], "stop")], True, 4)
    assert decode(ReplyEvent, encode(event)) == event
    assert msgpack.unpackb(encode(event))["kind"] == "output"  # the wire carries the string
    beat = Heartbeat("e1", "i1", "m", 2048, {"num_blocks_free": 3, "kv_cache_usage_perc": 0.25})
    assert decode(Heartbeat, encode(beat)) == beat


@pytest.mark.parametrize("payload", [
    msgpack.packb({"v": 2, "engine_id": "e", "incarnation": "i", "model": "m", "max_model_len": 1, "stats": {}}),  # newer schema
    msgpack.packb({"engine_id": "e", "incarnation": "i", "model": "m", "max_model_len": 1, "stats": {}}),  # no version
    msgpack.packb({"v": 1, "engine_id": "e", "incarnation": "i", "model": "m", "max_model_len": 1, "stats": {},
                   "x": 1}),
    msgpack.packb({"v": 1, "engine_id": "e"}),  # missing fields
    msgpack.packb([1, 2]), b"\xc1",  # not a map; not msgpack
])
def test_bad_payloads_are_schema_errors(payload: bytes) -> None:
    with pytest.raises(SchemaError):
        decode(Heartbeat, payload)


def test_unknown_event_kind_is_a_schema_error() -> None:
    payload = encode(ReplyEvent(EventKind.ACCEPTED, "e1")).replace(b"accepted", b"accepten")
    with pytest.raises(SchemaError):
        decode(ReplyEvent, payload)
