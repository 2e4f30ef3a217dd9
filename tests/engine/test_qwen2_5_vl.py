"""Qwen2.5-VL through the paged engine == transformers fp32 greedy, token for token: images spliced at their
placeholders, M-RoPE, the encoder cache, and prefix caching keyed by the images' hashes."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.multimodal.block_keys import ImageBlockKeys
from engine.multimodal.inputs import ImagePatches
from engine.multimodal.processor import ImageProcessor, expand_image_tokens
from .conftest import TEST_DEVICE, backends
from loadtest.vl_checkpoint import PLACEHOLDER, build_vl_checkpoint, data_url, hf_vl_greedy, image

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def vl_prompts(scale: int = 1) -> list[tuple[str, list]]:
    """(text, images): one image; the same text with another image; two images of other sizes in one prompt; text
    only; a longer prefix before a wider image (24 placeholder tokens across two KV blocks). ``scale``: the images'
    sides times it (2 for 16-pixel patches: the same placeholder counts as 8-pixel ones at 1)."""
    def img(seed: int, width: int = 64, height: int = 80):
        return image(seed, width * scale, height * scale)
    return [
        ("Hi " + PLACEHOLDER + " what is in it?", [img(1)]),
        ("Hi " + PLACEHOLDER + " what is in it?", [img(2)]),
        ("Compare " + PLACEHOLDER + " and " + PLACEHOLDER + " now.", [img(3, 48, 64), img(1)]),
        ("Just text here, no image at all.", []),
        ("A long question comes first, then the image: " + PLACEHOLDER + " describe", [img(4, 96, 64)]),
    ]


PROMPTS = vl_prompts()
SCENARIOS = {
    "plain": dict(enable_prefix_caching=False),
    # 5 prompts of 32 to 80 tokens + 12 new need 16 blocks of 16 at once: 7 force preemption.
    "recompute": dict(num_device_blocks=7, preemption_mode="recompute", enable_prefix_caching=False),
    # 16-token chunks split the placeholder runs: one image's embeddings reach the step in pieces.
    "chunked": dict(max_num_batched_tokens=16, enable_chunked_prefill=True),
    "prefix": dict(enable_prefix_caching=True),
    # Images of 20, 20, 12 and 24 rows: no two of the first three prompts' images are encoded in one step.
    "encoder-budget": dict(max_num_encoder_tokens=24, enable_prefix_caching=False),
    # The next step planned while this one runs: M-RoPE positions and splices on the plan, encoding on the run.
    "async": dict(async_scheduling=True),
    # n-gram drafts verified after image prompts: their rows' positions are past the prompt (index + delta).
    "ngram": dict(speculative_method="ngram", num_speculative_tokens=3, ngram_prompt_lookup_min=1),
}


def built(tmp_path_factory, name: str, config=None) -> tuple[str, object]:
    """(folder, transformers model) of a tiny checkpoint: each family's ``vl`` fixture."""
    folder = tmp_path_factory.mktemp(name)
    return str(folder), build_vl_checkpoint(folder, config)


def hf_reference(vl, prompts) -> list[list[int]]:
    """transformers' greedy tokens for each (text, images): each family's ``reference`` fixture."""
    path, model = vl
    return [hf_vl_greedy(model, path, text, images, MAX_NEW) for text, images in prompts]


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return built(tmp_path_factory, "qwen2_5_vl")


@pytest.fixture(scope="module")
def reference(vl) -> list[list[int]]:
    return hf_reference(vl, PROMPTS)


def make_llm(path: str, backend: str = "torch", **overrides) -> LLM:
    config = dict(attention_backend=backend, dtype="float32", num_device_blocks=256, show_progress=False,
                  device=TEST_DEVICE)
    return LLM(path, **(config | overrides))


def generate(llm: LLM, prompts) -> list[list[int]]:
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts],
                           GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def test_the_images_decide_the_reference(reference):
    """The same text with two images answers two ways, so a mixed-up image or shared KV would show."""
    assert reference[0] != reference[1]


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_matches_transformers(vl, reference, scenario, backend):
    check_greedy(vl[0], backend, scenario, SCENARIOS[scenario], PROMPTS, reference)


def check_greedy(path: str, backend: str, scenario: str, config: dict, prompts, reference: list[list[int]]) -> None:
    """``prompts`` (four distinct images among them) through the engine under ``config`` == ``reference``, each
    image encoded once, no step's encoding over the encoder budget, every block free after."""
    llm = make_llm(path, backend, **config)
    encoded = _record_encoder_calls(llm)
    assert generate(llm, prompts) == reference
    budget = llm.engine.scheduler.encoder_budget.limit
    assert all(sum(rows) <= budget or len(rows) == 1 for rows in encoded)
    cache, stats = llm.engine.runner.images.cache, llm.engine.stats()
    assert cache.misses == 4  # each distinct image encoded once, however its prompt was chunked or preempted
    if scenario == "recompute":
        assert stats.num_preemptions_total > 0
    if scenario == "prefix":
        assert generate(llm, prompts) == reference  # the prompts' full blocks now come from the prefix cache
        assert llm.engine.stats().prefix_cache_hits_total > 0
    assert llm.engine.stats().num_blocks_free == stats.num_blocks_total


def _record_encoder_calls(llm: LLM) -> list[list[int]]:
    """Each vision tower call's images' row counts, from now on."""
    cache, calls = llm.engine.runner.images.cache, []
    encode = cache.encode

    def recorded(images):
        out = encode(images)
        calls.append([len(e) for e in out])
        return out

    cache.encode = recorded
    return calls


def test_encoder_budget_splits_the_encoding_across_steps(vl, reference):
    llm = make_llm(vl[0], **SCENARIOS["encoder-budget"])
    encoded = _record_encoder_calls(llm)
    assert generate(llm, PROMPTS[:3]) == reference[:3]
    assert sorted(rows for call in encoded for rows in call) == [12, 20, 20] and len(encoded) >= 2
    assert all(sum(call) <= 24 for call in encoded)


def test_prefix_cache_keys_blocks_by_their_images(vl, reference):
    check_prefix_keys(vl[0], PROMPTS, reference)


def check_prefix_keys(path: str, prompts, reference: list[list[int]]) -> None:
    """The same text with another image (``prompts[1]`` is ``prompts[0]``'s text with another image) shares no
    block holding image tokens; the same image after the same text hits every full block, image tokens included."""
    assert reference[0] != reference[1]  # the images decide the answer, so a shared block would show
    llm = make_llm(path, enable_prefix_caching=True)
    assert generate(llm, prompts[:1]) == reference[:1]
    outputs = llm.generate([{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts[:2]],
                           GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference[:2]
    prompt_len = len(outputs[0].prompt_token_ids)
    assert outputs[0].num_cached_tokens == (prompt_len - 1) // 16 * 16 > 0
    assert outputs[1].num_cached_tokens == 0  # its first block already holds image tokens


def test_kv_snapshot_marks_the_blocks_holding_image_tokens(vl):
    llm = make_llm(vl[0], enable_prefix_caching=False)
    text, images = PROMPTS[0]  # "Hi " and vision_start, then 20 image tokens: positions 4 to 23, blocks 0 and 1
    patches = ImageProcessor(vl[0])(images)
    ids = expand_image_tokens(llm.tokenizer(text).input_ids, patches, llm.engine.images.spec)
    llm.engine.add_request("r", ids, GREEDY, images=patches)
    llm.engine.step()
    [request] = llm.engine.kv_snapshot().requests
    assert len(request.block_ids) == 3 and request.image_block_ids == request.block_ids[:2]
    llm.engine.abort_request("r")


def test_block_keys_join_only_the_blocks_an_image_fills():
    keys = ImageBlockKeys(b"salt", ((20, 24, b"A" * 32),))
    assert keys.key(0, 16) == b"salt"  # text before the image: shared with any request of the same salt
    assert keys.key(16, 32) == keys.key(32, 48) != b"salt"
    assert keys.key(44, 60) == b"salt"
    assert ImageBlockKeys(b"salt", ((20, 24, b"B" * 32),)).key(16, 32) != keys.key(16, 32)


def test_chat_with_a_data_url_image(vl):
    path, model = vl
    llm = make_llm(path)
    img = image(5)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look: "},
                                             {"type": "image_url", "image_url": {"url": data_url(img)}},
                                             {"type": "text", "text": " what is it?"}]}]
    out = llm.chat(messages, GREEDY, use_tqdm=False)
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "Look: "}, {"type": "image"},
                                      {"type": "text", "text": " what is it?"}]}],
        tokenize=False, add_generation_prompt=True)
    assert out[0].outputs[0].token_ids == hf_vl_greedy(model, path, text, [img], MAX_NEW)


def test_bad_image_requests_are_refused(vl, llama_checkpoint):
    llm = make_llm(vl[0])
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        llm.generate({"prompt": PLACEHOLDER + PLACEHOLDER, "multi_modal_data": {"image": image(1)}}, GREEDY)
    with pytest.raises(ValueError, match="cannot be decoded"):
        llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": "data:image/png;base64,AAAA"}}]}], GREEDY)
    with pytest.raises(ValueError, match="unsupported image type"):
        llm.chat([{"role": "user", "content": [{"type": "image_url",
                                                "image_url": {"url": "data:image/gif;base64,AAAA"}}]}], GREEDY)
    patches = ImagePatches(torch.zeros(4 * 4, 384), (1, 4, 4))
    with pytest.raises(ValueError, match="placeholder tokens in the prompt"):
        llm.engine.add_request("x", [1, 290, 290, 2], GREEDY, images=[patches])  # 4 rows, 2 placeholders
    text_only = LLM(llama_checkpoint.path, skip_tokenizer_init=True, dtype="float32", num_device_blocks=16,
                    show_progress=False, attention_backend="torch")
    with pytest.raises(ValueError, match="text-only"):
        text_only.engine.add_request("y", [1, 2, 3], GREEDY, images=[patches])
