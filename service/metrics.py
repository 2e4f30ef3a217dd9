"""Prometheus metrics of a gateway, vLLM's names.

Latencies are measured here, where the client's clock runs; engine-side
figures (queue lengths, KV usage and fragmentation, preemptions, prefix-cache
hits) come from the engines' heartbeats, one label value per engine.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from service.messages import Heartbeat

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
# engine.stats() key -> exported name; counters get "_total" from prometheus_client.
_ENGINE_COUNTERS = {
    "num_preemptions_total": "vllm:num_preemptions",
    "prefix_cache_queries_total": "vllm:prefix_cache_queries",
    "prefix_cache_hits_total": "vllm:prefix_cache_hits",
    "prompt_tokens_total": "vllm:prompt_tokens",
    "generation_tokens_total": "vllm:generation_tokens",
    "num_swapped_out_blocks_total": "pagedserve:num_swapped_out_blocks",
    "num_swapped_in_blocks_total": "pagedserve:num_swapped_in_blocks",
}
_ENGINE_GAUGES = {
    "num_requests_running": "vllm:num_requests_running",
    "num_requests_waiting": "vllm:num_requests_waiting",
    "num_requests_swapped": "vllm:num_requests_swapped",
    "kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
}  # any other stats key is exported as pagedserve:<key>


class GatewayMetrics:
    def __init__(self, model_name: str, engines: Callable[[], dict[str, Heartbeat]]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", labels,
                             registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             registry=self.registry, buckets=_LATENCY_BUCKETS)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=self.registry)
        self.errors = Counter("pagedserve:http_errors", "Error responses by status.", ["status"],
                              registry=self.registry)
        self.registry.register(_EngineCollector(model_name, engines))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads the latest heartbeats at scrape time."""

    def __init__(self, model_name: str, engines: Callable[[], dict[str, Heartbeat]]) -> None:
        self._model_name = model_name
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for engine_id, beat in sorted(self._engines().items()):
            for key, value in sorted(beat.stats.items()):
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._family(families, key).add_metric([engine_id, beat.model], value)
        yield from families.values()

    @staticmethod
    def _family(families: dict[str, Metric], key: str) -> Metric:
        if key not in families:
            labels = ["engine", "model_name"]
            if key in _ENGINE_COUNTERS:
                families[key] = CounterMetricFamily(_ENGINE_COUNTERS[key], f"Engine {key}.", labels=labels)
            else:
                name = _ENGINE_GAUGES.get(key, f"pagedserve:{key}")
                families[key] = GaugeMetricFamily(name, f"Engine {key}.", labels=labels)
        return families[key]
