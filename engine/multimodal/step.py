"""A step's images, between the scheduler's plan and the forward pass: the M-RoPE positions of requests with
images, which embedding rows of which image each placeholder row of the step takes, and the encoder cache that
gives them (running the vision tower on the images it lacks)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.core.scheduler_output import ScheduledSeq
from engine.multimodal.encoder_cache import EncoderCache
from engine.multimodal.inputs import ImageInput, ImagePatches


@dataclass(frozen=True, slots=True)
class ImageSplice:
    """Embedding rows ``start`` to ``stop`` of ``image`` go to the step's rows from ``row`` on."""

    image: ImageInput
    start: int
    stop: int
    row: int


@dataclass(slots=True)
class StepImages:
    """The host side: a step holding placeholder rows (a chunk of a prompt with images)."""

    splices: list[ImageSplice]
    positions: torch.Tensor  # [3, step rows] M-RoPE positions


@dataclass(frozen=True, slots=True)
class ImageRows:
    """The device side, the model's ``images`` argument: ``embeds`` replace the token embeddings at ``rows``."""

    rows: torch.Tensor  # int64
    embeds: torch.Tensor  # [len(rows), hidden], or hidden x (1 + DeepStack levels) (Qwen3-VL)
    positions: torch.Tensor  # [3, step rows] int64
    spans: list[tuple[int, int]]  # each image's rows [start, end) in the step (Gemma 3 attends within them both ways)


class ImageStep:
    """The model runner's images: ``plan`` on the host, ``inputs`` on the device (engine/model_runner.py)."""

    def __init__(self, encode: Callable[[list[ImagePatches]], list[torch.Tensor]], cache_rows: int) -> None:
        self.cache = EncoderCache(encode, cache_rows)

    def plan(self, scheduled: list[ScheduledSeq], positions: torch.Tensor) -> StepImages | None:
        """Writes the M-RoPE position of each row of a request with images into ``positions`` (its text rows'
        three rows are equal, so the one position is exact); the splices and the 3-D positions where the step
        holds image rows, else None."""
        row, splices, spans = 0, [], []
        for s in scheduled:
            mm, n = s.group.multimodal, s.num_new_tokens
            if mm is not None and s.start >= mm.positions.shape[1]:  # past the prompt: index + delta
                positions[row:row + n] += mm.delta
            elif mm is not None:
                pos = mm.positions_of(s.start, s.start + n)
                positions[row:row + n] = pos[0]
                for image in mm.images_in(s.start, s.start + n):
                    first, last = max(s.start, image.offset), min(s.start + n, image.offset + image.length)
                    splices.append(ImageSplice(image, first - image.offset, last - image.offset,
                                               row + first - s.start))
                spans.append((row, pos))
            row += n
        if not splices:
            return None
        full = positions.expand(3, -1).clone()
        for first, pos in spans:
            full[:, first:first + pos.shape[1]] = pos
        return StepImages(splices, full)

    def inputs(self, step: StepImages, device: torch.device) -> ImageRows:
        """The splices' embeddings from the encoder cache (the vision tower runs on the images it lacks)."""
        embeds = self.cache.get([s.image for s in step.splices])
        spans = [(s.row, s.row + s.stop - s.start) for s in step.splices]
        rows = torch.cat([torch.arange(start, end) for start, end in spans])
        parts = [embeds[s.image.content_hash][s.start:s.stop] for s in step.splices]
        return ImageRows(rows.to(device), torch.cat(parts), step.positions.to(device), spans)
