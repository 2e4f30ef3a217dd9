"""The kernel benchmark runs end to end (it checks the op against SDPA before timing)."""

from __future__ import annotations

import json

import torch

from loadtest import bench_kernels


def test_bench_writes_one_result_per_shape(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    threads = str(torch.get_num_threads())  # the bench sets it process-wide: keep the session's
    assert bench_kernels.main(["--contexts", "16", "40", "--seconds", "0.01", "--threads", threads, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["context"], r["dtype"]) for r in report["results"]] == [(16, "fp32"), (16, "bf16"), (40, "fp32"),
                                                                        (40, "bf16")]
    assert all(r["paged_us"] > 0 and r["paged_kv_gb_s"] > 0 for r in report["results"])
    assert "gather/paged" in capsys.readouterr().out
