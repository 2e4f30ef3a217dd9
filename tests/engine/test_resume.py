"""Resume by recompute: a request another engine ran (and died running) continues on a fresh engine
from the tokens already delivered, exactly as the undisturbed run would have."""
from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, ResumeState, SamplingParams

from .conftest import mixed_prompts

PROMPT = mixed_prompts(2)[1]  # 40 shared + own tokens: several KV blocks, a partial last one


def make_engine(path: str, prefix_caching: bool = True, **overrides) -> LLMEngine:
    config = dict(attention_backend="torch", dtype="float32", num_device_blocks=64, show_progress=False,
                  max_model_len=128, enable_prefix_caching=prefix_caching)
    return LLMEngine(EngineConfig(model=path, **(config | overrides)))


def run(engine: LLMEngine, request_id: str, params: SamplingParams, resume: ResumeState | None = None,
        prompt: list[int] = PROMPT) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Every token and finish reason ``step`` reports for the request, per choice, then checks nothing leaked."""
    engine.add_request(request_id, prompt, params, resume=resume)
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                assert c.index not in reasons, "a choice reported after its finish"
                tokens.setdefault(c.index, []).extend(c.token_ids)
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
    assert_no_leak(engine)
    return tokens, reasons


def assert_no_leak(engine: LLMEngine) -> None:
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished()
    assert stats.num_blocks_free == stats.num_blocks_total


def undisturbed(path: str, params: SamplingParams) -> tuple[list[list[int]], list[str]]:
    tokens, reasons = run(make_engine(path), "full", params)
    return [tokens[i] for i in range(params.n)], [reasons[i] for i in range(params.n)]


def cut(full: list[list[int]], reasons: list[str], k: int) -> ResumeState:
    """The first ``k`` tokens of each choice; a choice delivered whole comes with its finish reason."""
    return ResumeState([out[:k] for out in full], [r if k >= len(out) else None for out, r in zip(full, reasons)])


def assert_resumes_identically(path: str, params: SamplingParams, cuts: tuple[int, ...] = (0, 1, 5, 11),
                               **engine_overrides) -> None:
    """For each cut point and with prefix caching on and off, a fresh engine continues the cut run exactly."""
    full, reasons = undisturbed(path, params)
    for prefix_caching in (True, False):
        for k in cuts:
            resume = cut(full, reasons, k)
            engine = make_engine(path, prefix_caching, **engine_overrides)
            tokens, got = run(engine, f"r{k}", params, resume)
            for i, (out, reason) in enumerate(zip(full, reasons)):
                if resume.finish_reasons[i] is not None:
                    assert i not in tokens and i not in got  # finished before the cut: nothing more
                else:
                    assert out[:k] + tokens.get(i, []) == out, (prefix_caching, k, i)
                    assert got[i] == reason


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16),
    SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=11, max_tokens=16),
    SamplingParams(temperature=1.0, seed=3, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.4,
                   max_tokens=16),
    SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0, max_tokens=16),
], ids=["greedy", "seeded", "n3-seeded", "seeded-penalties", "greedy-penalties"])
def test_resume_continues_exactly(llama_checkpoint, params):
    assert_resumes_identically(llama_checkpoint.path, params)


def test_resume_recomputes_in_chunks(llama_checkpoint):
    # The 3 choices' contexts (~60-70 tokens each) re-prefill over several steps of 24 tokens.
    params = SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=16)
    assert_resumes_identically(llama_checkpoint.path, params, cuts=(1, 10), max_num_batched_tokens=24)


def test_resume_keeps_min_tokens_and_stop_state(llama_checkpoint):
    greedy = undisturbed(llama_checkpoint.path, SamplingParams(temperature=0.0, max_tokens=24))[0][0]
    # Banning its second token until min_tokens changes the path; on that path its ninth one comes again and stops it.
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=6, stop_token_ids=[greedy[1], greedy[8]])
    full, reasons = undisturbed(llama_checkpoint.path, params)
    assert reasons == ["stop"] and 6 <= len(full[0]) < 24  # the case this test is about: it did stop
    assert_resumes_identically(llama_checkpoint.path, params, cuts=(0, 2, 5, len(full[0]) - 1, len(full[0])))


def test_n3_choices_finishing_at_different_points(llama_checkpoint):
    seeded = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20)
    draws = undisturbed(llama_checkpoint.path, seeded)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=20, stop_token_ids=[draws[0][4], draws[1][9]])
    full, _ = undisturbed(llama_checkpoint.path, params)
    assert len({len(out) for out in full}) > 1  # some choice stops before another
    assert_resumes_identically(llama_checkpoint.path, params, cuts=(3, min(map(len, full)), 12))


def test_resume_exactly_at_max_tokens_finishes_without_new_tokens(llama_checkpoint):
    params = SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    full, reasons = undisturbed(llama_checkpoint.path, params)
    assert reasons == ["length", "length"]
    # Delivered whole but the finish was not recorded: the engine finds it ("length") and reports only that.
    engine = make_engine(llama_checkpoint.path)
    tokens, got = run(engine, "r", params, ResumeState(full, [None, "length"]))
    assert tokens == {0: []} and got == {0: "length"}


def test_all_finished_resume_reports_final_output_once(llama_checkpoint):
    params = SamplingParams(n=2, temperature=0.0, max_tokens=6, ignore_eos=True)
    full, reasons = undisturbed(llama_checkpoint.path, params)
    engine = make_engine(llama_checkpoint.path)
    engine.add_request("done", PROMPT, params, resume=ResumeState(full, reasons))
    assert engine.has_unfinished_requests()
    (out,) = engine.step()
    assert out.request_id == "done" and out.finished and out.outputs == [] and out.error is None
    assert engine.step() == []
    assert_no_leak(engine)


def test_abort_of_a_resumed_request(llama_checkpoint):
    params = SamplingParams(n=2, temperature=1.0, seed=2, max_tokens=10, ignore_eos=True)
    full, _ = undisturbed(llama_checkpoint.path, params)
    engine = make_engine(llama_checkpoint.path)
    engine.add_request("r", PROMPT, params, resume=ResumeState([full[0], full[1][:4]], [None, None]))
    engine.abort_request("r")
    (out,) = engine.step()  # choice 0's "length" found on arrival is superseded by the abort
    assert out.finished and [(c.index, c.token_ids, c.finish_reason) for c in out.outputs] == [(1, [], "abort")]
    assert_no_leak(engine)


def test_logprobs_cover_new_tokens_only(llama_checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    full, reasons = undisturbed(llama_checkpoint.path, params)
    engine = make_engine(llama_checkpoint.path)
    engine.add_request("r", PROMPT, params, resume=ResumeState([full[0][:4]], [None]))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [c for out in engine.step() for c in out.outputs]
    logprobs = [lp for c in outputs for lp in c.logprobs]
    assert [lp[0][0] for lp in logprobs] == full[0][4:]
    assert outputs[-1].cumulative_logprob == pytest.approx(sum(lp[0][1] for lp in logprobs))


def test_resume_reuses_a_held_prefix(llama_checkpoint):
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine = make_engine(llama_checkpoint.path)
    full = run(engine, "first", params)[0][0]  # its blocks stay in the prefix cache
    hits = engine.stats().prefix_cache_hits_total
    k = 20
    tokens, _ = run(engine, "again", params, ResumeState([full[:k]], [None]))
    context = len(PROMPT) + k
    assert engine.stats().prefix_cache_hits_total - hits == (context - 1) // 16 * 16  # all full blocks recomputed free
    assert full[:k] + tokens[0] == full


@pytest.mark.parametrize("params, resume, match", [
    (SamplingParams(n=2), ResumeState([[1]], [None]), "1 choices, the request has n=2"),
    (SamplingParams(), ResumeState([[1, 300]], [None]), r"resumed output token ids must be in \[0, 300\)"),
    (SamplingParams(), ResumeState([[-1]], [None]), r"\[0, 300\)"),
    (SamplingParams(max_tokens=3), ResumeState([[1, 2, 3, 4]], [None]), "more than max_tokens=3"),
    (SamplingParams(max_tokens=None), ResumeState([[1] * 90], [None]), r"exceed .* \(max_model_len\) of 128"),
    (SamplingParams(n=2, use_beam_search=True, temperature=0.0), ResumeState([[1], [2]], [None, None]),
     "beam search cannot be resumed"),
    (SamplingParams(), ([[1]], [None]), "must be a ResumeState"),
])
def test_bad_resume_rejected_and_nothing_leaks(llama_checkpoint, params, resume, match):
    engine = make_engine(llama_checkpoint.path)
    with pytest.raises(ValueError, match=match):
        engine.add_request("a", PROMPT, params, resume=resume)
    assert_no_leak(engine)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=2))  # the id is still free


@pytest.mark.parametrize("tokens, reasons, match", [
    ([[1], [2]], [None], "2 token lists and 1 finish reasons"),
    ([[1]], ["abort"], "must be None, 'stop' or 'length'"),
])
def test_resume_state_shape_checked(tokens, reasons, match):
    with pytest.raises(ValueError, match=match):
        ResumeState(tokens, reasons)
