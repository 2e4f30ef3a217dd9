"""The vision tower's share of a step (vLLM's encoder budget): the placeholder rows of images a step must encode
(not in the encoder cache) are at most ``limit``; a prefill chunk that would pass it ends before the image that
does, which waits for the next step. An image larger than the whole budget runs in a step of its own."""
from __future__ import annotations

from engine.multimodal.encoder_cache import EncoderCache
from engine.sequence import SequenceGroup


class EncoderBudget:
    """``whole_images``: a chunk never ends inside an image (Gemma 3's attend to themselves both ways)."""

    def __init__(self, limit: int, cache: EncoderCache, whole_images: bool = False) -> None:
        self.limit, self.cache, self.whole_images = limit, cache, whole_images
        self.left = limit
        self._counted: set[bytes] = set()  # images this step encodes already

    def new_step(self) -> None:
        self.left = self.limit
        self._counted.clear()

    def clip(self, group: SequenceGroup, start: int, num_new: int) -> int:
        """``num_new`` tokens from ``start``, or fewer: up to the first image to encode that the budget left
        cannot take (charged for the ones it can)."""
        mm = group.multimodal
        if mm is None:
            return num_new
        for image in mm.images_in(start, start + num_new):
            if self.whole_images and image.offset + image.length > start + num_new:
                return max(image.offset - start, 0)  # the next chunk takes it whole
            digest = image.content_hash
            if digest in self.cache.entries or digest in self._counted:
                continue
            if image.length > self.left and self.left < self.limit:
                return max(image.offset - start, 0)
            self.left -= image.length
            self._counted.add(digest)
        return num_new
