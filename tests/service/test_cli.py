"""The pagedserve command: env twins, flag mapping, and `serve` end to end."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from engine.config import EngineConfig
from service.cli import build_parser, gateway_config, main, worker_config
from service.flags import config_argv
from service.local_stack import free_port
from tests.service.conftest import ROOT, get_json


def test_env_twins_and_engine_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_MAX_NUM_SEQS", "7")
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "k1,k2")
    monkeypatch.setenv("PAGEDSERVE_NO_PREFIX_CACHING", "true")
    args = build_parser().parse_args(["worker", "--block-size", "32", "--kv-cache-memory-bytes", "1000000",
                                      "--preemption-mode", "swap"])
    engine = worker_config(args).engine
    assert (engine.max_num_seqs, engine.block_size, engine.kv_cache_memory_bytes) == (7, 32, 1_000_000)
    assert engine.preemption_mode == "swap" and engine.enable_prefix_caching is False
    assert gateway_config(build_parser().parse_args(["gateway"])).api_keys == ("k1", "k2")


def test_a_repeatable_flag_replaces_its_environment_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "k1,k2")
    args = build_parser().parse_args(["gateway", "--api-key", "k3", "--api-key", "k4"])
    assert gateway_config(args).api_keys == ("k3", "k4")  # the flag wins: the environment's keys are refused


def test_config_argv_rebuilds_the_config() -> None:
    config = EngineConfig(model="/m", block_size=32, num_device_blocks=64, kv_cache_memory_fraction=0.25,
                          max_model_len=512, enable_prefix_caching=False, preemption_mode="swap",
                          attention_backend="torch", seed=3, num_threads=2, show_progress=False)
    argv = config_argv(config)
    assert "--no-prefix-caching" in argv and "--no-chunked-prefill" not in argv and "--max-num-seqs" not in argv
    assert worker_config(build_parser().parse_args(["worker", *argv])).engine == config


def test_missing_redis_server_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["serve"]) == 1
    assert "apt-get install" in capsys.readouterr().err


def test_serve_starts_everything_and_ctrl_c_stops_it(demo_model: str) -> None:
    port = free_port()
    serve = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--model", demo_model, "--port",
                              str(port), "--num-device-blocks", "32", "--attention-backend", "torch",
                              "--num-threads", "1", "--log-level", "WARNING"], cwd=ROOT,
                             env={**os.environ, "PAGEDSERVE_API_KEY": ""})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert serve.poll() is None and time.monotonic() < deadline
            try:
                if get_json(f"http://127.0.0.1:{port}/ready", api_key=None)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.3)
        children = subprocess.run(["pgrep", "-P", str(serve.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 3  # redis-server, worker, gateway
        serve.send_signal(signal.SIGINT)
        assert serve.wait(timeout=30) == 0
        assert all(not os.path.exists(f"/proc/{pid}") for pid in children)
    finally:
        if serve.poll() is None:
            serve.kill()
