"""Every head size real checkpoints use runs on the compiled kernels; any other fails when the
model loads, never per request; an offline batch raises when the engine fails a request."""
from __future__ import annotations

import pytest
import transformers

import engine.distributed.executor
from engine import LLM, SamplingParams

from .conftest import COMMON, Checkpoint, backends, build_checkpoint, hf_greedy, mixed_prompts

# Shapes of the checkpoints (head size 32) and of the sizes whose CPU kernel has scalar tail dims.
SHAPES = {
    "qwen2-h32": lambda: transformers.Qwen2Config(**{**COMMON, "hidden_size": 224, "num_attention_heads": 7},
                                                  num_key_value_heads=1, intermediate_size=256),
    "opt-h32": lambda: transformers.OPTConfig(**{**COMMON, "hidden_size": 64}, ffn_dim=128, word_embed_proj_dim=64,
                                              init_std=0.3),
    "llama-h40": lambda: transformers.LlamaConfig(**{**COMMON, "hidden_size": 80}, num_key_value_heads=1,
                                                  intermediate_size=128),
    "llama-h112": lambda: transformers.LlamaConfig(**{**COMMON, "hidden_size": 224}, num_key_value_heads=2,
                                                   intermediate_size=128),
    "llama-h72": lambda: transformers.LlamaConfig(**{**COMMON, "hidden_size": 144}, num_key_value_heads=1,
                                                  intermediate_size=128),
}


@pytest.fixture(scope="module")
def shape_checkpoints(tmp_path_factory) -> dict[str, Checkpoint]:
    return {name: build_checkpoint(name, tmp_path_factory.mktemp(name), config=shape())
            for name, shape in SHAPES.items()}


def make_llm(path: str, backend: str) -> LLM:
    return LLM(path, skip_tokenizer_init=True, attention_backend=backend, dtype="float32", num_device_blocks=64,
               max_model_len=128, show_progress=False)


@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("name", ["qwen2-h32", "opt-h32", "llama-h40", "llama-h112"])
def test_checkpoint_head_size_matches_hf(shape_checkpoints, name: str, backend: str) -> None:
    checkpoint = shape_checkpoints[name]
    prompts = mixed_prompts(4)
    outputs = make_llm(checkpoint.path, backend).generate(
        prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(checkpoint.hf_model, p, 8) for p in prompts]


def test_unsupported_head_size_fails_at_load(shape_checkpoints, monkeypatch) -> None:
    path = shape_checkpoints["llama-h72"].path

    def no_weights(*_, **__):
        raise AssertionError("the shape check comes before the weights load")

    with monkeypatch.context() as patch:
        patch.setattr(engine.distributed.executor, "load_model", no_weights)
        with pytest.raises(ValueError, match=r"head size 72; the compiled paged attention supports 32, 40"):
            make_llm(path, "ext")
    out = make_llm(path, "torch").generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2  # the reference backend runs any head size


def test_generate_raises_when_the_engine_fails_a_request(shape_checkpoints, monkeypatch) -> None:
    llm = make_llm(shape_checkpoints["llama-h40"].path, "torch")

    def boom(out):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(llm.engine.runner, "execute", boom)
    with pytest.raises(RuntimeError, match="request .* failed: .*kernel exploded"):
        llm.generate(prompt_token_ids=[[1, 2, 3], [4, 5]], sampling_params=SamplingParams(max_tokens=4))
    monkeypatch.undo()
    out = llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3  # the LLM still works after the failure
