"""A short chaos run (loadtest/chaos.py) in the default suite: workers SIGKILLed and SIGTERMed at
random, SIGSTOPped (routed requests stolen or resumed) and given stale prefix summaries under streaming
load; every request completes with its undisturbed text, none hangs. Redis
restarts, which lose in-flight requests by design (no persistence), are left to test_faults.py. A hostile
client of another key runs beside the load."""
from __future__ import annotations

from loadtest.chaos import ChaosOptions, plot, run_chaos


def test_short_chaos_run_loses_and_duplicates_nothing(demo_model: str, tmp_path) -> None:
    result = run_chaos(ChaosOptions(minutes=0.5, seed=3, clients=4, mean_fault_s=5, redis_faults=False,
                                    model=demo_model, hostile=1))
    assert result["faults"] and result["completed"] > 0
    assert result["hung"] == 0 and result["tokens_duplicated"] == 0 and result["tokens_lost"] == 0
    assert result["failed"] == 0, result["failures"]
    # Another key beside the load: its resumes of the load's streams are 404s (and changed no text, as
    # judged above), its bad bodies 4xx, never a 5xx.
    hostile = result["hostile"]
    assert result["hostile_5xx"] == 0 and hostile.get("foreign resume -> 404") and hostile.get("bad body -> 400")
    assert all(status == "404" for what, status in (k.split(" -> ") for k in hostile) if what == "foreign resume")
    assert all(status.startswith("4") for what, status in (k.split(" -> ") for k in hostile) if what == "bad body")
    plot(result, str(tmp_path / "timeline.png"))
    assert (tmp_path / "timeline.png").stat().st_size > 0
