"""Qwen3-VL through the paged engine == transformers fp32 greedy, token for token: its tower's resampled position
embeddings and DeepStack rows (cached with the main embeddings, spliced chunk by chunk), interleaved M-RoPE, and
prefix caching keyed by the images' hashes."""
from __future__ import annotations

import pytest
import torch
import transformers

from engine.distributed.parallel_state import TensorParallel
from engine.models.config import read_model_config
from engine.models.qwen3_vl import Qwen3VLForConditionalGeneration
from engine.multimodal.mrope import mrope_sections
from engine.multimodal.processor import ImageProcessor, expand_image_tokens
from .conftest import backends
from .test_qwen2_5_vl import SCENARIOS as QWEN2_5_SCENARIOS
from .test_qwen2_5_vl import built, check_greedy, check_prefix_keys, generate, hf_reference, make_llm, vl_prompts
from loadtest.vl_checkpoint import IMAGE, qwen3_vl_config

# Qwen2.5-VL's test prompts and scenarios (tests/engine/test_qwen2_5_vl.py), the images twice as large for
# 16-pixel patches; in "chunked" an image's main and DeepStack rows reach the step in pieces.
PROMPTS = vl_prompts(scale=2)
SCENARIOS = {name: QWEN2_5_SCENARIOS[name] for name in ("plain", "recompute", "chunked", "prefix")}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return built(tmp_path_factory, "qwen3_vl", qwen3_vl_config())


@pytest.fixture(scope="module")
def reference(vl) -> list[list[int]]:
    return hf_reference(vl, PROMPTS)


def test_checkpoint_preprocesses_with_16_pixel_patches(vl):
    processor = transformers.AutoImageProcessor.from_pretrained(vl[0])
    assert isinstance(processor, transformers.Qwen2VLImageProcessorPil) and processor.patch_size == 16


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_matches_transformers(vl, reference, scenario, backend):
    check_greedy(vl[0], backend, scenario, SCENARIOS[scenario], PROMPTS, reference)


def test_prefix_cache_keys_blocks_by_their_images(vl, reference):
    check_prefix_keys(vl[0], PROMPTS, reference)


def test_encoded_rows_carry_the_deepstack_levels(vl):
    """Each cached image row holds the main embedding and one per DeepStack layer, side by side."""
    llm = make_llm(vl[0], enable_prefix_caching=False)
    generate(llm, PROMPTS[:1])
    [rows] = llm.engine.runner.images.cache.entries.values()
    assert tuple(rows.shape) == (20, 128 * 3)


def test_interleaved_mrope_sections():
    """transformers' Qwen3-VL layout: height on pairs 1, 4, .. below 3 x 10, width on 2, 5, .., temporal the rest;
    Qwen2.5-VL's runs of the same sections for contrast."""
    hf = {"rope_parameters": {"mrope_section": [12, 10, 10]}}
    interleaved = mrope_sections(hf, 64, "cpu", interleaved=True).tolist()
    assert interleaved[:6] == [0, 1, 2, 0, 1, 2] and interleaved[27:] == [0, 1, 2, 0, 0]
    assert [interleaved.count(axis) for axis in range(3)] == [12, 10, 10]
    assert mrope_sections(hf, 64, "cpu").tolist() == [0] * 12 + [1] * 10 + [2] * 10


def test_tensor_parallel_is_refused(vl):
    cfg = read_model_config(vl[0])
    with pytest.raises(ValueError, match="tensor parallelism is not supported for vision-language models"):
        Qwen3VLForConditionalGeneration(cfg, torch.device("cpu"), torch.float32, TensorParallel(rank=0, size=2))


def test_tower_and_positions_equal_transformers(vl):
    """The tower's rows (main and DeepStack) and the prompt's 3-D positions, against transformers' own
    ``get_image_features`` and ``get_rope_index``, on two images of other grids than the learned 4 x 4."""
    path, model = vl
    llm = make_llm(path, enable_prefix_caching=False)
    text, images = PROMPTS[2]
    patches = ImageProcessor(path)(images)
    ids = expand_image_tokens(llm.tokenizer(text).input_ids, patches, llm.engine.images.spec)
    pixels, grids = torch.cat([p.pixel_values for p in patches]), torch.tensor([p.grid_thw for p in patches])
    hf = model.model.get_image_features(pixels, grids)
    expected = [torch.cat([main, *levels], dim=-1)
                for main, *levels in zip(hf.pooler_output, *hf.deepstack_features)]
    got = llm.engine.runner.model.encode_images(patches)
    assert all(torch.allclose(g, e, rtol=1e-4, atol=1e-4) for g, e in zip(got, expected, strict=True))
    multimodal, _ = llm.engine.images.inputs(ids, patches, None)
    input_ids = torch.tensor([ids])
    positions, delta = model.model.get_rope_index(input_ids, (input_ids == IMAGE).int(), grids)
    assert torch.equal(multimodal.positions, positions[:, 0]) and multimodal.delta == int(delta)
