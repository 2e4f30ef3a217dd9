"""A prompt's images as the engine keeps them: each image's patches, content hash and placeholder span, and the
prompt's M-RoPE positions (Qwen2.5-VL's temporal / height / width rows; Gemma 3's three rows are its plain ones)."""
from __future__ import annotations

from dataclasses import dataclass
from hashlib import blake2b

import torch

from engine.multimodal.block_keys import ImageBlockKeys
from engine.multimodal.config import VisionSpec


@dataclass(frozen=True, slots=True)
class ImagePatches:
    """One preprocessed image as the checkpoint's image processor gives it."""

    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch] fp32
    grid_thw: tuple[int, int, int]  # patches along time, height, width (Gemma 3: a patch is a pixel, channels last)


@dataclass(frozen=True, slots=True)
class ImageInput:
    """An image of one prompt: its patches, what keys it, where its placeholder tokens sit."""

    patches: ImagePatches
    content_hash: bytes  # of its patches and grid: the encoder cache's key, and part of its KV blocks' keys
    offset: int  # the prompt index of its first placeholder token
    length: int  # its placeholder tokens, one per embedding row


@dataclass(frozen=True, slots=True)
class MultiModalInputs:
    """A request's images and M-RoPE positions; a token past the prompt sits at its index + ``delta``."""

    images: tuple[ImageInput, ...]
    positions: torch.Tensor  # [3, prompt tokens] int64
    delta: int

    def positions_of(self, start: int, end: int) -> torch.Tensor:
        """[3, end - start] positions of tokens ``start`` to ``end``: the prompt's, then index + delta."""
        prompt = self.positions.shape[1]
        inside = self.positions[:, start:min(end, prompt)]
        if end <= prompt:
            return inside
        after = torch.arange(max(start, prompt), end, dtype=torch.int64) + self.delta
        return torch.cat((inside, after.expand(3, -1)), dim=1)

    def images_in(self, start: int, end: int) -> list[ImageInput]:
        return [image for image in self.images if image.offset < end and image.offset + image.length > start]


def content_hash(patches: ImagePatches) -> bytes:
    h = blake2b(digest_size=32)
    h.update(repr(patches.grid_thw).encode())
    h.update(patches.pixel_values.to(torch.float32).contiguous().numpy().tobytes())
    return h.digest()


def build_inputs(prompt: list[int], images: list[ImagePatches], spec: VisionSpec
                 ) -> tuple[MultiModalInputs, ImageBlockKeys.Spans]:
    """The images placed at the prompt's placeholder runs, in order, each run as long as its image's embedding;
    ValueError where the runs and the images disagree."""
    runs = _placeholder_runs(prompt, spec.image_token_id)
    if len(runs) != len(images):
        raise ValueError(f"the prompt has {len(runs)} image placeholder runs, the request {len(images)} images")
    placed = []
    for i, ((offset, length), patches) in enumerate(zip(runs, images)):
        _check_patches(i, patches, spec)
        if length != spec.rows(patches.grid_thw):
            raise ValueError(f"image {i}: {length} placeholder tokens in the prompt, its grid "
                             f"{patches.grid_thw} needs {spec.rows(patches.grid_thw)}")
        placed.append(ImageInput(patches, content_hash(patches), offset, length))
    if spec.wrap is None:
        positions, delta = mrope_positions(len(prompt), placed, spec.merge_size)
    else:  # Gemma 3: image tokens count on like text
        positions, delta = torch.arange(len(prompt), dtype=torch.int64).expand(3, -1), 0
    spans = tuple((image.offset, image.length, image.content_hash) for image in placed)
    return MultiModalInputs(tuple(placed), positions, delta), spans


def _check_patches(i: int, patches: ImagePatches, spec: VisionSpec) -> None:
    t, h, w = patches.grid_thw
    if min(t, h, w) <= 0 or h % spec.merge_size or w % spec.merge_size:
        raise ValueError(f"image {i}: grid_thw {patches.grid_thw} must be positive, height and width multiples "
                         f"of spatial_merge_size {spec.merge_size}")
    if spec.wrap is not None and patches.grid_thw != (1, spec.wrap.image_size, spec.wrap.image_size):
        raise ValueError(f"image {i}: grid_thw {patches.grid_thw}, the model takes (1, {spec.wrap.image_size}, "
                         f"{spec.wrap.image_size}) (one {spec.wrap.image_size}-pixel square)")
    if patches.pixel_values.dim() != 2 or patches.pixel_values.shape[0] != t * h * w:
        raise ValueError(f"image {i}: pixel_values of shape {tuple(patches.pixel_values.shape)}, its grid "
                         f"{patches.grid_thw} needs [{t * h * w}, patch features]")


def _placeholder_runs(prompt: list[int], token: int) -> list[tuple[int, int]]:
    """(offset, length) of each maximal run of ``token``."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(prompt):
        if t != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def mrope_positions(prompt_len: int, images: list[ImageInput], merge: int) -> tuple[torch.Tensor, int]:
    """transformers' ``get_rope_index`` for images: text counts on from the last position on all three rows; an
    image's tokens take (start + frame, start + row, start + column) over its merged grid, and the text after it
    starts max(rows, columns) on. Returns the [3, prompt_len] positions and the delta of later tokens."""
    pieces, pos, cursor = [], 0, 0
    for image in images:
        pieces.append(torch.arange(pos, pos + image.offset - cursor, dtype=torch.int64).expand(3, -1))
        pos += image.offset - cursor
        t, h, w = image.patches.grid_thw
        h, w = h // merge, w // merge
        axes = [torch.arange(n, dtype=torch.int64) for n in (t, h, w)]
        pieces.append(torch.stack(torch.meshgrid(*axes, indexing="ij")).reshape(3, -1) + pos)
        pos += max(h, w)
        cursor = image.offset + image.length
    pieces.append(torch.arange(pos, pos + prompt_len - cursor, dtype=torch.int64).expand(3, -1))
    positions = torch.cat(pieces, dim=1)
    return positions, int(positions.max()) + 1 - prompt_len
