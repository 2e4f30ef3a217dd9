"""Smoke run of the paper reproduction (``python -m loadtest.paper --quick``)."""
import json
import math

from loadtest import paper


def test_quick_reproduction_is_consistent(tmp_path):
    out = tmp_path / "paper.json"
    paper.main(["--quick", "--json", str(out), "--plots", str(tmp_path / "plots")])
    report = json.loads(out.read_text())
    assert report["simulated_time"] is True
    for allocator, row in report["validation"]["rows"].items():
        # The simulator drives the same Scheduler: it must take the real engine's steps exactly.
        assert row["real"]["steps"] == row["sim"]["steps"], allocator
        assert row["real"]["num_finished"] == paper.QUICK.validation_requests
    blocks, max_run = paper.QUICK.num_blocks, paper.MAX_MODEL_LEN // 16
    for workload, rows in report["saturated"].items():
        for allocator, r in rows.items():
            assert math.isclose(sum(r["breakdown"].values()), 1.0), (workload, allocator)
            assert r["num_failed"] == 0
        assert all(rows["paged"]["breakdown"]["stored"] > rows[a]["breakdown"]["stored"] for a in paper.BASELINES)
        assert all(rows["paged"]["mean_batch"] > rows[a]["mean_batch"] for a in paper.BASELINES)
        # Orca-Max: every run is max_model_len (a power of two of blocks), so exactly blocks // run fit.
        assert rows["contiguous-max"]["peak_batch"] == blocks // max_run
        assert rows["contiguous-max"]["breakdown"]["internal"] == 0.0
    assert all(row["saving"] > 0 for row in report["sampling"].values())
    # A beam search's candidates share more than the prompt: at every width it saves more than n samples.
    for key, row in report["beam_search"].items():
        assert row["saving"] > report["sampling"][key.replace("beam_width", "n")]["saving"], key
    assert all(row["ratio"] > 1 for row in report["beam_rates"].values())
    assert all(row["speedup"] > 1 for row in report["prefix"].values())
    pngs = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert pngs == ["batched_requests.png", "fig12_normalized_latency.png", "fig14_beam_search_rate.png",
                    "fig15_beam_search.png", "fig15_parallel_sampling.png", "fig16_shared_prefix.png",
                    "fig2_memory_breakdown.png"]
    assert all((tmp_path / "plots" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
