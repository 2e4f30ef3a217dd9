"""Prefix-aware routing: send a request to the engine that already holds the longest part of its prompt.

Each engine publishes the (truncated) hashes of the blocks its prefix cache holds; the gateway hashes the
prompt's full blocks exactly as the engine's prefix cache does (``engine.core.prefix_hash``: chained from the
first block, keyed by the request's cache salt, so tenant isolation holds across engines), asks each live
engine's set which of them it has, and routes to the engine with the longest run of leading hits among those
whose queue is within ``slack`` requests of the shortest one. No hit, or only on engines too busy: the
request goes to the shared stream, which every engine pulls (``None``).
"""
from __future__ import annotations

from engine.core.prefix_hash import ROOT_HASH, hash_block

MAX_ROUTED_BLOCKS = 256  # a prompt's leading blocks looked up; past these, a hit changes no decision


def prompt_block_keys(token_ids: list[int], salt: str | None, block_size: int, key_bytes: int) -> list[bytes]:
    """The leading full blocks' hashes, truncated to ``key_bytes``, as the engine's prefix cache would look
    them up (never the block holding the last token: its logits must be computed)."""
    salt_bytes = salt.encode() if salt else None
    keys, parent = [], ROOT_HASH
    end = min((len(token_ids) - 1) // block_size, MAX_ROUTED_BLOCKS) * block_size
    for start in range(0, end, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], salt_bytes)
        keys.append(parent[:key_bytes])
    return keys


def leading_hits(found: list[int | bool]) -> int:
    """How many of the first blocks an engine holds, in a row (a prefix hit stops at the first miss)."""
    count = 0
    for hit in found:
        if not hit:
            break
        count += 1
    return count


def choose_engine(hit_tokens: dict[str, int], queued: dict[str, int], slack: int) -> str | None:
    """The engine to route to: the most cached tokens among engines whose queue is at most ``slack`` longer
    than the shortest (ties: the shorter queue, then the id); None for the shared stream."""
    if not queued:
        return None
    shortest = min(queued.values())
    candidates = [e for e, hits in hit_tokens.items() if hits > 0 and queued.get(e, shortest) <= shortest + slack]
    if not candidates:
        return None
    return min(candidates, key=lambda e: (-hit_tokens[e], queued.get(e, shortest), e))
