"""Container health probe for every pagedserve role; exit 0 when healthy, 1 when not.

    python healthcheck.py            the role of this container's main process (PID 1)
    python healthcheck.py --http     gateway / serve: GET /health on PAGEDSERVE_PORT
    python healthcheck.py --worker   worker (no HTTP port): its heartbeat key in Redis is live

The Redis URL may name a Sentinel set or a Redis Cluster (redis+sentinel://, redis+cluster://).
A worker's heartbeat key expires a few seconds after its engine loop stops beating, so the
probe catches a hung engine, not just a dead process. The engine id is PAGEDSERVE_ENGINE_ID,
or else any engine registered under this hostname (the worker's default id is hostname-pid).
"""
import os
import socket
import sys
import urllib.request


def http_ok() -> bool:
    url = f"http://127.0.0.1:{os.environ.get('PAGEDSERVE_PORT', '8000')}/health"
    with urllib.request.urlopen(url, timeout=4) as response:
        return response.status == 200


def engines_key(prefix: str) -> str:
    # The key layout of service/redis_keys.py (its Keys class); importing service would pull in torch,
    # seconds per probe, so .ci/checks asserts that these two functions agree with it.
    return f"{prefix}:engines"


def engine_key(prefix: str, engine_id: str) -> str:
    return f"{prefix}:engine:{engine_id}"


# RedisConfig's account and TLS options, as the worker reads them from its environment.
REDIS_OPTION_ENV = {"username": "PAGEDSERVE_REDIS_USERNAME", "password": "PAGEDSERVE_REDIS_PASSWORD",
                    "ssl_ca_certs": "PAGEDSERVE_REDIS_SSL_CA", "ssl_certfile": "PAGEDSERVE_REDIS_SSL_CERT",
                    "ssl_keyfile": "PAGEDSERVE_REDIS_SSL_KEY"}
SENTINEL_PASSWORD_ENV = "PAGEDSERVE_REDIS_SENTINEL_PASSWORD"  # the Sentinels' own (RedisConfig.sentinel_password)


def redis_client(url: str, **options):
    """The worker's Redis: a Sentinel set's primary or a Cluster read with the worker's own URL reader
    (service.redis_url imports no torch)."""
    import redis

    if not url.startswith(("redis+sentinel://", "redis+cluster://")):
        return redis.Redis.from_url(url, **options)
    from redis.cluster import ClusterNode, RedisCluster
    from redis.sentinel import Sentinel
    from service.redis_url import read_nodes

    nodes = read_nodes(url)
    options |= {k: v for k, v in (("username", nodes.username), ("password", nodes.password)) if v}
    if nodes.kind == "cluster":
        return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in nodes.hosts], **options)
    password = os.environ.get(SENTINEL_PASSWORD_ENV)
    sentinels = Sentinel(nodes.hosts, sentinel_kwargs={"socket_timeout": 4, **({"password": password} if password
                                                                                else {})})
    return sentinels.master_for(nodes.service, db=nodes.db, **options)


def worker_ok() -> bool:
    prefix = os.environ.get("PAGEDSERVE_REDIS_PREFIX", "pagedserve")
    options = {name: os.environ[env] for name, env in REDIS_OPTION_ENV.items() if os.environ.get(env)}
    client = redis_client(os.environ.get("PAGEDSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"),
                          socket_timeout=4, socket_connect_timeout=4, **options)
    engine_id = os.environ.get("PAGEDSERVE_ENGINE_ID")
    if engine_id:
        candidates = [engine_id]
    else:
        mine = f"{socket.gethostname()}-"
        candidates = [m.decode() for m in client.smembers(engines_key(prefix)) if m.decode().startswith(mine)]
    return any(client.exists(engine_key(prefix, c)) for c in candidates)


def main_process_role() -> str:
    try:
        with open("/proc/1/cmdline", "rb") as f:
            args = f.read().decode(errors="replace").split("\0")
    except OSError:
        return "http"
    return "worker" if "worker" in args else "http"


def main() -> int:
    role = sys.argv[1].lstrip("-") if len(sys.argv) > 1 else main_process_role()
    if role not in ("http", "worker"):
        print(f"usage: {sys.argv[0]} [--http | --worker]", file=sys.stderr)
        return 2
    try:
        healthy = worker_ok() if role == "worker" else http_ok()
    except Exception as error:  # any failure to check is "unhealthy", with the reason logged
        print(f"healthcheck ({role}): {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if not healthy:
        print(f"healthcheck ({role}): no live heartbeat" if role == "worker" else "healthcheck: not healthy",
              file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
