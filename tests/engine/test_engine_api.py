"""LLMEngine's request contract, the demo checkpoint, and loader errors."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.demo_model import ensure_demo_model
from engine.models.config import context_length, read_model_config

from .conftest import build_checkpoint, hf_greedy, mixed_prompts

STATS_KEYS = {
    "num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage",
    "num_blocks_total", "num_blocks_free", "num_blocks_cached", "kv_tokens_stored", "kv_reserved_slots",
    "kv_internal_frag_slots", "kv_external_frag_slots", "kv_free_slots", "num_preemptions_total",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total", "generation_tokens_total",
    "num_swapped_out_blocks_total", "num_swapped_in_blocks_total",
}


def make_engine(path: str, **overrides) -> LLMEngine:
    config = dict(attention_backend="torch", dtype="float32", num_device_blocks=64, show_progress=False,
                  max_model_len=128)
    return LLMEngine(EngineConfig(model=path, **(config | overrides)))


def run_to_end(engine: LLMEngine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("prompt, max_tokens, match", [
    ([], 4, "empty"),
    ([1, 2, 300], 4, r"\[0, 300\)"),
    ([-1], 4, r"\[0, 300\)"),
    ([1] * 120, 10, r"maximum context length is 128 tokens. However, you requested 130 tokens"),
    ([1] * 128, None, "leaving no room for the completion"),
])
def test_add_request_rejects_bad_input(llama_checkpoint, prompt, max_tokens, match):
    engine = make_engine(llama_checkpoint.path)
    with pytest.raises(ValueError, match=match):
        engine.add_request("a", prompt, SamplingParams(max_tokens=max_tokens))
    assert not engine.has_unfinished_requests()


def test_duplicate_request_id_rejected(llama_checkpoint):
    engine = make_engine(llama_checkpoint.path)
    engine.add_request("a", [1, 2], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("a", [3], SamplingParams())


def test_abort_frees_blocks_and_reports(llama_checkpoint):
    engine = make_engine(llama_checkpoint.path)
    for i, prompt in enumerate(mixed_prompts(3)):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()
    used = engine.stats().num_blocks_used
    engine.abort_request("r1")
    assert engine.stats().num_blocks_used < used
    aborted = [o for o in engine.step() if o.request_id == "r1"]
    assert len(aborted) == 1 and aborted[0].finished and aborted[0].outputs[0].finish_reason == "abort"
    rest = run_to_end(engine)
    assert "r1" not in {o.request_id for o in rest}
    assert {o.request_id for o in rest if o.finished} == {"r0", "r2"}
    stats = engine.stats()
    assert STATS_KEYS <= {f.name for f in dataclasses.fields(stats)}
    assert stats.num_blocks_free == stats.num_blocks_total


def test_incremental_outputs_add_up(llama_checkpoint):
    engine = make_engine(llama_checkpoint.path, enable_prefix_caching=False)
    prompt = mixed_prompts(1)[0]
    engine.add_request("x", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    deltas = [o for o in run_to_end(engine)]
    assert all(len(o.outputs[0].token_ids) == 1 for o in deltas)  # one new token per decode step
    assert [t for o in deltas for t in o.outputs[0].token_ids] == hf_greedy(llama_checkpoint.hf_model, prompt, 12)
    assert [o.finished for o in deltas] == [False] * 11 + [True]
    assert deltas[-1].outputs[0].finish_reason == "length"
    metrics = deltas[-1].metrics
    assert metrics.arrival_time <= metrics.first_token_time <= metrics.finished_time


def test_request_that_can_never_fit_fails_alone(llama_checkpoint):
    engine = make_engine(llama_checkpoint.path, num_device_blocks=3)
    engine.add_request("big", [1] * 60, SamplingParams(max_tokens=4))  # needs 4 blocks of 16
    engine.add_request("small", [1] * 5, SamplingParams(max_tokens=4, ignore_eos=True))
    outputs = run_to_end(engine)
    big = [o for o in outputs if o.request_id == "big"]
    assert len(big) == 1 and big[0].finished and big[0].outputs[0].finish_reason == "error" and big[0].error
    assert [o for o in outputs if o.request_id == "small"][-1].outputs[0].finish_reason == "length"


def test_failing_batch_fails_its_requests_not_the_engine(llama_checkpoint, monkeypatch):
    engine = make_engine(llama_checkpoint.path)
    engine.add_request("doomed", [1, 2, 3], SamplingParams(max_tokens=4))

    def boom(out):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(engine.runner, "execute", boom)
    (failed,) = engine.step()
    assert failed.finished and failed.outputs[0].finish_reason == "error" and "kernel exploded" in failed.error
    monkeypatch.undo()
    stats = engine.stats()
    assert stats.num_blocks_free == stats.num_blocks_total
    engine.add_request("fine", [1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    assert run_to_end(engine)[-1].outputs[0].finish_reason == "length"


def test_has_capacity_tracks_queue(llama_checkpoint):
    engine = make_engine(llama_checkpoint.path, max_num_seqs=2)
    assert engine.has_capacity()
    for i in range(3):
        engine.add_request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()
    assert not engine.has_capacity()
    run_to_end(engine)
    assert engine.has_capacity()


def test_kv_pool_sized_from_bytes(llama_checkpoint):
    engine = make_engine(llama_checkpoint.path, num_device_blocks=None, kv_cache_memory_bytes=1 << 20,
                         swap_space_bytes=1 << 19)
    # Per block: 2 layers x (K, V) x 1 kv head x 16 slots x 64 dims x 4 bytes = 16 KiB.
    assert engine.config.scheduler.num_device_blocks == 64 and engine.config.scheduler.num_cpu_blocks == 32


def test_config_resolved_into_a_new_frozen_object(llama_checkpoint):
    config = EngineConfig(model=llama_checkpoint.path, attention_backend="torch", kv_cache_memory_bytes=1 << 20,
                          show_progress=False)
    before = dataclasses.replace(config)
    engine = LLMEngine(config)
    assert config == before  # the user's object is never written to
    resolved = engine.config
    assert (resolved.scheduler.max_model_len, resolved.scheduler.num_device_blocks) == (256, 64)
    assert resolved.tokenizer == resolved.model_config.path == llama_checkpoint.path
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.scheduler.num_device_blocks = 1


# ---- the demo checkpoint -----------------------------------------------------------
@pytest.fixture(scope="module")
def demo_path(tmp_path_factory) -> str:
    return ensure_demo_model(str(tmp_path_factory.mktemp("demo") / "demo-model"))


def test_demo_model_is_a_real_hf_checkpoint(demo_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_DEMO_MODEL_DIR", demo_path)
    llm = LLM(attention_backend="torch", num_device_blocks=64, show_progress=False)  # no model: the demo one
    assert llm.engine.config.model_config.path == demo_path
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_path)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(demo_path, dtype=torch.float32)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                         tokenize=False)
    assert chat == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    prompts = [chat, "héllo wörld", "The quick brown fox"]
    out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    for prompt, result in zip(prompts, out):
        ids = tokenizer(prompt).input_ids
        assert result.prompt_token_ids == ids and result.prompt == prompt
        assert result.outputs[0].token_ids == hf_greedy(hf_model, ids, 10, eos_token_id=None)  # as ignore_eos
        assert result.outputs[0].text == tokenizer.decode(result.outputs[0].token_ids, skip_special_tokens=True)
    assert llm.engine.eos_token_ids == {tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_demo_model_written_once(demo_path):
    before = os.path.getmtime(os.path.join(demo_path, "model.safetensors"))
    assert ensure_demo_model(demo_path) == demo_path
    assert os.path.getmtime(os.path.join(demo_path, "model.safetensors")) == before


# ---- loader errors -----------------------------------------------------------------
@pytest.fixture
def broken_copy(demo_path, tmp_path) -> str:
    path = str(tmp_path / "model")
    shutil.copytree(demo_path, path)
    return path


def edit_config(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config | changes, f)


def test_unsupported_architecture(broken_copy):
    edit_config(broken_copy, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'.*LlamaForCausalLM"):
        make_engine(broken_copy)


def test_too_long_max_model_len_fails_before_loading_weights(broken_copy):
    os.remove(os.path.join(broken_copy, "model.safetensors"))  # loading would fail differently
    with pytest.raises(ValueError, match=r"max_model_len=4096 exceeds the model's max_position_embeddings"):
        make_engine(broken_copy, max_model_len=4096)


@pytest.mark.parametrize("extra, windows", [
    ({"sliding_window": 48}, (48,) * 4),  # Mistral's: every layer
    ({"sliding_window": 48, "use_sliding_window": False}, (0,) * 4),  # Qwen2's off switch
    ({"sliding_window": 48, "use_sliding_window": True, "max_window_layers": 3}, (0, 0, 0, 48)),
    ({"sliding_window": 48, "layer_types": ["sliding_attention", "full_attention"] * 2}, (48, 0, 48, 0)),
    ({"sliding_window": None}, (0,) * 4),
])
def test_each_layer_gets_the_window_transformers_gives_it(broken_copy, extra, windows):
    edit_config(broken_copy, **extra)
    assert read_model_config(broken_copy).layer_windows == windows
    engine = make_engine(broken_copy, max_model_len=None)
    assert [layer.self_attn.attn.sliding_window for layer in engine.runner.model.model.layers] == list(windows)


@pytest.mark.parametrize("backend", ["torch", "ext"])
def test_blocks_behind_every_window_return_to_the_pool(tmp_path, backend):
    """Two 40-token prompts growing to 190 tokens would need 24 blocks of 16 without release; behind a
    12-token window they run in 8 (3 each for the prompt, then 2), unpreempted and token-exact."""
    checkpoint = build_checkpoint("mistral-window", tmp_path)
    prompts = [p[:40] for p in mixed_prompts() if len(p) >= 40][:2]
    engine = make_engine(checkpoint.path, attention_backend=backend, num_device_blocks=8, max_model_len=None)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True))
    outputs: dict[str, list[int]] = {"0": [], "1": []}
    for delta in run_to_end(engine):
        outputs[delta.request_id] += delta.outputs[0].token_ids
    assert [outputs[str(i)] for i in range(2)] == [hf_greedy(checkpoint.hf_model, p, 150) for p in prompts]
    stats = engine.stats()
    assert stats.num_preemptions_total == 0 and stats.num_window_released_blocks_total >= 2 * (190 // 16 - 2)
    assert stats.num_blocks_free == stats.num_blocks_total


def test_a_full_attention_layer_keeps_every_block(tmp_path):
    checkpoint = build_checkpoint("qwen2-window", tmp_path)  # layer 0 attends to everything
    engine = make_engine(checkpoint.path, max_model_len=None)
    engine.add_request("0", list(range(1, 41)), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    run_to_end(engine)
    assert engine.scheduler.kv.sliding_window == 0 and engine.stats().num_window_released_blocks_total == 0


@pytest.mark.parametrize("extra, match", [
    ({"sliding_window": 4096}, r"sliding_window=4096 exceeds the context it slides over \(max_position_embeddings"),
    ({"sliding_window": -3}, "sliding_window must be a positive integer or null"),
    ({"sliding_window": 8, "layer_types": ["sliding_attention"]}, "layer_types lists 1 layers"),
])
def test_bad_windows_fail_at_load(broken_copy, extra, match):
    edit_config(broken_copy, **extra)
    with pytest.raises(ValueError, match=match):
        make_engine(broken_copy)


def test_one_context_length_rule(broken_copy):
    with open(os.path.join(broken_copy, "config.json")) as f:
        config = json.load(f)
    del config["max_position_embeddings"]
    with open(os.path.join(broken_copy, "config.json"), "w") as f:
        json.dump(config | {"n_positions": 512, "seq_length": 64}, f)
    assert context_length(broken_copy) == read_model_config(broken_copy).max_position_embeddings == 512
    edit_config(broken_copy, n_positions=None)
    assert context_length(broken_copy) == 64
    edit_config(broken_copy, seq_length="long")
    with pytest.raises(ValueError, match="names no context length"):
        context_length(broken_copy)
    with pytest.raises(ValueError, match="names no context length"):
        read_model_config(broken_copy)


def test_missing_files(broken_copy, tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        make_engine(str(tmp_path / "nowhere"))
    os.remove(os.path.join(broken_copy, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="safetensors"):
        make_engine(broken_copy)


def test_shape_mismatch(broken_copy):
    edit_config(broken_copy, intermediate_size=512)
    with pytest.raises(ValueError, match=r"shape mismatch for 'model.layers.\d+.mlp.\w+_proj.weight': checkpoint has"):
        make_engine(broken_copy)


def test_missing_weight(broken_copy):
    file = os.path.join(broken_copy, "model.safetensors")
    weights = load_file(file)
    del weights["model.norm.weight"]
    save_file(weights, file)
    with pytest.raises(ValueError, match="lacks weights for: model.norm.weight"):
        make_engine(broken_copy)


def test_generate_is_all_or_nothing(llama_checkpoint):
    llm = LLM(llama_checkpoint.path, skip_tokenizer_init=True, attention_backend="torch", num_device_blocks=64,
              max_model_len=128, show_progress=False)
    with pytest.raises(ValueError, match="maximum context length is 128 tokens"):
        llm.generate(prompt_token_ids=[[1, 2], [1] * 200], sampling_params=SamplingParams(max_tokens=4))
    llm.engine.step()  # emits the aborts
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate(prompt_token_ids=[[1, 2]], sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 4
