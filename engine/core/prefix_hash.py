"""Chained content hash of one full KV block, for prefix caching.

H(parent_hash, extra keys, token ids) with blake2b: collision resistant (unlike
Python's ``hash``) and fast in hashlib. The parent's hash makes a block's key
depend on the whole prefix before it, so equal blocks after different prefixes
never match.
"""
from __future__ import annotations

from array import array
from hashlib import blake2b

ROOT_HASH = bytes(32)  # parent of a sequence's first block


def block_key(salt, start: int, end: int) -> bytes | None:
    """The extra key of the block of tokens ``start`` to ``end``: the request's salt, or for a request with images
    its ``ImageBlockKeys``' key for that block (engine/multimodal/block_keys.py)."""
    return salt if salt is None or isinstance(salt, bytes) else salt.key(start, end)


def hash_block(parent_hash: bytes, token_ids: list[int], extra_key: bytes | None = None) -> bytes:
    h = blake2b(parent_hash, digest_size=32)
    # Length-prefixed so (salt, tokens) pairs can never run into each other.
    salt = extra_key or b""
    h.update(len(salt).to_bytes(4, "little"))
    h.update(salt)
    h.update(array("q", token_ids).tobytes())
    return h.digest()
