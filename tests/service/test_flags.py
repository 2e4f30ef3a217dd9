"""Each command's flags are its configs' fields, and ``serve`` hands them on to its children."""
from __future__ import annotations

import argparse
import os
from dataclasses import fields

import pytest

from engine.config import EngineConfig
from service.cli import _PRIVATE_REDIS, _child_argv, build_parser, gateway_config, worker_config
from service.config import GatewayConfig, RedisConfig, WorkerConfig
from service.flags import config_argv, flag_name, secret_env

CONFIGS = {"gateway": [RedisConfig, GatewayConfig], "worker": [RedisConfig, EngineConfig, WorkerConfig],
           "serve": [GatewayConfig, EngineConfig, WorkerConfig]}  # serve's Redis is its own: no --redis-url
# The flags written by hand before they were derived: scripts and manifests use them.
GATEWAY = {"--host", "--port", "--api-key", "--cors-origin", "--max-body-bytes", "--max-pending-requests", "--max-n",
           "--max-stop-strings", "--max-logprobs"}
WORKER = {"--engine-id", "--heartbeat-interval", "--heartbeat-ttl", "--reply-ttl", "--max-pull"}
SHARED = {"--redis-prefix", "--redis-block-ms", "--model", "--max-model-len", "--served-model-name", "--log-level"}
KNOWN = {"gateway": SHARED | GATEWAY | {"--redis-url"}, "worker": SHARED | WORKER | {"--redis-url"},
         "serve": SHARED | GATEWAY | WORKER}


@pytest.fixture(autouse=True)
def no_env_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(name)


def subparser(command: str) -> argparse.ArgumentParser:
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]


@pytest.mark.parametrize("command", CONFIGS)
def test_every_option_is_a_flag_with_its_fields_default(command: str) -> None:
    actions = {a.dest: a for a in subparser(command)._actions}
    for cls in CONFIGS[command]:
        for f in (f for f in fields(cls) if "help" in f.metadata):
            action = actions[f.name]
            assert flag_name(f) in action.option_strings and f.metadata["help"] in action.help
            assert action.default == (list(f.default) if isinstance(f.default, tuple) else f.default), f.name
    flags = {s for a in actions.values() for s in a.option_strings}
    assert KNOWN[command] <= flags and ("--redis-url" in flags) == (command != "serve")


def test_no_flags_give_the_default_configs() -> None:
    assert gateway_config(build_parser().parse_args(["gateway"])) == GatewayConfig()
    engine = EngineConfig(show_progress=False)
    assert worker_config(build_parser().parse_args(["worker"])) == WorkerConfig(engine=engine)


def test_shared_options_are_declared_once() -> None:
    gateway = {f.name: f for f in fields(GatewayConfig)}
    for cls in (EngineConfig, WorkerConfig):
        for f in fields(cls):
            if f.name in gateway and "help" in f.metadata:
                assert gateway[f.name].metadata == f.metadata and gateway[f.name].default == f.default
    with pytest.raises(ValueError, match="max_model_len"):  # one bound for gateway and engine
        GatewayConfig(max_model_len=0)
    assert GatewayConfig(max_model_len=1).max_model_len == EngineConfig(max_model_len=1).max_model_len


@pytest.mark.parametrize("command", ["gateway", "worker"])
def test_serve_hands_its_flags_to_its_children(command: str, monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args([
        "serve", "--redis-prefix", "p", "--redis-block-ms", "50", "--model", "/m", "--max-model-len", "64",
        "--served-model-name", "x", "--port", "9", "--api-key", "k1", "--api-key", "k2", "--cors-origin", "*",
        "--max-n", "3", "--max-stop-string-len", "7", "--engine-poll", "0.1", "--retry-after", "4",
        "--block-size", "32", "--no-prefix-caching", "--engine-id", "e", "--heartbeat-interval", "0.2",
        "--reply-ttl", "9", "--max-pull", "2", "--log-level", "DEBUG"])
    argv = _child_argv(args, command)
    assert "--api-key" not in argv and "k1" not in argv  # secrets travel in the environment
    env = secret_env([("gateway", GatewayConfig)], args)
    assert env == {"PAGEDSERVE_API_KEY": "k1,k2"}
    monkeypatch.setenv("PAGEDSERVE_API_KEY", env["PAGEDSERVE_API_KEY"])
    child = vars(build_parser().parse_args([command, *argv]))
    for name in (*_PRIVATE_REDIS, "command"):
        child.pop(name)
    assert child == {name: getattr(args, name) for name in child}
    config = gateway_config if command == "gateway" else worker_config
    assert config(build_parser().parse_args([command, *argv])).redis == RedisConfig(prefix="p", block_ms=50)


def test_config_argv_leaves_out_defaults_and_secrets() -> None:
    assert config_argv(GatewayConfig(api_keys=("k",), max_n=3, cors_origins=("a", "b"))) == [
        "--cors-origin", "a", "--cors-origin", "b", "--max-n", "3"]
    worker = WorkerConfig(engine_id="e", heartbeat_ttl_s=5.0)
    assert config_argv(worker) == ["--engine-id", "e", "--heartbeat-ttl", "5.0"]
