"""The ``pagedserve`` command: serve | gateway | worker | chat | demo-model.

Every flag has an environment twin, PAGEDSERVE_<FLAG> (dashes as underscores);
the flag wins when both are given. Repeatable flags take a comma-separated list
from the environment. The flags are the fields of the configs each command runs
(EngineConfig, RedisConfig, GatewayConfig, WorkerConfig), derived in service/flags.py.

Exit codes: 0 when stopped (a worker drains first on SIGTERM), 2 for a bad option, 3 when a
worker's engine failed --max-failed-steps steps in a row (its supervisor restarts it).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
import time
from typing import Any

from engine.config import EngineConfig

from service import chat
from service.config import GatewayConfig, RedisConfig, WorkerConfig, require_auth, served_name
from service.flags import (Section, add_config_flags, add_flag, changed_flags, config_from_args, public_values,
                           secret_env)
from service.local_stack import LocalStack, RedisServerMissing

log = logging.getLogger("pagedserve")

_REDIS_HELP = ("redis-server was not found on PATH. Install it (Debian/Ubuntu: sudo apt-get install -y "
               "redis-server; macOS: brew install redis), or run 'pagedserve gateway' and 'pagedserve worker' "
               "against an existing Redis with --redis-url.")


_BROKER, _GATEWAY = ("broker", RedisConfig), ("gateway", GatewayConfig)
_ENGINE, _WORKER = ("engine", EngineConfig), ("worker", WorkerConfig)
# serve's own Redis is a private unix socket: no URL, account or TLS to give.
_PRIVATE_REDIS = {"url", "username", "password", "ssl_ca_certs", "ssl_certfile", "ssl_keyfile"}
# Each command: its help, the configs whose options it takes, and the options it leaves out.
_COMMANDS: dict[str, tuple[str, list[Section], set[str]]] = {
    "serve": ("run everything on this machine: a private redis-server, a worker and a gateway",
              [_BROKER, _GATEWAY, _ENGINE, _WORKER], _PRIVATE_REDIS),
    "gateway": ("run the OpenAI-compatible HTTP gateway against --redis-url", [_BROKER, _GATEWAY], set()),
    "worker": ("run one engine worker against --redis-url", [_BROKER, _ENGINE, _WORKER], set()),
}


def _add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    _, sections, without = _COMMANDS[command]
    add_config_flags(parser, sections, without)
    add_flag(parser, "--log-level", "logging level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (help, _, _) in _COMMANDS.items():
        _add_flags(sub.add_parser(name, help=help, description=help), name)
    demo = sub.add_parser("demo-model", help="write the demo checkpoint to PATH", description="write the demo "
                          "checkpoint (a small Llama trained on templated dialogues: sums, spelling, weekdays) to PATH")
    demo.add_argument("path", metavar="PATH")
    chat_help = "chat with a running server in the terminal (streaming, history, /reset)"
    chat_parser = sub.add_parser("chat", help=chat_help, description=f"{chat_help}: {chat.HELP}")
    chat.add_arguments(chat_parser)
    return parser


def gateway_config(args: argparse.Namespace) -> GatewayConfig:
    return config_from_args(GatewayConfig, args, redis=config_from_args(RedisConfig, args))


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    engine = config_from_args(EngineConfig, args, show_progress=False)  # a server shows no progress bar
    return config_from_args(WorkerConfig, args, redis=config_from_args(RedisConfig, args), engine=engine)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo-model":
        from engine.demo_model import write_demo_model
        print(write_demo_model(args.path))
        return 0
    if args.command == "chat":
        return chat.run(chat.session_from_args(args))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "gateway":
            _run_async(_serve_gateway(gateway_config(args)))
        elif args.command == "worker":
            return _run_async(_serve_worker(worker_config(args)))
        else:
            return _serve_all(args)
    except ValueError as exc:
        print(f"pagedserve: {exc}", file=sys.stderr)
        return 2
    return 0


def _run_async(coro: Any) -> Any:
    import uvloop
    return uvloop.run(coro)


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
    from engine.pooler_config import PoolerConfig
    from service.connections import GuardedAppRunner
    from service.gateway import Gateway
    from service.gateway_app import build_app
    from service.redis_gateway import RedisGatewayBroker
    from service.tokenization import load_tokenizer

    path = config.model or ensure_demo_model()
    name = served_name(config.model, config.served_model_name)
    gateway = Gateway(config=config, tokenizer=load_tokenizer(path), model_name=name,
                      max_model_len=config.max_model_len or context_length(path), broker=RedisGatewayBroker(config),
                      pooler=PoolerConfig.from_model_dir(path))
    runner = GuardedAppRunner(build_app(gateway), config, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    log.info("gateway %s serving %r on http://%s:%d/v1", gateway.gateway_id, name, config.host, config.port)
    try:
        await _wait_for_signal()
    finally:
        await runner.cleanup()


async def _serve_worker(config: WorkerConfig) -> int:
    from engine import LLMEngine
    from service.redis_worker import RedisWorkerBroker
    from service.worker import Worker, tune_gc

    engine = LLMEngine(config.engine)
    tune_gc()
    name = served_name(config.engine.model, config.served_model_name)
    broker = RedisWorkerBroker(config.redis, config.engine_id, name, config.reply_ttl_s, config.heartbeat_ttl_s,
                               config.steal_after_s)
    worker = Worker(config, engine, name, broker)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, worker.stop)
    return await worker.run()


def _serve_all(args: argparse.Namespace) -> int:
    """A private redis-server on a unix socket, then a worker and a gateway process."""
    keys = (*args.api_keys, *args.admin_keys)
    require_auth(args.host, keys, args.insecure_no_auth)  # before starting anything
    stack = LocalStack(env=secret_env(_COMMANDS["serve"][1], args))
    stack.add_worker(_child_argv(args, "worker"))
    stack.add_gateway(_child_argv(args, "gateway"), args.host, args.port)
    try:
        with stack:
            return _supervise(stack)
    except RedisServerMissing:
        print(f"pagedserve: {_REDIS_HELP}", file=sys.stderr)
        return 1


def _child_argv(args: argparse.Namespace, command: str) -> list[str]:
    """The flags given to ``serve`` that ``command`` knows, but secrets: the child inherits them in its environment."""
    parser = argparse.ArgumentParser(add_help=False)
    _add_flags(parser, command)
    return changed_flags(parser, public_values(_COMMANDS[command][1], args))


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
