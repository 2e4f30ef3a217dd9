"""One configuration object per service process (gateway, worker), each field declared once.

As in ``EngineConfig``, a field's bounds and choices live in its ``spec`` and ``check_fields``
enforces them; one with a ``help`` is a command-line option (service/flags.py).
"""
from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field, fields
from typing import Any

from engine.config import EngineConfig
from engine.field_specs import check_fields, spec

from service.limits import KeyPolicy, parse_key_policies, parse_policy
from service.redis_url import RedisNodes, read_nodes

DEMO_MODEL_NAME = "pagedserve-demo"


def shared(cls: type, name: str) -> Any:
    """A copy of ``cls``'s field ``name`` (default and metadata): two configs share one declaration."""
    declared = next(f for f in fields(cls) if f.name == name)
    return field(default=declared.default, metadata=declared.metadata)


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """Where the broker lives; shared by gateways and workers."""

    url: str = spec("redis://127.0.0.1:6379/0", flag="--redis-url",
                    help="Redis URL (redis://host:port/db, rediss://, unix:///path.sock), a Sentinel set "
                         "(redis+sentinel://host:port[,host:port...]/SERVICE[/db]) or a Redis Cluster "
                         "(redis+cluster://host:port[,host:port...])")
    prefix: str = spec("pagedserve", flag="--redis-prefix", help="key prefix, to share one Redis between deployments")
    # Blocking reads; their socket timeout is a little longer.
    block_ms: int = spec(1000, low=1, flag="--redis-block-ms", help="blocking-read time of the broker loops")
    # A burst waits for a pooled connection instead of failing: redis-py's plain pool refuses at its cap.
    max_connections: int = spec(64, low=1, high=10_000, flag="--redis-max-connections",
                                help="connections per Redis client; more concurrent commands wait for one")
    # An ACL user (README, "Redis ACL user"); secrets, so they travel in the environment, never in argv.
    username: str | None = spec(None, flag="--redis-username", secret=True, help="Redis ACL user name")
    password: str | None = spec(None, flag="--redis-password", secret=True,
                                help="Redis password (of the ACL user, or requirepass's)")
    sentinel_password: str | None = spec(None, flag="--redis-sentinel-password", secret=True,
                                         help="password of the Sentinels themselves (their requirepass), when "
                                              "they ask for one; the URL's or --redis-password is the data's")
    # TLS (rediss://): the server's CA, and a client certificate where the server asks for one.
    ssl_ca_certs: str | None = spec(None, flag="--redis-ssl-ca", help="CA bundle that verifies a rediss:// server")
    ssl_certfile: str | None = spec(None, flag="--redis-ssl-cert", help="client certificate for rediss:// (PEM)")
    ssl_keyfile: str | None = spec(None, flag="--redis-ssl-key", help="client certificate's key for rediss:// (PEM)")

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.prefix or any(c in self.prefix for c in " {}"):
            raise ValueError(f"invalid redis prefix {self.prefix!r}")
        if not self.url.startswith("rediss://") and (self.ssl_ca_certs or self.ssl_certfile or self.ssl_keyfile):
            raise ValueError("the --redis-ssl-* options need a rediss:// URL")
        self.nodes()  # a malformed Sentinel or Cluster URL fails at start

    def __repr__(self) -> str:  # never the password, should a config be logged
        return f"RedisConfig(url={_without_password(self.url)!r}, prefix={self.prefix!r}, user={self.username!r})"

    def connection_options(self) -> dict[str, str]:
        """redis-py's keyword arguments for the options that are set (a URL's own user and password win)."""
        names = ("username", "password", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
        options = {name: value for name in names if (value := getattr(self, name)) is not None}
        nodes = self.nodes()
        credentials = {} if nodes is None else {"username": nodes.username, "password": nodes.password}
        return options | {name: value for name, value in credentials.items() if value is not None}

    def nodes(self) -> RedisNodes | None:
        """The hosts of a ``redis+sentinel://`` or ``redis+cluster://`` URL; None for a single server's URL."""
        return read_nodes(self.url)


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    return f"{scheme}{sep}{credentials.partition(':')[0]}:***@{host}" if at else url


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    redis: RedisConfig = field(default_factory=RedisConfig)
    # The checkpoint folder (tokenizer, config.json) and its context length, as the engine reads them.
    model: str | None = shared(EngineConfig, "model")
    max_model_len: int | None = shared(EngineConfig, "max_model_len")  # capped by the engines' heartbeats
    served_model_name: str | None = spec(help="name clients send as 'model' (default: the folder's name, or "
                                              "pagedserve-demo)", group="model")
    host: str = spec("127.0.0.1", help="address to listen on")
    insecure_no_auth: bool = spec(False, help="listen on a non-loopback address without API keys (anyone who "
                                              "reaches the port may use the model)")
    port: int = spec(8000, help="HTTP port")
    api_keys: tuple[str, ...] = spec((), flag="--api-key", secret=True,
                                     help="accepted API key, repeatable (Authorization: Bearer <key>); none: no auth")
    admin_keys: tuple[str, ...] = spec((), flag="--admin-key", secret=True,
                                       help="API key that also sees every tenant's requests (KV snapshot ids) and "
                                            "the /metrics totals, repeatable; with admin keys set, /metrics needs one")
    cors_origins: tuple[str, ...] = spec((), flag="--cors-origin", help="allowed CORS origin, repeatable ('*' for any)")
    max_body_bytes: int = spec(1 << 20, low=1, help="request body limit (413 above)")
    # Slow clients hold connections for free (slowloris): each phase of a request has a deadline
    # (docs/security.md, "Connections and timeouts").
    header_timeout_s: float = spec(10.0, low=0, low_open=True, flag="--header-timeout",
                                   help="seconds a client has to send a request's headers, from connecting (or, "
                                        "on a kept-alive connection, from the request's first byte); then the "
                                        "connection is closed")
    body_timeout_s: float = spec(30.0, low=0, low_open=True, flag="--body-timeout",
                                 help="seconds a request's body may take to arrive once its headers are in; then "
                                      "408 and the connection is closed")
    keepalive_timeout_s: float = spec(75.0, low=0, low_open=True, flag="--keepalive-timeout",
                                      help="seconds an idle keep-alive connection is kept open")
    max_connections_per_peer: int = spec(256, low=0, help="connections one client address (an IPv6 one's /64) may "
                                                          "hold at once; more are answered 429 and closed; 0: no cap")
    # A reverse proxy on this host, and local load tests, bring every client through one loopback address.
    max_loopback_connections: int = spec(4096, low=0, help="the same cap for loopback clients; 0: no cap")
    max_pending_requests: int = spec(256, low=1, help="requests waiting for an engine before 429")
    max_n: int = spec(16, low=1, help="largest n accepted")
    max_stop_strings: int = spec(16, help="most stop strings per request")
    max_stop_string_len: int = spec(256, low=1, help="longest stop string accepted, in characters")
    max_logprobs: int = spec(20, help="largest logprobs / top_logprobs / prompt_logprobs accepted")
    max_logit_bias: int = spec(300, low=0, high=1024, help="most logit_bias entries per request")
    max_prompts: int = spec(64, low=1, help="most prompts in one /v1/completions request (a list of prompts)")
    # Images (vision-language models): data URLs only; each bounded before it is decoded (docs/serving.md).
    max_images_per_request: int = spec(8, low=0, help="most image parts in one chat request (400 above)")
    max_image_bytes: int = spec(8 << 20, low=1, help="largest image accepted, encoded (413 above; the request "
                                                     "body must fit max_body_bytes too)")
    max_image_pixels: int = spec(16 << 20, low=1, help="largest image accepted, width x height (413 above)")
    allowed_media_domains: tuple[str, ...] = spec((), flag="--allowed-media-domains",
                                                  help="host whose http(s) image URLs the gateway fetches (no "
                                                       "redirects, bounded by max_image_bytes), repeatable; none: "
                                                       "only data URLs")
    media_fetch_timeout_s: float = spec(10.0, low=0, low_open=True, flag="--media-fetch-timeout",
                                        help="seconds an image URL's fetch may take")
    # Compiling a schema takes time and memory proportional to its size; this bounds both.
    max_structured_output_chars: int = spec(64 << 10, low=1, help="largest JSON schema / regex / grammar / "
                                                                   "choice list accepted, in characters")
    # vLLM's names; None or "none": tool_choice "auto" is refused (a forced call needs no parser).
    tool_call_parser: str | None = spec("hermes", choices=("hermes", "llama3_json", "mistral", "pythonic",
                                                           "qwen3_coder", "gpt_oss", "none", None),
                                        help="format of the tool calls the model writes (hermes: Qwen2.5/Qwen3/"
                                             "Hermes, llama3_json: Llama 3.1/3.2, mistral, pythonic: Llama 3.2/"
                                             "Llama 4's [f(x=1)], qwen3_coder: Qwen3-Coder's XML, gpt_oss: "
                                             "harmony's messages to functions.NAME), parsed for "
                                             "tool_choice 'auto'; none: no parsing")
    reasoning_parser: str | None = spec(None, choices=("deepseek_r1", "qwen3", "gpt_oss", None),
                                        help="split the model's <think>...</think> into reasoning_content "
                                             "(deepseek_r1: the template opens it in the prompt; qwen3: the "
                                             "model opens it; gpt_oss: harmony's analysis channel, the final "
                                             "channel's body as content)")
    engine_poll_s: float = spec(0.5, flag="--engine-poll", help="seconds between reads of the engines' heartbeats")
    retry_after_s: int = spec(1, flag="--retry-after", help="Retry-After seconds sent with a 429 or a 503")
    # A Redis blip must not fail every healthy stream: only this many failed reads in a row do.
    engine_read_failures: int = spec(3, low=1, help="consecutive failed heartbeat reads before the engines "
                                                    "are taken for gone")
    gateway_ttl_s: float = spec(5.0, low=0, low_open=True, flag="--gateway-ttl",
                                help="seconds this gateway's heartbeat outlives it (engines then abort its "
                                     "requests, after their orphan grace)")
    # An engine that dies is replaced by a resumer, which says so with a new ACCEPTED.
    resume_deadline_s: float = spec(15.0, low=0, flag="--resume-deadline",
                                    help="seconds a request waits for another engine to resume it once its "
                                         "engine (or every engine, or Redis) is gone, before a 503")
    # Redis without persistence can ack an event and die before this gateway read it; its engine sends
    # the last seconds' events again once it finds Redis restarted empty (WorkerConfig.replay_window_s).
    gap_wait_s: float = spec(5.0, low=0, flag="--gap-wait",
                             help="seconds a stream waits for a missing reply event (later ones are held) "
                                  "before it ends with an error")
    accept_deadline_s: float = spec(60.0, low=0, low_open=True, flag="--accept-deadline",
                                    help="seconds a request waits for an engine to take it before a 503")
    sse_event_ids: bool = spec(False, help="send every stream's SSE 'id:' lines (resume tokens); without it only a "
                                           "request with 'X-Resumable: 1' (or a resume) gets them, and the "
                                           "stream's framing is OpenAI's")
    sse_keepalive_s: float = spec(15.0, low=0, flag="--sse-keepalive",
                                  help="seconds without an event after which a stream sends a ': keep-alive' "
                                       "comment, so proxies keep it open (0: never)")
    response_ttl_s: float = spec(86400.0, low=1, flag="--response-ttl",
                                 help="seconds a Responses API response (store=true, the default) stays readable "
                                      "for previous_response_id and GET /v1/responses/{id}")
    reconnect_grace_s: float = spec(10.0, low=0, flag="--reconnect-grace",
                                    help="seconds a stream whose client hung up keeps running for the client "
                                         "to resume it (Last-Event-ID) before it is aborted")
    tokenizer_threads: int | None = spec(None, low=1, help="threads that render chat templates, tokenize prompts "
                                                            "and detokenize outputs, off the event loop; a tenant "
                                                            "runs on all but one of them (default: 2 for a fast "
                                                            "tokenizer, safe to share; 1 otherwise)")
    # Generous: long runs of spaces or symbols are single tokens in many vocabularies.
    max_chars_per_token: int = spec(64, low=1, help="prompts longer than the context length times this many "
                                                    "characters are rejected before tokenizing")
    prefix_routing: bool = spec(True, flag="--no-prefix-routing",
                                help="queue every request on the shared stream, not on the stream of the engine "
                                     "that holds the longest part of its prompt in its prefix cache")
    route_slack: int = spec(16, low=0, help="requests (running or waiting) an engine may have beyond the least "
                                           "loaded engine and still be routed a request for its cached prefix")
    key_policies: tuple[str, ...] = spec(
        (), flag="--key-policy", secret=True,
        help="one API key's priority and limits, repeatable: KEY:priority=N;max_concurrent=N;tokens_per_min=N "
             "(any subset; priority is added to each request's own, lower runs first; the limits hold across "
             "every gateway, through Redis; 429 with Retry-After beyond them)")
    default_key_policy: str = spec("", help="the policy of every key without its own --key-policy (and of "
                                            "requests without a key), e.g. max_concurrent=32;tokens_per_min=200000")
    limit_lease_s: float = spec(600.0, low=0, low_open=True, flag="--limit-lease",
                                help="seconds a request's concurrency slot outlives a gateway that died "
                                     "holding it")
    prefix_cache_secret: str | None = spec(
        None, secret=True, help="secret keying each API key's prefix-cache salt (default: random per gateway "
                                "process; give every gateway replica the same one so a key's requests share "
                                "cached prefixes across replicas)")

    def __post_init__(self) -> None:
        check_fields(self)
        if any(not key for key in self.api_keys + self.admin_keys):
            raise ValueError("API keys must be non-empty")
        require_auth(self.host, self.all_keys, self.insecure_no_auth)
        self.policies()  # a malformed policy fails at start

    @property
    def all_keys(self) -> tuple[str, ...]:
        """Every accepted key: the tenants' and the admins'."""
        return self.api_keys + self.admin_keys

    def policies(self) -> tuple[dict[str, KeyPolicy], KeyPolicy]:
        """(policy by API key, the default one)."""
        return parse_key_policies(self.key_policies), parse_policy(self.default_key_policy)


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
    replay_window_s: float = spec(5.0, low=0, flag="--replay-window",
                                  help="seconds of sent replies kept to send again when Redis is found "
                                       "restarted empty (it may have lost them unread)")
    # Requests taken per step at most, so engines share the queue.
    max_pull: int = spec(8, low=1, help="most new requests taken per step")
    steal_after_s: float = spec(1.0, low=0, flag="--steal-after",
                                help="seconds a request routed to another engine may wait unread before this "
                                     "engine, with room, takes it")
    checkpoint_interval_s: float = spec(2.0, low=0, low_open=True, flag="--checkpoint-interval",
                                        help="seconds between checkpoints of each running request's delivered "
                                             "tokens (a resuming engine reads the replies since the last one)")
    max_deliveries: int = spec(3, low=1, help="engines a request may have failed on before it is dead-lettered")
    drain_timeout_s: float = spec(30.0, low=0, flag="--drain-timeout",
                                  help="seconds a SIGTERM waits for in-flight requests before leaving them to "
                                       "other engines")
    max_failed_steps: int = spec(5, low=1, help="consecutive failed engine steps that make the worker exit "
                                                "(non-zero) for its supervisor to restart it")
    step_lane: bool = spec(True, flag="--no-step-lane",
                           help="publish and poll on the asyncio client while the step runs, not on the step "
                                "lane around each step (~2x more worker CPU per token)")
    # One round trip more per step (~20 us to a local Redis, more to another host) buys a step less of TTFT
    # for each request that arrives during one: worth it once steps are long.
    poll_after_step_s: float = spec(0.01, low=0, flag="--poll-after-step",
                                    help="step duration (seconds) from which the step lane polls for new requests "
                                         "after each step rather than before it (a request arriving during a step "
                                         "then joins the next one)")
    # A gateway's clients may reconnect elsewhere for this long (its requests are kept if one adopts them).
    orphan_grace_s: float = spec(10.0, low=0, flag="--orphan-grace",
                                 help="seconds after a gateway's heartbeat is gone before its requests are aborted")

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.heartbeat_interval_s < self.heartbeat_ttl_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_ttl_s")
        if not self.engine_id:  # settled here, once: the config is frozen from then on
            object.__setattr__(self, "engine_id", f"{os.uname().nodename}-{os.getpid()}")


def require_auth(host: str, api_keys: tuple[str, ...], insecure_no_auth: bool) -> None:
    """Fails closed: a gateway reachable from other machines needs API keys, unless told otherwise."""
    if api_keys or insecure_no_auth or is_loopback(host):
        return
    raise ValueError(f"refusing to listen on {host!r} without API keys: anyone who can reach it could use the "
                     "model. Give --api-key (or PAGEDSERVE_API_KEY), listen on 127.0.0.1, or pass "
                     "--insecure-no-auth if the network in front of it does the authentication")


def is_loopback(host: str) -> bool:
    """Only addresses that certainly stay on this machine; a name other than localhost may resolve anywhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name, or "" (every interface)
        return False


def served_name(model_path: str | None, explicit: str | None) -> str:
    """The model name clients send: explicit, else the folder name, else the demo's."""
    if explicit:
        return explicit
    if model_path is None:
        return DEMO_MODEL_NAME
    return os.path.basename(os.path.normpath(model_path))
