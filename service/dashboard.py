"""The gateway's KV dashboard: the static page (``service/static``, no build step, nothing fetched from
elsewhere) and the JSON the page polls, an engine's latest KV snapshot read through the broker.

The snapshot's per-block arrays travel as base64 of their little-endian bytes
(``service.messages.POOL_ARRAYS``; each request's block ids as ``<u4``): the page views them as typed
arrays, with no per-block JSON objects to build or parse.
"""
from __future__ import annotations

import base64
import logging
from dataclasses import asdict
from importlib.resources import files
from typing import Any

from service.messages import KVSnapshotMsg, SchemaError, decode_kv_snapshot

log = logging.getLogger(__name__)

# URL path -> (file under service/static, content type). Public: the page holds no data, it asks for a key.
PAGES = {
    "/dashboard": ("dashboard.html", "text/html"),
    "/dashboard/dashboard.js": ("dashboard.js", "text/javascript"),
    "/dashboard/dashboard.css": ("dashboard.css", "text/css"),
}
# Everything the page loads comes from this gateway; the snapshot route is fetched with the key.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
                "Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def page(path: str) -> tuple[bytes, str]:
    name, content_type = PAGES[path]
    return files("service").joinpath("static", name).read_bytes(), content_type


def snapshot_json(payload: bytes | None, now: float, viewer: str | None) -> dict[str, Any] | None:
    """The snapshot as the page reads it; None when the engine has published none yet (or another
    release's, unreadable here). Requests of tenants other than ``viewer`` show as anonymous blocks (id "");
    ``viewer`` None (an admin key) sees every id."""
    if payload is None:
        return None
    try:
        msg = decode_kv_snapshot(payload)
    except SchemaError as exc:
        log.warning("unreadable KV snapshot: %s", exc)
        return None
    return _as_json(msg, now, viewer)


def _as_json(msg: KVSnapshotMsg, now: float, viewer: str | None) -> dict[str, Any]:
    return {"engine_id": msg.engine_id, "model": msg.model, "time": msg.time, "age_s": max(0.0, now - msg.time),
            "block_size": msg.block_size, "device": _pool_json(msg.device), "cpu": _pool_json(msg.cpu),
            "requests": [{"id": request_id if viewer is None or tenant == viewer else "", "state": state,
                          "num_seqs": num_seqs, "blocks": _b64(blocks), "image_blocks": _b64(image_blocks)}
                         for request_id, state, num_seqs, blocks, tenant, image_blocks in msg.requests],
            "stats": asdict(msg.stats)}


def _pool_json(pool: dict[str, bytes]) -> dict[str, Any]:
    return {"num_blocks": len(pool["state"]), **{name: _b64(data) for name, data in pool.items()}}


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
