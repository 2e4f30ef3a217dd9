"""The URL of a Sentinel set or of a Redis Cluster, read (``RedisConfig.nodes``). Imports nothing heavy:
the container probe (docker/healthcheck.py) reads the worker's URL with it too."""
from __future__ import annotations

import urllib.parse
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RedisNodes:
    """A Sentinel set's or a Redis Cluster's URL, read."""

    kind: str  # "sentinel" or "cluster"
    hosts: tuple[tuple[str, int], ...]  # the Sentinels, or the Cluster's startup nodes
    service: str = ""  # the primary's name at the Sentinels
    db: int = 0
    username: str | None = None  # the data's credentials, as in a redis:// URL
    password: str | None = None


def read_nodes(url: str) -> RedisNodes | None:
    """The hosts of a ``redis+sentinel://`` or ``redis+cluster://`` URL; None for a single server's URL."""
    scheme, sep, rest = url.partition("://")
    kind = {"redis+sentinel": "sentinel", "redis+cluster": "cluster"}.get(scheme)
    return _read(kind, rest) if sep and kind else None


def _read(kind: str, rest: str) -> RedisNodes:
    """``[user:pass@]host:port[,host:port...][/SERVICE[/db]]`` (the service: Sentinel only, which needs one)."""
    credentials, _, rest = rest.rpartition("@")
    hosts, _, path = rest.partition("/")
    parts = [p for p in path.split("/") if p]
    username, _, password = credentials.partition(":") if credentials else ("", "", "")
    try:
        nodes = tuple((host, int(port)) for host, _, port in (h.rpartition(":") for h in hosts.split(",")))
        db = int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        raise ValueError(f"a {kind} URL lists host:port pairs, comma-separated") from None
    if not nodes or any(not host for host, _ in nodes) or len(parts) > 2:
        raise ValueError(f"malformed {kind} URL: expected redis+{kind}://host:port[,host:port...]"
                         + ("/SERVICE[/db]" if kind == "sentinel" else ""))
    if (kind == "sentinel") != bool(parts):
        raise ValueError("a redis+sentinel:// URL ends with /SERVICE, the primary's name at the Sentinels; "
                         "a redis+cluster:// URL has no path")
    return RedisNodes(kind=kind, hosts=nodes, service=parts[0] if parts else "", db=db,
                      username=urllib.parse.unquote(username) or None, password=urllib.parse.unquote(password) or None)
