"""pagedserve engine: paged KV cache, continuous batching scheduler, models and the offline LLM API."""
from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import BeamSearchOutput, BeamSequence, CompletionOutput, RequestOutput, ResumeState
from engine.pooling_params import PoolingParams
from engine.sampling_params import BeamSearchParams, SamplingParams
from engine.stats import EngineStats

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "EngineStats", "ResumeState", "PoolingParams",
           "BeamSearchParams", "BeamSearchOutput", "BeamSequence"]
