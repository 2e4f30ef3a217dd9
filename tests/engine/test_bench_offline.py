"""The offline benchmark's synthetic workloads have the documented means."""
from __future__ import annotations

import pytest

from loadtest.bench_offline import WORKLOADS, Measured, Result, make_workload, median_run, summarize


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workload_lengths_have_target_means(name):
    requests = make_workload(name, 20000, vocab=1000, seed=1)
    (in_mean, _, in_cap), (out_mean, _, out_cap) = WORKLOADS[name]
    mean_in = sum(len(r.prompt) for r in requests) / len(requests)
    mean_out = sum(r.output_len for r in requests) / len(requests)
    # Clipping at the caps trims the log-normal tail a little.
    assert mean_in == pytest.approx(in_mean, rel=0.03) and mean_out == pytest.approx(out_mean, rel=0.03)
    assert all(1 <= len(r.prompt) <= in_cap and 1 <= r.output_len <= out_cap for r in requests)
    assert all(0 <= t < 1000 for r in requests[:100] for t in r.prompt)


def test_summary_ratios():
    results = [Result("m", "w", "pagedserve", 300.0, 1.0, 150.0, 300),
               Result("m", "w", "hf-static", 100.0, 3.0, 100.0, 300),
               Result("m", "w", "hf-continuous", 150.0, 2.0, 50.0, 300)]
    (row,) = summarize(results)
    assert row["ratio_vs_hf-static"] == 3.0 and row["ratio_vs_hf-continuous"] == 2.0
    assert row["cpu_ratio_vs_hf-static"] == 1.5 and row["cpu_ratio_vs_hf-continuous"] == 3.0


def test_median_run_keeps_every_run():
    runs = [Measured((3.0, 5.0), "a", {}), Measured((1.0, 2.0), "b", {}), Measured((2.0, 4.0), "c", {})]
    median = median_run(runs)
    assert median.detail == "c" and median.config["runs_s"] == [[3.0, 5.0], [1.0, 2.0], [2.0, 4.0]]
    assert median_run(runs[:2]).detail == "a"  # an even count: the slower middle run


def test_step_breakdown_accounts_for_every_step(llama_checkpoint):
    from engine import LLM, SamplingParams
    from loadtest.profile_step import instrument

    llm = LLM(llama_checkpoint.path, skip_tokenizer_init=True, show_progress=False)
    timers = instrument(llm.engine)
    outs = llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5, 6, 7]],
                        sampling_params=SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]  # instrumenting changes no result
    ms = timers.breakdown()
    assert timers.steps == 5  # one prefill step (with its first token), then 4 decode steps
    parts = ("layers", "gemm", "attention", "model_other", "sampler", "scheduler", "prepare", "other")
    # The decoder layers run as one compiled call each; the LM head's GEMM is timed apart.
    assert all(ms[p] >= 0 for p in parts) and ms["layers"] > 0 and ms["gemm"] > 0 and ms["attention"] == 0
    assert sum(ms[p] for p in parts) == pytest.approx(ms["step"])
    model = ms["layers"] + ms["gemm"] + ms["attention"] + ms["model_other"]
    assert ms["python_overhead"] == pytest.approx(ms["step"] - model)


def test_step_breakdown_splits_unfused_layers(llama_checkpoint):
    """With the layers on their per-op forward (``--split-layers``), GEMM and attention are timed apart."""
    from engine import LLM, SamplingParams
    from loadtest.profile_step import instrument, unfuse

    llm = LLM(llama_checkpoint.path, skip_tokenizer_init=True, show_progress=False)
    unfuse(llm.engine)
    timers = instrument(llm.engine)
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(temperature=0, max_tokens=3))
    ms = timers.breakdown()
    assert ms["layers"] == 0 and ms["gemm"] > 0 and ms["attention"] > 0
