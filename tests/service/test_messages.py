"""The Redis wire format: msgpack with a schema version, strict on the way in."""
from __future__ import annotations

from dataclasses import fields

import msgpack
import pytest

from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from service.messages import (SCHEMA_VERSION, ChoiceDelta, EventKind, Heartbeat, ReplyEvent, RequestMsg, SchemaError,
                              decode, encode, params_to_wire)
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
