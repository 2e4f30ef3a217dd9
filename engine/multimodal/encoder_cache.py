"""Image embeddings by content hash, so an image repeated (in one request, across requests, after a preemption
or between the chunks of a prefill) runs the vision tower once while it stays cached."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from engine.multimodal.inputs import ImageInput, ImagePatches


class EncoderCache:
    """Holds up to ``capacity`` embedding rows, least recently used dropped first; the images one call needs stay
    even past it. ``encode`` runs the vision tower on a list of images, in one batch."""

    def __init__(self, encode: Callable[[list[ImagePatches]], list[torch.Tensor]], capacity: int) -> None:
        self.encode, self.capacity = encode, capacity
        self.entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.rows = 0
        self.hits = 0  # images served from the cache
        self.misses = 0  # images encoded

    def get(self, images: list[ImageInput]) -> dict[bytes, torch.Tensor]:
        """Each image's embeddings [rows, hidden], by content hash; the missing ones encoded together."""
        missing = list({i.content_hash: i for i in images if i.content_hash not in self.entries}.values())
        self.hits += len({i.content_hash for i in images}) - len(missing)
        if missing:
            self.misses += len(missing)
            for image, embeds in zip(missing, self.encode([i.patches for i in missing])):
                self.entries[image.content_hash] = embeds
                self.rows += embeds.shape[0]
        found = {}
        for image in images:
            self.entries.move_to_end(image.content_hash)
            found[image.content_hash] = self.entries[image.content_hash]
        self._evict(keep=found)
        return found

    def _evict(self, keep: dict[bytes, torch.Tensor]) -> None:
        for digest in list(self.entries):
            if self.rows <= self.capacity:
                return
            if digest not in keep:
                self.rows -= self.entries.pop(digest).shape[0]
