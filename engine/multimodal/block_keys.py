"""Prefix-cache keys of a request with images: a block's key joins the content hashes of the images whose
placeholder tokens it holds (vLLM's ``extra_keys``), so the same text with another image never shares KV while
the same image after the same prefix does."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ImageBlockKeys:
    """Stands in a request's ``cache_salt``; ``key`` gives each block's extra key (engine/core/prefix_hash.py)."""

    Spans = tuple[tuple[int, int, bytes], ...]  # (offset, length, content hash) of each image, in prompt order

    salt: bytes | None
    spans: Spans

    def key(self, start: int, end: int) -> bytes | None:
        """The extra key of the block of tokens ``start`` to ``end``: the salt, then each image it shows (with
        where the image starts, so one image at two places keys two ways)."""
        shown = [offset.to_bytes(8, "little") + digest for offset, length, digest in self.spans
                 if offset < end and offset + length > start]
        if not shown:
            return self.salt
        salt = self.salt or b""
        return b"".join([b"img", len(salt).to_bytes(4, "little"), salt, *shown])  # the salt length-prefixed


def image_block_ids(spans: ImageBlockKeys.Spans, blocks: list[int], block_size: int) -> list[int]:
    """Of a request's blocks (its first sequence's table first, as the KV snapshot lists them), those its images'
    placeholder tokens fill (the dashboard marks them)."""
    shown = {j for offset, length, _ in spans for j in range(offset // block_size, (offset + length - 1)
                                                                 // block_size + 1)}
    return [block for j, block in enumerate(blocks) if j in shown]
