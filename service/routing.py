"""Prefix-aware routing: send a request to the engine that already holds the longest part of its prompt.

Each engine publishes the (truncated) hashes of the blocks its prefix cache holds; the gateway hashes the
prompt's full blocks exactly as the engine's prefix cache does (``engine.core.prefix_hash``: chained from the
first block, keyed by the request's cache salt, so tenant isolation holds across engines), asks each live
engine's set which of them it has, and routes to the engine with the longest run of leading hits among those
whose load (requests running or waiting) is within ``slack`` requests of the least loaded one. No hit, or only
on engines too busy: the request goes to the shared stream, which every engine pulls (``None``).

An engine publishes its summary with its heartbeat, but a conversation's next turn often comes sooner: the
gateway also remembers, for a while, which engine took each prompt it submitted (``RecentPrefixes``), and
counts those blocks as that engine's until its summary speaks for them.
"""
from __future__ import annotations

import time
from collections import OrderedDict

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


def choose_engine(hit_tokens: dict[str, int], loads: dict[str, int], slack: int) -> str | None:
    """The engine to route to: the most cached tokens among engines whose load is at most ``slack`` above the
    least loaded one's (ties: the lighter load, then the id); None for the shared stream."""
    if not loads:
        return None
    lightest = min(loads.values())
    candidates = [e for e, hits in hit_tokens.items() if hits > 0 and loads.get(e, lightest) <= lightest + slack]
    if not candidates:
        return None
    return min(candidates, key=lambda e: (-hit_tokens[e], loads.get(e, lightest), e))


class RecentPrefixes:
    """Block key -> (engine, when) for the prompts this gateway saw an engine take, the latest ``capacity``
    keys. An entry is believed for ``ttl_s`` only: by then the engine's own summary says whether it still
    holds the block (it may have evicted it)."""

    def __init__(self, capacity: int, ttl_s: float) -> None:
        self.capacity, self.ttl_s = capacity, ttl_s
        self._taken: OrderedDict[bytes, tuple[str, float]] = OrderedDict()

    def record(self, keys: list[bytes], engine_id: str) -> None:
        now = time.monotonic()
        for key in keys:
            self._taken[key] = (engine_id, now)
            self._taken.move_to_end(key)
        while len(self._taken) > self.capacity:
            self._taken.popitem(last=False)

    def holds(self, keys: list[bytes], engine_id: str) -> list[bool]:
        """Per key, whether ``engine_id`` took it within ``ttl_s``."""
        oldest = time.monotonic() - self.ttl_s
        found = []
        for key in keys:
            taken = self._taken.get(key)
            found.append(taken is not None and taken[0] == engine_id and taken[1] >= oldest)
        return found
