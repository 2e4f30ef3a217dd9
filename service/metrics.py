"""Prometheus metrics of a gateway, vLLM's names.

Latencies are measured here, where the client's clock runs; engine-side
figures (queue lengths, KV usage and fragmentation, preemptions, prefix-cache
hits) come from the engines' heartbeats, one label value per engine, each
exported under the name and kind its ``EngineStats`` field declares.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import fields
from functools import cached_property

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.stats import EngineStats
from service.messages import Heartbeat

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
_FAMILIES = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily}  # an EngineStats field's kind


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

    # Observed per token: labelled once, on first use (labels() is a locked dict lookup, ~1 us a call).
    @cached_property
    def model_ttft(self) -> Histogram:
        return self.ttft.labels(self.model_name)

    @cached_property
    def model_itl(self) -> Histogram:
        return self.itl.labels(self.model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads the latest heartbeats at scrape time."""

    def __init__(self, model_name: str, engines: Callable[[], dict[str, Heartbeat]]) -> None:
        self._model_name = model_name
        self._engines = engines

    def collect(self) -> Iterator[Metric]:
        beats = sorted(self._engines().items())
        if not beats:
            return
        for f in fields(EngineStats):
            family = _FAMILIES[f.metadata["kind"]](f.metadata["prometheus"], f.metadata["help"],
                                                   labels=["engine", "model_name"])
            for engine_id, beat in beats:
                family.add_metric([engine_id, beat.model], getattr(beat.stats, f.name))
            yield family
