"""Poison-request isolation: a batch that fails is retried one request at a time, so a request
that makes every batch it is in fail is failed alone and its batch-mates finish exactly as in a
run without it (issue 11, point 4)."""
from __future__ import annotations

from collections.abc import Callable

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.core.scheduler_output import SchedulerOutput

from ..core.helpers import make_group, make_scheduler, run_step
from .conftest import mixed_prompts

HEALTHY = [f"ok{i}" for i in range(4)]
PROMPTS = dict(zip(HEALTHY + ["poison"], mixed_prompts(5)))
CONFIGS = {
    "recompute": dict(num_device_blocks=64),
    # A suspect re-prefills alone over several steps.
    "chunked": dict(num_device_blocks=64, max_num_batched_tokens=32),
    # Tight: the batch preempts by swapping, so failed steps meet swap-outs.
    "swap": dict(num_device_blocks=14, num_cpu_blocks=32, preemption_mode="swap", enable_prefix_caching=False),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
SEEDED_N2 = SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=5, max_tokens=12)

Outcome = dict[str, tuple[dict[int, list[int]], str | None]]  # request id -> (tokens per choice, error)


def make_engine(path: str, config: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=path, attention_backend="torch", dtype="float32", show_progress=False,
                                  max_model_len=128, **CONFIGS[config]))


def inject(engine: LLMEngine, fails: Callable[[SchedulerOutput], bool]) -> list[int]:
    """Make ``engine``'s runner raise on the steps ``fails`` picks; returns the group count of each it failed."""
    execute, sizes = engine.runner.execute, []

    def faulty(out: SchedulerOutput):
        if fails(out):
            sizes.append(len({id(s.group) for s in out.scheduled}))
            raise RuntimeError("injected fault")
        return execute(out)
    engine.runner.execute = faulty
    return sizes


def has_poison(out: SchedulerOutput) -> bool:
    return any(s.group.request_id == "poison" for s in out.scheduled)


def run(engine: LLMEngine, request_ids: list[str], params: SamplingParams) -> Outcome:
    """Every request's tokens per choice and error; then checks no request or KV block is left behind."""
    for request_id in request_ids:
        engine.add_request(request_id, PROMPTS[request_id], params)
    got: Outcome = {request_id: ({}, None) for request_id in request_ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, _ = got[out.request_id]
            for c in out.outputs:
                tokens.setdefault(c.index, []).extend(c.token_ids)
            if out.error is not None:
                got[out.request_id] = (tokens, out.error)
    stats = engine.stats()
    assert not engine.scheduler.has_unfinished() and not engine.scheduler.suspects
    assert stats.num_blocks_free == stats.num_blocks_total and stats.num_cpu_blocks_used == 0
    return got


def undisturbed(path: str, config: str, params: SamplingParams) -> Outcome:
    return run(make_engine(path, config), HEALTHY, params)


@pytest.mark.parametrize("params", [GREEDY, SEEDED_N2], ids=["greedy", "n2-seeded"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_poison_fails_alone(llama_checkpoint, config, params):
    reference = undisturbed(llama_checkpoint.path, config, params)
    engine = make_engine(llama_checkpoint.path, config)
    sizes = inject(engine, has_poison)
    got = run(engine, HEALTHY[:2] + ["poison"] + HEALTHY[2:], params)
    assert max(sizes) > 1 and sizes[-1] == 1  # it failed a batch, then itself alone
    tokens, error = got.pop("poison")
    assert error is not None and "injected fault" in error and not any(tokens.values())
    assert got == reference
    assert all(len(out) == params.max_tokens for tokens, _ in got.values() for out in tokens.values())
    assert len(next(iter(got.values()))[0]) == params.n


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_transient_failure_fails_nobody(llama_checkpoint, config):
    reference = undisturbed(llama_checkpoint.path, config, GREEDY)
    engine = make_engine(llama_checkpoint.path, config)
    # Once, on a step of several requests: with swap, one that swaps out (those moves may not have happened).
    needs_swap = config == "swap"
    raised: list[SchedulerOutput] = []

    def once(out: SchedulerOutput) -> bool:
        hit = not raised and len(out.scheduled) > 1 and (bool(out.blocks_to_swap_out) or not needs_swap)
        if hit:
            raised.append(out)
        return hit
    inject(engine, once)
    assert run(engine, HEALTHY, GREEDY) == reference
    assert raised


def test_batch_of_one_fails_at_once(llama_checkpoint):
    engine = make_engine(llama_checkpoint.path, "recompute")
    sizes = inject(engine, has_poison)
    got = run(engine, ["poison"], GREEDY)
    assert sizes == [1]  # not retried: it was alone
    assert "injected fault" in got["poison"][1]


def test_suspects_run_alone_in_arrival_order(llama_checkpoint):
    engine = make_engine(llama_checkpoint.path, "recompute")
    order: list[list[str]] = []

    def first_batch(out: SchedulerOutput) -> bool:
        order.append(sorted({s.group.request_id for s in out.scheduled}))
        return len(order) == 1 or has_poison(out)
    inject(engine, first_batch)
    got = run(engine, HEALTHY[:2] + ["poison"], GREEDY)
    assert order[:4] == [["ok0", "ok1", "poison"], ["ok0"], ["ok1"], ["poison"]]
    assert order[4] == ["ok0", "ok1"]  # normal batching resumes
    assert got["poison"][1] is not None and got["ok0"][1] is None and got["ok1"][1] is None


def test_a_suspect_that_no_longer_fits_preempts_the_others():
    """Without prefix caching, a recomputed group of two diverged samples re-prefills both in full:
    it needs more blocks than it held, and the running group outside the failed batch makes room."""
    sched = make_scheduler(num_device_blocks=7, enable_prefix_caching=False)
    forked = make_group("n2", list(range(16)), arrival=0, n=2)
    other = make_group("other", list(range(100, 108)), arrival=1)
    sched.add_group(forked)
    sched.add_group(other)
    for _ in range(4):
        run_step(sched)
    assert sched.kv.num_free_blocks == 1
    sched.isolate([forked])
    out = run_step(sched)
    assert {s.group.request_id for s in out.scheduled} == {"n2"} and out.preempted == [other]
    while sched.has_unfinished():
        run_step(sched)
    assert sched.kv.num_free_blocks == 7 and not sched.suspects
