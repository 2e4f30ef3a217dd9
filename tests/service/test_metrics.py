"""The engines' figures on /metrics: each under the name and kind its EngineStats field declares."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from service.messages import Heartbeat
from service.metrics import GatewayMetrics
from tests.service.conftest import engine_stats

# What /metrics exports per engine; dashboards and alerts depend on these names.
ENGINE_GAUGES = {
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
    "vllm:kv_cache_usage_perc", "pagedserve:kv_token_utilization_perc", "pagedserve:num_blocks_total",
    "pagedserve:num_blocks_free", "pagedserve:num_blocks_cached", "pagedserve:num_blocks_used",
    "pagedserve:num_cpu_blocks_total", "pagedserve:num_cpu_blocks_used", "pagedserve:kv_tokens_stored",
    "pagedserve:kv_reserved_slots", "pagedserve:kv_internal_frag_slots", "pagedserve:kv_external_frag_slots",
    "pagedserve:kv_free_slots", "vllm:spec_decode_draft_acceptance_rate", "pagedserve:spec_decode_mean_accepted_length",
    "pagedserve:num_state_slots_total", "pagedserve:num_state_slots_used", "pagedserve:num_state_snapshots_total",
    "pagedserve:num_state_snapshots_used",
}
ENGINE_COUNTERS = {
    "vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens",
    "vllm:generation_tokens", "pagedserve:num_swapped_out_blocks", "pagedserve:num_swapped_in_blocks",
    "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",
}


def scrape(beats: dict[str, Heartbeat]) -> dict:
    text = GatewayMetrics("m", lambda: beats).render().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_engine_figures_keep_their_names_kinds_and_labels() -> None:
    beats = {e: Heartbeat(e, "i", "m", 2048, engine_stats(kv_cache_usage=usage, num_preemptions_total=n))
             for e, usage, n in (("e1", 0.25, 3), ("e2", 0.5, 0))}
    families = scrape(beats)
    assert {n for n, f in families.items() if f.type == "gauge"} == ENGINE_GAUGES
    assert {n for n, f in families.items() if f.type == "counter"} >= ENGINE_COUNTERS
    usage = {s.labels["engine"]: s.value for s in families["vllm:kv_cache_usage_perc"].samples}
    assert usage == {"e1": 0.25, "e2": 0.5}  # a 0-1 fraction, as vLLM exports it
    (sample,) = [s for s in families["vllm:num_preemptions"].samples if s.labels["engine"] == "e1"]
    assert (sample.name, sample.labels, sample.value) == (
        "vllm:num_preemptions_total", {"engine": "e1", "model_name": "m"}, 3)


def test_no_engine_no_engine_figures() -> None:
    assert not ENGINE_GAUGES & set(scrape({})) and not ENGINE_COUNTERS & set(scrape({}))
