"""One configuration object per service process (gateway, worker)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.field_specs import spec

DEMO_MODEL_NAME = "pagedserve-demo"


@dataclass(slots=True)
class RedisConfig:
    """Where the broker lives; shared by gateways and workers."""

    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "pagedserve"
    block_ms: int = 1000  # blocking reads; their socket timeout is a little longer

    def __post_init__(self) -> None:
        if self.block_ms < 1:
            raise ValueError(f"block_ms must be >= 1, got {self.block_ms}")
        if not self.prefix or any(c in self.prefix for c in " {}"):
            raise ValueError(f"invalid redis prefix {self.prefix!r}")


@dataclass(slots=True)
class GatewayConfig:
    redis: RedisConfig = field(default_factory=RedisConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None  # checkpoint folder (tokenizer, config.json); None: the demo model
    served_model_name: str | None = None  # default: the folder's basename
    max_model_len: int | None = None  # default: config.json, capped by the engines' heartbeats
    api_keys: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    max_pending_requests: int = 256  # submitted but not yet taken by an engine
    max_n: int = 16
    max_stop_strings: int = 16
    max_stop_string_len: int = 256
    max_logprobs: int = 20
    engine_poll_s: float = 0.5  # how often heartbeats are read
    retry_after_s: int = 1
    tokenizer_threads: int = spec(1, low=1, help="threads that render chat templates and tokenize prompts, off the "
                                                 "event loop (more than one needs a tokenizer safe to share)")
    prefix_cache_secret: str | None = spec(
        None, help="secret keying each API key's prefix-cache salt (default: random per gateway process; give every "
                   "gateway replica the same one so a key's requests share cached prefixes across replicas)")

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_pending_requests", "max_n", "max_stop_string_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if any(not key for key in self.api_keys):
            raise ValueError("API keys must be non-empty")


@dataclass(slots=True)
class WorkerConfig:
    redis: RedisConfig = field(default_factory=RedisConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_id: str = ""  # default: hostname-pid
    served_model_name: str | None = None
    heartbeat_interval_s: float = 0.5
    heartbeat_ttl_s: float = 3.0  # gateways fail this engine's requests once it expires
    reply_ttl_s: int = 300  # reply streams stay replayable this long after finishing
    max_pull: int = 8  # requests taken per step at most, so engines share the queue

    def __post_init__(self) -> None:
        if not self.engine_id:
            self.engine_id = f"{os.uname().nodename}-{os.getpid()}"
        if not 0 < self.heartbeat_interval_s < self.heartbeat_ttl_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_ttl_s")
        if self.reply_ttl_s < 1 or self.max_pull < 1:
            raise ValueError("reply_ttl_s and max_pull must be >= 1")


def served_name(model_path: str | None, explicit: str | None) -> str:
    """The model name clients send: explicit, else the folder name, else the demo's."""
    if explicit:
        return explicit
    if model_path is None:
        return DEMO_MODEL_NAME
    return os.path.basename(os.path.normpath(model_path))
