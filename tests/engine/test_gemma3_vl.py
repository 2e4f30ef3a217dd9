"""Gemma 3 with images through the paged engine == transformers fp32 greedy, token for token: the SigLIP tower and
projector, its processor's placeholder wrap, an image's tokens attending to each other both ways (within and past
the sliding window), chunks that never split an image, and prefix caching keyed by the images' hashes."""
from __future__ import annotations

import pytest
import torch
import transformers

from engine import LLM
from engine.multimodal.inputs import ImagePatches
from engine.multimodal.processor import ImageProcessor, expand_image_tokens
from .conftest import backends, build_checkpoint
from .test_qwen2_5_vl import GREEDY, MAX_NEW, built, generate, hf_reference, make_llm
from loadtest.vl_checkpoint import (GEMMA_PLACEHOLDER as P, data_url, gemma3_vl_config,
                                    hf_vl_greedy, image)

TURN = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"
# (text, images): one image after a newline (the processor's "\n\n" joins it: one token of three); the same text with
# another image; two images back to back and a third of another size; text only; a long prefix first.
PROMPTS = [
    (TURN.format("Hi\n" + P + "what is in it?"), [image(1)]),
    (TURN.format("Hi\n" + P + "what is in it?"), [image(2)]),
    ("Compare " + P + P + " and " + P + "\n\nnow.", [image(3), image(1), image(4, 48, 96)]),
    ("Just text here, no image at all.", []),
    (TURN.format("A long question comes first, then the image: " + P + " describe"), [image(5)]),
]
SCENARIOS = {
    "plain": dict(enable_prefix_caching=False),
    # 5 prompts of 32 to 89 tokens + 12 new need 24 blocks of 16 at once: 8 force preemption.
    "recompute": dict(num_device_blocks=8, preemption_mode="recompute", enable_prefix_caching=False),
    # 20-token chunks would cut images' 16 tokens: such a chunk ends before its image instead.
    "chunked": dict(max_num_batched_tokens=20, enable_chunked_prefill=True, enable_prefix_caching=False),
    "prefix": dict(enable_prefix_caching=True),
    # One image's 16 rows a step: the prompt with three images is prefilled over three steps at least.
    "encoder-budget": dict(max_num_encoder_tokens=16, enable_prefix_caching=False),
    # The next step planned while this one runs: the image spans ride on the plan.
    "async": dict(async_scheduling=True),
}


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return built(tmp_path_factory, "gemma3_vl", gemma3_vl_config())


@pytest.fixture(scope="module")
def reference(vl) -> list[list[int]]:
    return hf_reference(vl, PROMPTS)


def test_the_images_decide_the_reference(reference):
    assert reference[0] != reference[1]


def test_expansion_is_the_processors(vl):
    """The engine's token-level wrap == Gemma3Processor's text-level one, newline runs merged as it tokenizes."""
    path, model = vl
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    hf_image = transformers.AutoImageProcessor.from_pretrained(path)
    processor = transformers.Gemma3Processor(hf_image, tokenizer, image_seq_length=16)
    spec = LLM(path, skip_tokenizer_init=True, dtype="float32", num_device_blocks=16, show_progress=False,
               attention_backend="torch").engine.images.spec
    for text in (PROMPTS[0][0], P + "x", "a\n\n" + P + P + "\nb\n", "<start_of_turn>" + P + "<end_of_turn>"):
        images = [image(i) for i in range(text.count(P))]
        expected = processor(text=text, images=images, return_tensors="pt")["input_ids"][0].tolist()
        ids = expand_image_tokens(tokenizer(text).input_ids, ImageProcessor(path)(images), spec, tokenizer)
        assert ids == expected, text


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_matches_transformers(vl, reference, scenario, backend):
    llm = make_llm(vl[0], backend, **SCENARIOS[scenario])
    spans = _record_image_rows(llm)
    assert generate(llm, PROMPTS) == reference
    stats = llm.engine.stats()
    assert llm.engine.runner.images.cache.misses == 5  # each distinct image encoded once
    assert spans and all(end - start == 16 for step in spans for start, end in step)  # images never split
    if scenario == "recompute":
        assert stats.num_preemptions_total > 0
    if scenario == "prefix":
        assert generate(llm, PROMPTS) == reference  # the full blocks now come from the prefix cache
        assert llm.engine.stats().prefix_cache_hits_total > 0
    assert llm.engine.stats().num_blocks_free == stats.num_blocks_total


def _record_image_rows(llm: LLM) -> list[list[tuple[int, int]]]:
    """Each step's image row spans (those attended both ways), from now on."""
    step, seen = llm.engine.runner.images, []
    inputs = step.inputs

    def recorded(images, device):
        rows = inputs(images, device)
        seen.append(rows.spans)
        return rows

    step.inputs = recorded
    return seen


def test_prefix_cache_keys_blocks_by_their_images(vl, reference):
    """The same text with another image shares only the blocks before it; the same image after the same text
    hits every full block, the image's included."""
    llm = make_llm(vl[0], enable_prefix_caching=True)
    prompts = [PROMPTS[4], (PROMPTS[4][0], [image(6)])]
    assert generate(llm, prompts[:1]) == reference[4:5]
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts],
                           GREEDY, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == reference[4]
    prompt_len = len(outputs[0].prompt_token_ids)
    assert outputs[0].num_cached_tokens == (prompt_len - 1) // 16 * 16 > 48
    assert outputs[1].num_cached_tokens == 48  # the image's tokens start in the fourth block
    assert outputs[1].outputs[0].token_ids == hf_vl_greedy(vl[1], vl[0], *prompts[1], MAX_NEW)


def test_a_prefix_hit_ending_inside_an_image(vl):
    """The image's tokens are 40 to 55 and the cached blocks end at 48: the rest of the image attends to itself both
    ways and to its cached half (computed whole before), as transformers' whole prefill does."""
    path, model = vl
    prompt = [("x" * 38 + P, [image(8)])]
    llm = make_llm(path, enable_prefix_caching=True)
    expected = [hf_vl_greedy(model, path, *prompt[0], MAX_NEW)]
    assert generate(llm, prompt) == expected
    spans = _record_image_rows(llm)
    outputs = llm.generate([{"prompt": prompt[0][0], "multi_modal_data": {"image": prompt[0][1]}}], GREEDY,
                           use_tqdm=False)
    assert outputs[0].num_cached_tokens == 48 and spans[0] == [(0, 8)]
    assert [outputs[0].outputs[0].token_ids] == expected


def test_chat_with_a_data_url_image(vl):
    """LLM.chat: the template's <start_of_image> after "user\\n" (its newlines merge with the wrap's)."""
    path, model = vl
    llm = make_llm(path)
    img = image(7)
    question = {"type": "text", "text": " what is it?"}
    out = llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(img)}},
                                                 question]}], GREEDY, use_tqdm=False)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, question]}],
                                             tokenize=False, add_generation_prompt=True)
    assert out[0].outputs[0].token_ids == hf_vl_greedy(model, path, text, [img], MAX_NEW)


def test_bad_image_requests_are_refused(vl, tmp_path):
    path = vl[0]
    llm = make_llm(path)
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        llm.generate({"prompt": P + P, "multi_modal_data": {"image": image(1)}}, GREEDY)
    wrong = ImagePatches(torch.zeros(28 * 28, 3), (1, 28, 28))
    with pytest.raises(ValueError, match="one 56-pixel square"):
        llm.engine.add_request("x", [1, 291, *[290] * 4, 292], GREEDY, images=[wrong])
    with pytest.raises(ValueError, match="must hold an image's 16 tokens"):
        make_llm(path, max_num_batched_tokens=8, enable_chunked_prefill=True, max_model_len=64)
    text_only = build_checkpoint("gemma3", tmp_path / "text")
    llm = LLM(text_only.path, skip_tokenizer_init=True, dtype="float32", num_device_blocks=16, show_progress=False,
              attention_backend="torch")
    with pytest.raises(ValueError, match="text-only"):
        llm.engine.add_request("y", [1, 2, 3], GREEDY, images=[ImagePatches(torch.zeros(56 * 56, 3), (1, 56, 56))])


def test_pan_and_scan_is_refused(vl, tmp_path):
    transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}, do_pan_and_scan=True).save_pretrained(
        tmp_path)
    with pytest.raises(ValueError, match="do_pan_and_scan is not supported"):
        ImageProcessor(str(tmp_path))
