"""The ``pagedserve`` command: serve | gateway | worker | demo-model.

Every flag has an environment twin, PAGEDSERVE_<FLAG> (dashes as underscores);
the flag wins when both are given. Repeatable flags take a comma-separated list
from the environment. The engine's flags are EngineConfig's fields.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig

from service.config import GatewayConfig, RedisConfig, WorkerConfig, served_name
from service.flags import add_engine_flags, add_flag, changed_flags, engine_options, env_name
from service.local_stack import LocalStack, RedisServerMissing

log = logging.getLogger("pagedserve")

_REDIS_HELP = ("redis-server was not found on PATH. Install it (Debian/Ubuntu: sudo apt-get install -y "
               "redis-server; macOS: brew install redis), or run 'pagedserve gateway' and 'pagedserve worker' "
               "against an existing Redis with --redis-url.")


def _redis_flags(parser: argparse.ArgumentParser, with_url: bool = True) -> None:
    g = parser.add_argument_group("broker")
    if with_url:
        add_flag(g, "--redis-url", "Redis URL (redis://host:port/db, rediss://, unix:///path.sock)",
                 default="redis://127.0.0.1:6379/0")
    add_flag(g, "--redis-prefix", "key prefix, to share one Redis between deployments", default="pagedserve")
    add_flag(g, "--redis-block-ms", "blocking-read time of the broker loops", type=int, default=1000)


def _model_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    add_engine_flags(g, "model")
    add_flag(g, "--served-model-name", "name clients send as 'model' (default: the folder's name, or pagedserve-demo)")


def _gateway_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("gateway")
    add_flag(g, "--host", "address to listen on", default="127.0.0.1")
    add_flag(g, "--port", "HTTP port", type=int, default=8000)
    add_flag(g, "--api-key", "accepted API key, repeatable (Authorization: Bearer <key>); none: no auth",
             action="append", default=[])
    add_flag(g, "--cors-origin", "allowed CORS origin, repeatable ('*' for any)", action="append", default=[])
    add_flag(g, "--max-body-bytes", "request body limit (413 above)", type=int, default=1 << 20)
    add_flag(g, "--max-pending-requests", "requests waiting for an engine before 429", type=int, default=256)
    add_flag(g, "--max-n", "largest n accepted", type=int, default=16)
    add_flag(g, "--max-stop-strings", "most stop strings per request", type=int, default=16)
    add_flag(g, "--max-logprobs", "largest logprobs / top_logprobs accepted", type=int, default=20)


def _worker_flags(parser: argparse.ArgumentParser) -> None:
    add_engine_flags(parser.add_argument_group("engine"), "engine")
    w = parser.add_argument_group("worker")
    add_flag(w, "--engine-id", "this engine's consumer name (default: hostname-pid)", default="")
    add_flag(w, "--heartbeat-interval", "seconds between heartbeats", type=float, default=0.5)
    add_flag(w, "--heartbeat-ttl", "seconds after the last heartbeat when gateways give up on this engine",
             type=float, default=3.0)
    add_flag(w, "--reply-ttl", "seconds a finished request's reply stream stays readable", type=int, default=300)
    add_flag(w, "--max-pull", "most new requests taken per step", type=int, default=8)


def _common_flags(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--log-level", "logging level", default="INFO",
             choices=["DEBUG", "INFO", "WARNING", "ERROR"])


_LAYOUTS: dict[str, tuple[str, list[Callable[[argparse.ArgumentParser], None]]]] = {
    "serve": ("run everything on this machine: a private redis-server, a worker and a gateway",
              [lambda p: _redis_flags(p, with_url=False), _model_flags, _gateway_flags, _worker_flags,
               _common_flags]),
    "gateway": ("run the OpenAI-compatible HTTP gateway against --redis-url",
                [_redis_flags, _model_flags, _gateway_flags, _common_flags]),
    "worker": ("run one engine worker against --redis-url",
               [_redis_flags, _model_flags, _worker_flags, _common_flags]),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help, adders) in _LAYOUTS.items():
        p = sub.add_parser(name, help=help, description=help)
        for add in adders:
            add(p)
    demo = sub.add_parser("demo-model", help="write the demo checkpoint to PATH", description="write the demo "
                          "checkpoint (random weights, byte-level tokenizer; it generates noise) to PATH")
    demo.add_argument("path", metavar="PATH")
    return parser


def redis_config(args: argparse.Namespace) -> RedisConfig:
    return RedisConfig(url=args.redis_url, prefix=args.redis_prefix, block_ms=args.redis_block_ms)


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        redis=redis_config(args), host=args.host, port=args.port, model=args.model,
        served_model_name=args.served_model_name, max_model_len=args.max_model_len,
        api_keys=tuple(args.api_key), cors_origins=tuple(args.cors_origin), max_body_bytes=args.max_body_bytes,
        max_pending_requests=args.max_pending_requests, max_n=args.max_n, max_stop_strings=args.max_stop_strings,
        max_logprobs=args.max_logprobs)


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    engine = EngineConfig(**engine_options(args), show_progress=False)
    return WorkerConfig(redis=redis_config(args), engine=engine, engine_id=args.engine_id,
                        served_model_name=args.served_model_name, heartbeat_interval_s=args.heartbeat_interval,
                        heartbeat_ttl_s=args.heartbeat_ttl, reply_ttl_s=args.reply_ttl, max_pull=args.max_pull)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo-model":
        from engine.demo_model import write_demo_model
        print(write_demo_model(args.path))
        return 0
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "gateway":
            _run_async(_serve_gateway(gateway_config(args)))
        elif args.command == "worker":
            _run_async(_serve_worker(worker_config(args)))
        else:
            return _serve_all(args)
    except ValueError as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 2
    return 0


def _run_async(coro: Any) -> None:
    import uvloop
    uvloop.run(coro)


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def _serve_gateway(config: GatewayConfig) -> None:
    from aiohttp import web

    from engine.demo_model import ensure_demo_model
    from engine.models.config import context_length
    from service.broker import RedisGatewayBroker
    from service.gateway import Gateway
    from service.tokenization import load_tokenizer

    path = config.model or ensure_demo_model()
    name = served_name(config.model, config.served_model_name)
    gateway = Gateway(config, load_tokenizer(path), name, config.max_model_len or context_length(path),
                      RedisGatewayBroker(config.redis, config.engine_poll_s))
    runner = web.AppRunner(gateway.app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    log.info("gateway %s serving %r on http://%s:%d/v1", gateway.gateway_id, name, config.host, config.port)
    try:
        await _wait_for_signal()
    finally:
        await runner.cleanup()


async def _serve_worker(config: WorkerConfig) -> None:
    from engine import LLMEngine
    from service.broker import RedisWorkerBroker
    from service.worker import Worker

    engine = LLMEngine(config.engine)
    name = served_name(config.engine.model, config.served_model_name)
    broker = RedisWorkerBroker(config.redis, config.engine_id, name, config.reply_ttl_s, config.heartbeat_ttl_s)
    worker = Worker(config, engine, name, broker)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, worker.stop)
    await worker.run()


def _serve_all(args: argparse.Namespace) -> int:
    """A private redis-server on a unix socket, then a worker and a gateway process."""
    stack = LocalStack(env={env_name("--api-key"): ",".join(args.api_key)})
    stack.add_worker(_child_argv(args, "worker"))
    stack.add_gateway(_child_argv(args, "gateway"), args.host, args.port)
    try:
        with stack:
            return _supervise(stack)
    except RedisServerMissing:
        print(f"pagedserve: {_REDIS_HELP}", file=sys.stderr)
        return 1


_NOT_FORWARDED = {"redis_url", "api_key"}  # API keys travel in the environment, not on a visible command line


def _child_argv(args: argparse.Namespace, command: str) -> list[str]:
    """The flags given to ``serve`` that ``command`` knows; the child inherits the environment."""
    parser = argparse.ArgumentParser(add_help=False)
    for add in _LAYOUTS[command][1]:
        add(parser)
    return changed_flags(parser, {k: v for k, v in vars(args).items() if k not in _NOT_FORWARDED})


def _supervise(stack: LocalStack) -> int:
    """Waits until Ctrl-C / SIGTERM or until any child exits."""
    stopping = False

    def on_signal(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stopping:
        if (child := stack.exited()) is not None:
            print(f"pagedserve: the {child.role} process exited with {child.returncode}; stopping the others",
                  file=sys.stderr)
            return 1
        time.sleep(0.2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
