"""The MoE benchmark runs end to end (it checks every system against the reference before timing)."""

from __future__ import annotations

import json

import torch

from loadtest import bench_moe


def test_bench_writes_one_result_per_shape_and_row_count(tmp_path, capsys):
    out = tmp_path / "moe.json"
    threads = torch.get_num_threads()  # the bench sets it process-wide: keep the session's
    assert bench_moe.main(["--rows", "1", "5", "--calls", "1", "--threads", str(threads), "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["shape"], r["rows"]) for r in results] == [(s, n) for s in bench_moe.SHAPES for n in (1, 5)]
    assert all(r["ms"]["fused_moe"] > 0 and set(r["speedup"]) == {"expert_loop", "reference"} for r in results)
    assert "speed-up" in capsys.readouterr().out
