"""The worker's Engine protocol is what LLMEngine offers, and what every test double of it offers. Checked
with inspect, member by member: a runtime_checkable Protocol's isinstance checks names only, so a double
whose add_request lacks a keyword the worker passes would pass it, and fail only when the worker calls it."""
from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import get_type_hints

import pytest
from typing_extensions import get_protocol_members

from engine import EngineConfig, LLMEngine
from loadtest.bench_broker import SyntheticEngine
from service.engine_api import Engine
from tests.service.fake_engine import FakeEngine
from tests.service.test_worker_redis import StoppedOnFirstAdd
from tests.service.test_worker_unit import BrokenEngine, HeldEngine

P = inspect.Parameter
POSITIONAL = (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)
BY_KEYWORD = (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)

# Every engine the worker is given, by name: each builds one from the demo model's path.
ENGINES: dict[str, Callable[[str], object]] = {
    "LLMEngine": lambda model: LLMEngine(EngineConfig(model=model, num_device_blocks=16, attention_backend="torch",
                                                      num_threads=1, show_progress=False)),
    "FakeEngine": lambda _: FakeEngine(),
    "SyntheticEngine": lambda _: SyntheticEngine(step_s=0.01, max_seqs=4),  # loadtest.bench_broker's
    "HeldEngine": lambda _: HeldEngine(),
    "BrokenEngine": lambda _: BrokenEngine(),
    "StoppedOnFirstAdd": lambda _: StoppedOnFirstAdd([]),
}


def call_problems(protocol: inspect.Signature, method: inspect.Signature) -> list[str]:
    """What a call the protocol's signature allows would trip on in ``method``: each positional parameter at
    its place under its name, each keyword-only one accepted by keyword (keyword-only or not), a default
    wherever the protocol has one, and no other parameter required. ``*args`` / ``**kwargs`` take what they
    would at run time (a forwarding override)."""
    params = list(method.parameters.values())
    positional = [p for p in params if p.kind in POSITIONAL]
    kinds = {p.kind for p in params}
    problems = []
    for index, want in enumerate(protocol.parameters.values()):
        if want.kind in POSITIONAL:
            got = positional[index] if index < len(positional) else None
            if got is None and P.VAR_POSITIONAL in kinds:
                continue
            if got is None or got.name != want.name:
                problems.append(f"{want.name!r} is not positional parameter {index}")
                continue
        else:  # keyword-only: the protocol has no *args or **kwargs
            got = method.parameters.get(want.name)
            if got is None and P.VAR_KEYWORD in kinds:
                continue
            if got is None or got.kind not in BY_KEYWORD:
                problems.append(f"{want.name!r} is not accepted by keyword")
                continue
        if want.default is not P.empty and got.default is P.empty:
            problems.append(f"{want.name!r} has no default")
    problems += [f"{p.name!r} is required but not in the protocol" for p in params if p.name not in protocol.parameters
                 and p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD) and p.default is P.empty]
    return problems


def protocol_problems(engine: object) -> list[str]:
    """Each Engine member ``engine`` lacks or offers otherwise: attributes of their annotated type, methods
    callable as the protocol's (compared unbound, ``self`` included)."""
    types = get_type_hints(Engine)
    problems = []
    for name in sorted(get_protocol_members(Engine)):
        if not hasattr(engine, name):
            problems.append(f"{name}: missing")
        elif name in types:
            if not isinstance(getattr(engine, name), types[name]):
                problems.append(f"{name}: not a {types[name].__name__}")
        else:
            signatures = inspect.signature(getattr(Engine, name)), inspect.signature(getattr(type(engine), name))
            problems += [f"{name}: {problem}" for problem in call_problems(*signatures)]
    return problems


@pytest.mark.parametrize("name", ENGINES)
def test_the_engine_offers_every_protocol_member_as_the_protocol_does(name: str, demo_model: str) -> None:
    assert protocol_problems(ENGINES[name](demo_model)) == []


@pytest.mark.parametrize(("name", "drifted", "problem"), [
    # bench_broker's SyntheticEngine before issue 43: the worker passes priority=
    ("add_request", lambda self, request_id, prompt_token_ids, params, *, cache_salt=None, resume=None, images=None:
     None, "'priority' is not accepted by keyword"),
    ("add_request", lambda self, request_id, prompt_token_ids, params, *, cache_salt=None, resume=None, priority,
     images=None: None, "'priority' has no default"),
    ("abort_request", lambda self, *, request_ids: None, "'request_ids' is not positional parameter 1"),
    ("step", lambda self, budget: None, "'budget' is required but not in the protocol"),
])
def test_the_check_finds_a_drifted_signature(name: str, drifted: Callable, problem: str) -> None:
    assert call_problems(inspect.signature(getattr(Engine, name)), inspect.signature(drifted)) == [problem]


def test_the_check_finds_a_missing_member() -> None:
    assert protocol_problems(object()) == [f"{name}: missing" for name in sorted(get_protocol_members(Engine))]
