"""One configuration object per service process (gateway, worker), each field declared once.

As in ``EngineConfig``, a field's bounds and choices live in its ``spec`` and ``check_fields``
enforces them; one with a ``help`` is a command-line option (service/flags.py).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from engine.config import EngineConfig
from engine.field_specs import check_fields, spec

DEMO_MODEL_NAME = "pagedserve-demo"


def shared(cls: type, name: str) -> Any:
    """A copy of ``cls``'s field ``name`` (default and metadata): two configs share one declaration."""
    declared = next(f for f in fields(cls) if f.name == name)
    return field(default=declared.default, metadata=declared.metadata)


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Where the broker lives; shared by gateways and workers."""

    url: str = spec("redis://127.0.0.1:6379/0", flag="--redis-url",
                    help="Redis URL (redis://host:port/db, rediss://, unix:///path.sock)")
    prefix: str = spec("pagedserve", flag="--redis-prefix", help="key prefix, to share one Redis between deployments")
    # Blocking reads; their socket timeout is a little longer.
    block_ms: int = spec(1000, low=1, flag="--redis-block-ms", help="blocking-read time of the broker loops")

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.prefix or any(c in self.prefix for c in " {}"):
            raise ValueError(f"invalid redis prefix {self.prefix!r}")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    redis: RedisConfig = field(default_factory=RedisConfig)
    # The checkpoint folder (tokenizer, config.json) and its context length, as the engine reads them.
    model: str | None = shared(EngineConfig, "model")
    max_model_len: int | None = shared(EngineConfig, "max_model_len")  # capped by the engines' heartbeats
    served_model_name: str | None = spec(help="name clients send as 'model' (default: the folder's name, or "
                                              "pagedserve-demo)", group="model")
    host: str = spec("127.0.0.1", help="address to listen on")
    port: int = spec(8000, help="HTTP port")
    api_keys: tuple[str, ...] = spec((), flag="--api-key", secret=True,
                                     help="accepted API key, repeatable (Authorization: Bearer <key>); none: no auth")
    cors_origins: tuple[str, ...] = spec((), flag="--cors-origin", help="allowed CORS origin, repeatable ('*' for any)")
    max_body_bytes: int = spec(1 << 20, low=1, help="request body limit (413 above)")
    max_pending_requests: int = spec(256, low=1, help="requests waiting for an engine before 429")
    max_n: int = spec(16, low=1, help="largest n accepted")
    max_stop_strings: int = spec(16, help="most stop strings per request")
    max_stop_string_len: int = spec(256, low=1, help="longest stop string accepted, in characters")
    max_logprobs: int = spec(20, help="largest logprobs / top_logprobs accepted")
    engine_poll_s: float = spec(0.5, flag="--engine-poll", help="seconds between reads of the engines' heartbeats")
    retry_after_s: int = spec(1, flag="--retry-after", help="Retry-After seconds sent with a 429")
    tokenizer_threads: int = spec(1, low=1, help="threads that render chat templates and tokenize prompts, off the "
                                                 "event loop (more than one needs a tokenizer safe to share)")
    prefix_cache_secret: str | None = spec(
        None, secret=True, help="secret keying each API key's prefix-cache salt (default: random per gateway "
                                "process; give every gateway replica the same one so a key's requests share "
                                "cached prefixes across replicas)")

    def __post_init__(self) -> None:
        check_fields(self)
        if any(not key for key in self.api_keys):
            raise ValueError("API keys must be non-empty")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    redis: RedisConfig = field(default_factory=RedisConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    engine_id: str = spec("", help="this engine's consumer name (default: hostname-pid)")
    served_model_name: str | None = shared(GatewayConfig, "served_model_name")
    heartbeat_interval_s: float = spec(0.5, low=0, low_open=True, flag="--heartbeat-interval",
                                       help="seconds between heartbeats")
    # Gateways fail this engine's requests once it expires.
    heartbeat_ttl_s: float = spec(3.0, flag="--heartbeat-ttl",
                                  help="seconds after the last heartbeat when gateways give up on this engine")
    reply_ttl_s: int = spec(300, low=1, flag="--reply-ttl",
                            help="seconds a finished request's reply stream stays readable")
    # Requests taken per step at most, so engines share the queue.
    max_pull: int = spec(8, low=1, help="most new requests taken per step")

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.heartbeat_interval_s < self.heartbeat_ttl_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_ttl_s")
        if not self.engine_id:  # settled here, once: the config is frozen from then on
            object.__setattr__(self, "engine_id", f"{os.uname().nodename}-{os.getpid()}")


def served_name(model_path: str | None, explicit: str | None) -> str:
    """The model name clients send: explicit, else the folder name, else the demo's."""
    if explicit:
        return explicit
    if model_path is None:
        return DEMO_MODEL_NAME
    return os.path.basename(os.path.normpath(model_path))
