"""The structured-output benchmark's smoke run: its report's fields, and every constrained output checked against
the schema by jsonschema here; its summary's arithmetic on set timings (exact whatever the machine's speed)."""
from __future__ import annotations

import json

import pytest

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")


def test_smoke_run_reports_and_every_output_validates(tmp_path):
    from loadtest.bench_structured import SCHEMA, main

    path = tmp_path / "report.json"
    summary = main(["--num-requests", "4", "--repeats", "1", "--max-tokens", "128", "--backend", "torch",
                    "--json", str(path)])
    report = json.loads(path.read_text())
    assert report["summary"] == summary and report["schema"] == SCHEMA
    assert summary["num_constrained_outputs"] == summary["num_valid"] == 4 and summary["all_valid"]
    assert summary["finish_reasons"] == {"stop": 4}  # each ended where its grammar completed, not at the cap
    # The twins generated exactly their constrained runs' lengths.
    assert summary["constrained_mean_output_len"] == summary["unconstrained_mean_output_len"] > 0
    assert summary["constrained_tok_s"] > 0 and summary["unconstrained_tok_s"] > 0
    assert summary["ratio"] > 0  # its arithmetic: test_the_ratio_is_against_the_faster_baseline, on set timings
    assert summary["mask_fill_steps"] > 0 and summary["mask_fill_ms_per_step"] > 0 and summary["compile_s"] > 0
    (constrained,) = report["runs"]["constrained"]
    assert len(constrained["texts"]) == 4
    for text in constrained["texts"]:
        jsonschema.validate(json.loads(text), SCHEMA)
    for mode in ("unconstrained", "unconstrained_full_logits"):
        (twin,) = report["runs"][mode]
        assert twin["tokens"] == constrained["tokens"] and twin["mask_fill_steps"] == 0
    fastest = max(summary["unconstrained_argmax_only_tok_s"], summary["unconstrained_full_logits_tok_s"])
    assert summary["unconstrained_tok_s"] == fastest  # the baseline at its best


def test_the_ratio_is_against_the_faster_baseline():
    """The summary of set wall times: each mode's median run, the ratio against the faster unconstrained one."""
    from loadtest.bench_structured import Run, summarize

    def runs(*walls: float) -> list[Run]:  # 80 tokens each: 20 tok/s at 4 s, 32 at 2.5 s, 40 at 2 s
        return [Run((wall, wall), [30, 50], ["{}", "{}"], ["stop", "stop"], (0.5, 10)) for wall in walls]

    summary = summarize({"constrained": runs(8.0, 4.0, 2.0), "unconstrained": runs(2.5),
                         "unconstrained_full_logits": runs(1.0, 2.0, 4.0)})
    assert (summary["constrained_tok_s"], summary["unconstrained_argmax_only_tok_s"],
            summary["unconstrained_full_logits_tok_s"]) == (20.0, 32.0, 40.0)
    assert summary["baseline"] == "full_logits" and summary["unconstrained_tok_s"] == 40.0
    assert summary["ratio"] == 0.5 and summary["mask_fill_ms_per_step"] == 50.0
