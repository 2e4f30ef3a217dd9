"""Pooling requests (``LLM.embed`` / ``LLMEngine.add_request`` with ``PoolingParams``) == transformers' pooling of
the base model's final hidden states (fp32, 1e-5), whatever the schedule: chunked prefill, prefix-cache hits,
recompute and swap preemption, async scheduling, mixed into steps with generation; their blocks all return."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from engine import SamplingParams
from engine.pooling_params import PoolingParams
from .conftest import build_checkpoint, mixed_prompts
from .test_hf_equivalence import make_llm

SCENARIOS = {
    "plain": dict(enable_prefix_caching=False),
    "chunked": dict(max_num_batched_tokens=16, enable_chunked_prefill=True),
    "async": dict(async_scheduling=True, max_num_batched_tokens=32, enable_chunked_prefill=True),
    "recompute": dict(num_device_blocks=20, preemption_mode="recompute", max_num_batched_tokens=24,
                      enable_chunked_prefill=True),
    "swap": dict(num_device_blocks=20, preemption_mode="swap", num_cpu_blocks=64, max_num_batched_tokens=24,
                 enable_chunked_prefill=True),
}
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request, tmp_path_factory):
    return build_checkpoint(request.param, tmp_path_factory.mktemp(f"embed-{request.param}"))


@torch.inference_mode()
def hf_embedding(hf_model, prompt: list[int], pooling: str, normalize: bool, dimensions: int | None = None
                 ) -> torch.Tensor:
    """The reference: the base model's last_hidden_state pooled, truncated, then L2-normalized."""
    hidden = hf_model.base_model(torch.tensor([prompt])).last_hidden_state[0].float()
    vector = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
    if dimensions is not None:
        vector = vector[:dimensions]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def assert_embeddings(outputs, hf_model, prompts, pooling: str, normalize: bool, dimensions: int | None = None):
    for prompt, out in zip(prompts, outputs):
        assert out.finished and out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == []
        want = hf_embedding(hf_model, prompt, pooling, normalize, dimensions)
        torch.testing.assert_close(torch.tensor(out.embedding), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooling_matches_hf(model, pooling, normalize):
    llm = make_llm(model.path, "ext", enable_prefix_caching=False)
    prompts = mixed_prompts(8)
    outputs = llm.embed(prompt_token_ids=prompts, pooling_params=PoolingParams(pooling, normalize), use_tqdm=False)
    assert_embeddings(outputs, model.hf_model, prompts, pooling, normalize)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_schedules_mixed_with_generation(model, scenario, pooling):
    """Embedding and generation requests interleaved, in the same steps; each generation's tokens equal those of
    the same requests run alone, and every block returns."""
    prompts = mixed_prompts(12)
    alone = make_llm(model.path, "ext").generate(prompt_token_ids=prompts[::2], sampling_params=LONG, use_tqdm=False)
    llm = make_llm(model.path, "ext", **SCENARIOS[scenario])
    engine, params = llm.engine, PoolingParams(pooling)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, LONG if i % 2 == 0 else params)
    finished = run(engine)
    assert [finished[str(i)].outputs[0].token_ids for i in range(0, 12, 2)] == [o.outputs[0].token_ids for o in alone]
    assert_embeddings([finished[str(i)] for i in range(1, 12, 2)], model.hf_model, prompts[1::2], pooling, True)
    stats = engine.stats()
    if scenario in ("recompute", "swap"):
        assert stats.num_preemptions_total > 0
        if (scenario, pooling) != ("recompute", "last"):  # there only generations happen to be the victims
            assert any(finished[str(i)].metrics.num_preemptions for i in range(1, 12, 2))  # an embedding, mid-prompt
    assert stats.num_blocks_free == stats.num_blocks_total


def run(engine) -> dict:
    """Steps to the end; each request's final output, its tokens (one choice) gathered from every step's (an
    embedding request has exactly one output)."""
    finished, tokens = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in finished and out.error is None
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                finished[out.request_id] = out
                out.outputs[0].token_ids = tokens[out.request_id]
    return finished


def test_last_token_pooling_hits_the_prefix_cache(model):
    """A generation caches the shared prefix first; last-token pooling then hits it (mean and CLS pooling read
    every position, so they never do) and is still exact."""
    llm = make_llm(model.path, "ext", enable_prefix_caching=True)
    prompt = mixed_prompts()[1]  # a 40-token shared prefix and a few tokens
    llm.generate(prompt_token_ids=[prompt], sampling_params=LONG, use_tqdm=False)
    last, mean = (llm.embed(prompt_token_ids=[prompt], pooling_params=PoolingParams(p), use_tqdm=False)[0]
                  for p in ("last", "mean"))
    assert last.num_cached_tokens >= 32 and mean.num_cached_tokens == 0
    assert_embeddings([last], model.hf_model, [prompt], "last", True)
    assert_embeddings([mean], model.hf_model, [prompt], "mean", True)


def test_an_aborted_embedding_returns_its_blocks(model):
    llm = make_llm(model.path, "ext", max_num_batched_tokens=16, enable_chunked_prefill=True)
    engine = llm.engine
    engine.add_request("e", mixed_prompts()[1], PoolingParams("mean"))
    engine.step()  # its first chunk of 16
    assert engine.stats().num_blocks_free < engine.stats().num_blocks_total
    engine.abort_request("e")
    [out] = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.embedding is None
    assert not engine.has_unfinished_requests()
    assert engine.stats().num_blocks_free == engine.stats().num_blocks_total


def test_bad_pooling_requests_are_refused(model):
    engine = make_llm(model.path, "torch", max_model_len=64).engine
    with pytest.raises(ValueError, match="dimensions"):
        engine.add_request("d", [1, 2, 3], PoolingParams(dimensions=8))  # no Matryoshka in this config
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request("long", [1] * 65, PoolingParams())
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], PoolingParams())
    with pytest.raises(ValueError, match="pooling must be"):
        PoolingParams("max")
    engine.add_request("full", [1] * 64, PoolingParams())  # the whole context: nothing to generate after it
    assert run(engine)["full"].embedding is not None


def checkpoint_copy(model, tmp_path, config: dict | None = None, modules: list | None = None,
                    pooling_config: dict | None = None) -> str:
    """The checkpoint with sentence-transformers files and config.json fields added."""
    folder = tmp_path / "st"
    shutil.copytree(model.path, folder)
    if config:
        path = folder / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | config))
    if modules is not None:
        (folder / "modules.json").write_text(json.dumps(modules))
    if pooling_config is not None:
        (folder / "1_Pooling").mkdir()
        (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    return str(folder)


ST_MODULES = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
NORMALIZE = {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}


@pytest.mark.parametrize("normalize", [True, False])
def test_the_sentence_transformers_config_sets_the_default(model, tmp_path, normalize):
    path = checkpoint_copy(model, tmp_path, modules=ST_MODULES + [NORMALIZE] * normalize,
                           pooling_config={"word_embedding_dimension": 128, "pooling_mode_mean_tokens": True})
    prompts = mixed_prompts(4)
    outputs = make_llm(path, "ext").embed(prompt_token_ids=prompts, use_tqdm=False)
    assert_embeddings(outputs, model.hf_model, prompts, "mean", normalize)


@pytest.mark.parametrize("modules, pooling_config, named", [
    (ST_MODULES, {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
    (ST_MODULES, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, "pooling_mode_cls_token"),
    (ST_MODULES + [{"idx": 2, "path": "2_Dense", "type": "sentence_transformers.models.Dense"}], 
     {"pooling_mode_lasttoken": True}, "Dense")])
def test_unserved_sentence_transformers_configs_are_refused_at_load(model, tmp_path, modules, pooling_config, named):
    path = checkpoint_copy(model, tmp_path, modules=modules, pooling_config=pooling_config)
    with pytest.raises(ValueError, match=named):
        make_llm(path, "torch")


@pytest.mark.parametrize("config, dimensions, ok", [
    ({"is_matryoshka": True}, 32, True), ({"matryoshka_dimensions": [32, 64]}, 32, True),
    ({"matryoshka_dimensions": [32, 64]}, 48, False), ({"is_matryoshka": True}, 129, False)])
def test_matryoshka_dimensions_truncate_then_normalize(model, tmp_path, config, dimensions, ok):
    engine = make_llm(checkpoint_copy(model, tmp_path, config=config), "ext").engine
    prompt = mixed_prompts()[3]
    if not ok:
        with pytest.raises(ValueError, match="dimensions"):
            engine.add_request("m", prompt, PoolingParams(dimensions=dimensions))
        return
    engine.add_request("m", prompt, PoolingParams(dimensions=dimensions))
    out = run(engine)["m"]
    assert len(out.embedding) == dimensions
    assert_embeddings([out], model.hf_model, [prompt], "last", True, dimensions)
