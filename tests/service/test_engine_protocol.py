"""The worker's Engine protocol is what LLMEngine offers."""
from __future__ import annotations

from engine import EngineConfig, LLMEngine
from service.worker import Engine


def test_llm_engine_is_an_engine(demo_model: str) -> None:
    engine = LLMEngine(EngineConfig(model=demo_model, num_device_blocks=16, attention_backend="torch",
                                    num_threads=1, show_progress=False))
    assert isinstance(engine, Engine)
    assert not isinstance(object(), Engine)
