"""Auth fails closed: a gateway reachable from other machines needs API keys, unless told otherwise."""
from __future__ import annotations

import os

import pytest

from service.cli import _child_argv, build_parser, gateway_config, main
from service.config import GatewayConfig, RedisConfig


@pytest.fixture(autouse=True)
def no_env_twins(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(name)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.1.2.3", "gateway.example.com"])
def test_a_non_loopback_bind_without_keys_is_refused(host: str) -> None:
    with pytest.raises(ValueError, match="--insecure-no-auth"):
        GatewayConfig(host=host)
    assert GatewayConfig(host=host, api_keys=("k",)).host == host
    assert GatewayConfig(host=host, insecure_no_auth=True).host == host


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_needs_no_keys(host: str) -> None:
    assert GatewayConfig(host=host).api_keys == ()


def test_gateway_command_exits_with_the_reason(capsys: pytest.CaptureFixture) -> None:
    assert main(["gateway", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert "without API keys" in err and "--insecure-no-auth" in err


def test_serve_refuses_before_starting_anything(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    # Without redis-server on PATH, serve would exit 1 once it tried to start Redis: 2 means it never got there.
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "--insecure-no-auth" in capsys.readouterr().err
    assert main(["serve", "--host", "0.0.0.0", "--insecure-no-auth"]) == 1  # on to Redis, which is missing


def test_the_image_default_host_needs_a_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_HOST", "0.0.0.0")  # as the Docker images set it
    with pytest.raises(ValueError, match="without API keys"):
        gateway_config(build_parser().parse_args(["gateway"]))
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "k")
    assert gateway_config(build_parser().parse_args(["gateway"])).api_keys == ("k",)
    monkeypatch.delenv("PAGEDSERVE_API_KEY")
    monkeypatch.setenv("PAGEDSERVE_INSECURE_NO_AUTH", "true")
    assert gateway_config(build_parser().parse_args(["gateway"])).insecure_no_auth


def test_serve_hands_the_insecure_flag_to_its_gateway() -> None:
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--insecure-no-auth"])
    argv = _child_argv(args, "gateway")
    assert "--insecure-no-auth" in argv
    assert gateway_config(build_parser().parse_args(["gateway", *argv])).host == "0.0.0.0"


def test_redis_secrets_stay_out_of_the_repr_and_argv() -> None:
    config = RedisConfig(url="redis://u:hunter2@h:6379/0", username="acl-user", password="s3cret")
    assert "hunter2" not in repr(config) and "s3cret" not in repr(config) and "acl-user" in repr(config)
    args = build_parser().parse_args(["gateway", "--redis-username", "u", "--redis-password", "s3cret"])
    assert gateway_config(args).redis.connection_options() == {"username": "u", "password": "s3cret"}
    assert "s3cret" not in " ".join(_child_argv(args, "gateway"))


def test_tls_options_need_a_rediss_url() -> None:
    with pytest.raises(ValueError, match="rediss://"):
        RedisConfig(url="redis://h:6379/0", ssl_ca_certs="/ca.pem")
    assert RedisConfig(url="rediss://h:6380/0", ssl_ca_certs="/ca.pem").connection_options() == {
        "ssl_ca_certs": "/ca.pem"}
