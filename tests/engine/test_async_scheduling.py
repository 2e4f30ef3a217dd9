"""Async scheduling (EngineConfig.async_scheduling) gives the synchronous engine's outputs, step by step, and
returns every block."""
from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.async_step import StepPipeline

from .conftest import backends, mixed_prompts
from .test_structured_output import path  # noqa: F401 (fixture: a checkpoint with a tokenizer, for grammars)

STOP = 7  # a stop token: with random weights some choices draw it early


def make_engine(path: str, async_scheduling: bool, **overrides) -> LLMEngine:
    config = dict(attention_backend="torch", dtype="float32", num_device_blocks=64, show_progress=False,
                  max_model_len=128, async_scheduling=async_scheduling)
    return LLMEngine(EngineConfig(model=path, **(config | overrides)))


def mixed_params(i: int) -> SamplingParams:
    """Greedy and seeded sampling, max_tokens ending at different steps, stop tokens, penalties, min_tokens."""
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.8, top_p=0.9, seed=i),
        dict(temperature=0.0, stop_token_ids=[STOP, 11, 13, 17]),
        dict(temperature=1.0, seed=i, stop_token_ids=[STOP], min_tokens=3, logprobs=2),
        dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
    ]
    return SamplingParams(max_tokens=3 + (i * 7) % 18, **kinds[i % len(kinds)])


Delta = tuple[int, list[int], str | None, list | None]


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]], abort: dict[int, list[str]] = {}
        ) -> dict[str, list[Delta]]:
    """Each request's outputs, in order: (choice, new tokens, finish reason, their logprobs' token ids), and its
    prompt logprobs' token ids as choice -1. ``abort``: step -> request ids to abort before it."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    deltas: dict[str, list[Delta]] = {str(i): [] for i in range(len(requests))}
    step = 0
    while engine.has_unfinished_requests():
        engine.abort_request(abort.get(step, []))
        for out in engine.step():
            if out.prompt_logprobs is not None:
                top = [[t for t, _ in entry] for entry in out.prompt_logprobs[1:]]
                deltas[out.request_id].append((-1, [], None, top))
            for c in out.outputs:
                top = None if c.logprobs is None else [[t for t, _ in entry] for entry in c.logprobs]
                deltas[out.request_id].append((c.index, c.token_ids, c.finish_reason, top))
        step += 1
    stats = engine.stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    return deltas


@pytest.fixture
def ran_ahead(monkeypatch) -> list[int]:
    """How many steps ran ahead (were launched before the step before them was processed)."""
    count = [0]
    launch_ahead = StepPipeline.launch_ahead

    def counted(self, *args):
        count[0] += 1
        return launch_ahead(self, *args)
    monkeypatch.setattr(StepPipeline, "launch_ahead", counted)
    return count


def both(path: str, requests, abort: dict[int, list[str]] = {}, **overrides):
    sync = run(make_engine(path, False, **overrides), requests, abort)
    overlapped = run(make_engine(path, True, **overrides), requests, abort)
    return sync, overlapped


@pytest.mark.parametrize("backend", backends())
def test_mixed_requests_match_synchronous(llama_checkpoint, backend, ran_ahead):
    requests = [(p, mixed_params(i)) for i, p in enumerate(mixed_prompts())]
    sync, overlapped = both(llama_checkpoint.path, requests, attention_backend=backend)
    assert overlapped == sync
    reasons = {deltas[-1][2] for deltas in sync.values()}
    assert reasons == {"stop", "length"}  # both kinds of ending were exercised
    assert all(len(d[1]) == 1 for deltas in sync.values() for d in deltas)  # one token per step
    assert ran_ahead[0] >= 15


def test_chunked_prefill_and_small_batches_match(llama_checkpoint):
    requests = [(p, mixed_params(i)) for i, p in enumerate(mixed_prompts(12, seed=1))]
    sync, overlapped = both(llama_checkpoint.path, requests, max_num_batched_tokens=24, max_num_seqs=5)
    assert overlapped == sync


def test_padded_decode_steps_match(llama_checkpoint, ran_ahead):
    """Decode steps padded to a bucket (``DecodeGraphs``: captured graphs on CUDA, eager here) take the
    sampled tokens in their padded input buffer."""
    requests = [(p, mixed_params(i)) for i, p in enumerate(mixed_prompts(10, seed=8))]
    deltas = []
    for async_scheduling in (False, True):
        engine = make_engine(llama_checkpoint.path, async_scheduling, attention_backend="ext")
        engine.runner.enable_decode_graphs()
        deltas.append(run(engine, requests))
    assert deltas[1] == deltas[0] and ran_ahead[0] >= 10


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_matches(llama_checkpoint, mode, ran_ahead):
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=20)) for p in mixed_prompts(10, seed=2)]
    extra = dict(num_device_blocks=12, block_size=8, preemption_mode=mode, num_cpu_blocks=64)
    sync, overlapped = both(llama_checkpoint.path, requests, **extra)
    assert overlapped == sync
    assert ran_ahead[0] > 0
    engine = make_engine(llama_checkpoint.path, True, **extra)
    run(engine, requests)
    assert engine.stats().num_preemptions_total > 0


def test_aborts_mid_flight_return_every_block(llama_checkpoint):
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=20)) for p in mixed_prompts(8, seed=3)]
    abort = {2: ["0", "5"], 4: ["1"], 6: ["2", "3"]}
    sync, overlapped = both(llama_checkpoint.path, requests, abort)
    assert overlapped == sync
    assert sync["0"][-1][2] == "abort" and sync["3"][-1][2] == "abort"


def test_fallback_steps_match(llama_checkpoint, ran_ahead):
    """n > 1 forks, prompt logprobs and beam search make their steps synchronous; plain requests beside them
    still run ahead."""
    prompts = mixed_prompts(6, seed=4)
    requests = [(prompts[0], SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=8)),
                (prompts[1], SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=2)),
                (prompts[2], SamplingParams(n=2, use_beam_search=True, temperature=0.0, max_tokens=6)),
                *[(p, SamplingParams(temperature=0.0, max_tokens=15)) for p in prompts[3:]]]
    sync, overlapped = both(llama_checkpoint.path, requests)
    assert overlapped == sync
    assert sync["1"][0][0] == -1 and len(sync["1"][0][3]) == len(prompts[1]) - 1  # the prompt logprobs came
    assert ran_ahead[0] > 0


def test_structured_output_beside_plain_requests_matches(path, ran_ahead):
    """While a constrained request is live every step waits for its tokens on the host; the plain requests
    beside it get the same tokens, and run ahead once it is done."""
    regex = SamplingParams(temperature=0.0, max_tokens=30, structured_output={"regex": r"[a-c]{2,4}-\d{1,3}"})
    plain = [(p, SamplingParams(temperature=0.0, max_tokens=25)) for p in mixed_prompts(4, seed=9)]
    sync, overlapped = both(path, [([1, 2, 3], regex), *plain])
    assert overlapped == sync
    assert sync["0"][-1][2] == "stop" and ran_ahead[0] > 0  # the grammar completed, then the others ran ahead


def test_requests_added_between_steps_match(llama_checkpoint):
    """Requests arriving while a step is in flight (an online server's case) get the same tokens."""
    prompts = mixed_prompts(9, seed=6)

    def staggered(async_scheduling: bool) -> dict[str, list[int]]:
        engine = make_engine(llama_checkpoint.path, async_scheduling)
        tokens: dict[str, list[int]] = {}
        step = 0
        while step < len(prompts) or engine.has_unfinished_requests():
            if step < len(prompts):
                engine.add_request(str(step), prompts[step], mixed_params(step))
            for out in engine.step():
                for c in out.outputs:
                    tokens.setdefault(out.request_id, []).extend(c.token_ids)
            step += 1
        assert engine.stats().num_blocks_free == engine.stats().num_blocks_total
        return tokens

    assert staggered(True) == staggered(False)


def test_needs_one_rank():
    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size=1"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)


def test_failed_step_drops_the_step_scheduled_ahead(llama_checkpoint):
    """Every step holding request "2" raises: it fails alone after its batch is retried one request at a time,
    the step scheduled ahead of the failed one never runs, and the others finish as without async scheduling."""
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=12)) for p in mixed_prompts(5, seed=7)]

    def with_poison(async_scheduling: bool):
        engine = make_engine(llama_checkpoint.path, async_scheduling)
        runner, bad = engine.runner, []
        plan, run_plan = runner.plan, runner.run

        def planned(out):
            step = plan(out)
            if any(s.group.request_id == "2" for s in out.scheduled):
                bad.append(step)
            return step

        def ran(step):
            if any(step is b for b in bad):
                raise RuntimeError("injected fault")
            return run_plan(step)
        runner.plan, runner.run = planned, ran
        deltas = run(engine, requests)
        assert len(bad) > 1 and not engine.scheduler.suspects
        return deltas

    sync, overlapped = with_poison(False), with_poison(True)
    assert overlapped == sync
    assert sync["2"][-1][2] == "error" and all(deltas[-1][2] == "length" for i, deltas in sync.items() if i != "2")


def test_engine_reused_after_its_requests_finish(llama_checkpoint):
    """The step scheduled ahead of the last one (every row finished) is still in flight when the requests are
    done; the next batch on the same engine starts behind it with the same tokens."""
    first = [(p, SamplingParams(temperature=0.0, max_tokens=6)) for p in mixed_prompts(3, seed=10)]
    second = [(p, mixed_params(i)) for i, p in enumerate(mixed_prompts(5, seed=11))]

    def twice(async_scheduling: bool):
        engine = make_engine(llama_checkpoint.path, async_scheduling)
        return run(engine, first), run(engine, second)

    assert twice(True) == twice(False)
