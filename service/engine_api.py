"""What the worker needs of an engine; ``engine.LLMEngine`` is one (tests/service/test_engine_protocol.py checks it)."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from engine.core.kv_snapshot import KVSnapshot
from engine.multimodal.inputs import ImagePatches
from engine.outputs import RequestOutput, ResumeState
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats


@runtime_checkable
class Engine(Protocol):
    """Never called while a step runs: the worker steps it on one thread and reads it between steps."""

    max_model_len: int

    def prefix_cache_summary(self) -> tuple[int, set[bytes]]: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | PoolingParams, *,
                    cache_salt: str | None = None, resume: ResumeState | None = None, priority: int = 0,
                    images: list[ImagePatches] | None = None) -> None: ...

    def abort_request(self, request_ids: list[str]) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def has_capacity(self) -> bool: ...

    def stats(self) -> EngineStats: ...

    def kv_snapshot(self) -> KVSnapshot: ...
