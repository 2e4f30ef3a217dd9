"""A short chaos run (loadtest/chaos.py) in the default suite: workers SIGKILLed and SIGTERMed at
random, SIGSTOPped (routed requests stolen or resumed) and given stale prefix summaries under streaming
load; every request completes with its undisturbed text, none hangs. Redis
restarts, which lose in-flight requests by design (no persistence), are left to test_faults.py."""
from __future__ import annotations

from loadtest.chaos import ChaosOptions, plot, run_chaos


def test_short_chaos_run_loses_and_duplicates_nothing(demo_model: str, tmp_path) -> None:
    result = run_chaos(ChaosOptions(minutes=0.5, seed=3, clients=4, mean_fault_s=5, redis_faults=False,
                                    model=demo_model))
    assert result["faults"] and result["completed"] > 0
    assert result["hung"] == 0 and result["tokens_duplicated"] == 0 and result["tokens_lost"] == 0
    assert result["failed"] == 0, result["failures"]
    plot(result, str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").stat().st_size > 0
