"""Quantized weights: compressed-tensors int8 / fp8 and fp8-method checkpoints, and int8 made at load, greedy
token for token equal to transformers run on the dequantised weights; config.json fields and tensors the
engine cannot run fail at load, naming them."""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from engine.layers.linear import Linear
from engine.models.moe import Router, SparseMoeBlock
from engine.quantization import dequantize, quantize
from loadtest.quant_quality import agreement_and_kl, dequantized_copy, quantize_activations
from .conftest import MAX_NEW_TOKENS, backends, build_checkpoint, hf_greedy, mixed_prompts
from .test_hf_equivalence import generate, make_llm

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# ARCH_CONFIGS entries these tests quantize, with the schemes each is tested in (the README's model table reads it).
FLAG_ARCHS = ["qwen2", "qwen3", "phi3", "gemma2", "opt"]
# The README's model table reads it (deepseek-v3: tests/engine/test_deepseek.py; gemma4-moe:
# tests/engine/test_gemma4.py; the hybrids: tests/engine/test_qwen3_next.py; int4: tests/engine/test_int4.py).
QUANTIZED_ARCHS = {"llama": ("int8", "w8a8", "fp8", "int4", "int4-asym"), "qwen2-moe": ("int8", "int4"),
                   "deepseek-v3": ("int8",), "gemma4-moe": ("int8",), "qwen3-next": ("int8",), "qwen3.5": ("int8",),
                   **{arch: ("int8", "int4-asym") for arch in FLAG_ARCHS}}


def ct_config(kind: str = "int", strategy: str = "channel", **weights) -> dict:
    """compressed-tensors' quantization_config as llm-compressor writes it (W8A8: dynamic per-token
    activations, which the engine quantizes too where they are int8)."""
    scheme = dict(actorder=None, block_structure=None, dynamic=False, group_size=None, num_bits=8,
                  observer="minmax", observer_kwargs={}, strategy=strategy, symmetric=True, type=kind) | weights
    activations = dict(dynamic=True, num_bits=8, strategy="token", symmetric=True, type=kind)
    return {"config_groups": {"group_0": {"input_activations": activations, "output_activations": None,
                                          "targets": ["Linear"], "weights": scheme}},
            "format": "int-quantized" if kind == "int" else "float-quantized", "ignore": ["lm_head"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def fp8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().max().float() / torch.finfo(torch.float8_e4m3fn).max
    return (w.float() / scale).to(torch.float8_e4m3fn), scale


def quantized_tensors(tensors: dict, method: str, per_tensor: bool = False) -> tuple[dict, dict]:
    """(checkpoint tensors with each decoder linear weight quantized plus its weight_scale, the dequantised
    weights for the reference model)."""
    out, dequantised = dict(tensors), {}
    for name, w in tensors.items():
        if name.rpartition(".")[0].rpartition(".")[2] in LINEARS and name.endswith(".weight"):
            q, scale = fp8_per_tensor(w) if per_tensor else quantize(w, method)
            out[name], out[name + "_scale"] = q, scale
            dequantised[name] = dequantize(q, scale, torch.float32)
    return out, dequantised


def write_quantized(src: str, folder, method: str, config: dict, per_tensor: bool = False) -> dict:
    """A quantized copy of checkpoint ``src`` in ``folder``; returns the dequantised weights."""
    os.makedirs(folder, exist_ok=True)
    tensors, dequantised = quantized_tensors(load_file(os.path.join(src, "model.safetensors")), method, per_tensor)
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        hf = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf | {"quantization_config": config}, f)
    return dequantised


def with_weights(model: transformers.PreTrainedModel, weights: dict) -> transformers.PreTrainedModel:
    ref = copy.deepcopy(model)
    ref.load_state_dict(weights, strict=False)
    return ref


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_checkpoint("llama", tmp_path_factory.mktemp("llama-quant"))


@pytest.fixture(scope="module")
def int8_checkpoint(llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-w8a8")
    weights = write_quantized(llama.path, folder, "int8", ct_config())
    return str(folder), quantize_activations(with_weights(llama.hf_model, weights))


def assert_greedy_matches_up_to_near_ties(reference: transformers.PreTrainedModel, got: list[list[int]]) -> None:
    """Quantized activations: a last-bit difference in a hidden state can move a value across a rounding
    boundary of its row's int8 grid (a 1/127 step), so a near-tie may resolve the other way. Every sequence
    equals the reference's greedy one, except at most 2 of them, which may part from it only where the
    reference's two best logits are within 1% of its largest one, taking the second."""
    prompts, parted = mixed_prompts(), 0
    for prompt, tokens in zip(prompts, got):
        expected = hf_greedy(reference, prompt, MAX_NEW_TOKENS)
        if tokens == expected:
            continue
        parted += 1
        at = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + expected[:at]])).logits[0, -1]
        top = logits.topk(2)
        assert top.indices[1] == tokens[at] and top.values[0] - top.values[1] <= 0.01 * logits.abs().max()
    assert parted <= 2


def w8a8_packed() -> bool:
    import cuda_ext

    cuda_ext.load_ops("ext")
    return torch.ops.pagedserve.skinny_linear_w8a8_supports()


@pytest.mark.parametrize("backend", backends())
def test_compressed_tensors_w8a8_matches_hf_on_dequantised_weights(int8_checkpoint, backend):
    """W8A8 (int8 weights, dynamic per-token int8 activations): greedy equal to transformers on the dequantised
    weights with each linear layer's input rounded to its per-row int8 grid (not the LM head's)."""
    path, reference = int8_checkpoint
    llm = make_llm(path, backend, enable_prefix_caching=False)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.shape == (qkv.out_features, 1)
    assert qkv.quantize_activations
    on_kernel = backend == "ext" and w8a8_packed()
    assert (qkv.packed is not None and qkv.packed.col_offset is not None) == on_kernel
    assert llm.engine.runner.model.lm_head.weight_scale is None  # ignored: kept as the checkpoint has it
    assert_greedy_matches_up_to_near_ties(reference, generate(llm, mixed_prompts()))


def test_compressed_tensors_w8a16(llama, tmp_path):
    """Weight-only int8 (no input_activations): the activations stay in the model's dtype."""
    config = ct_config()
    config["config_groups"]["group_0"]["input_activations"] = None
    reference = with_weights(llama.hf_model, write_quantized(llama.path, tmp_path, "int8", config))
    llm = make_llm(str(tmp_path), "ext", enable_prefix_caching=False)
    assert not llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.quantize_activations
    prompts = mixed_prompts()[:6]
    assert generate(llm, prompts) == [hf_greedy(reference, p, MAX_NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("layout", ["compressed-tensors channel", "fp8 method per tensor"])
def test_fp8_matches_hf_on_dequantised_weights(llama, tmp_path, layout):
    per_tensor = layout.endswith("per tensor")
    fp8_method = {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}
    config = fp8_method if per_tensor else ct_config("float")
    reference = with_weights(llama.hf_model, write_quantized(llama.path, tmp_path, "fp8", config, per_tensor))
    llm = make_llm(str(tmp_path), "ext", enable_prefix_caching=False)
    prompts = mixed_prompts()[:6]
    assert generate(llm, prompts) == [hf_greedy(reference, p, MAX_NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize("backend", backends())
def test_quantization_flag_int8(llama, backend):
    """--quantization int8 on an fp32 checkpoint: every linear layer (the LM head too) per-channel int8; greedy
    equal to transformers on those weights; close to the unquantized model (agreement far above chance)."""
    llm = make_llm(llama.path, backend, quantization="int8", enable_prefix_caching=False)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert all(m.weight_scale is not None for m in linears)
    reference = dequantized_copy(llama.hf_model, "int8")
    prompts = mixed_prompts()
    assert generate(llm, prompts) == [hf_greedy(reference, p, MAX_NEW_TOKENS) for p in prompts]
    # Teacher-forced on the fp32 model's greedy continuations, from each prompt's last token on.
    continued = [p + hf_greedy(llama.hf_model, p, MAX_NEW_TOKENS)[:-1] for p in prompts]
    agreement, kl = agreement_and_kl(llama.hf_model, reference, continued, [len(p) - 1 for p in prompts])
    print(f"int8 vs fp32 (teacher-forced): greedy agreement {agreement:.3f}, mean KL {kl:.5f}")
    assert agreement >= 0.85 and kl < 0.1  # measured: 0.934, 0.029


@pytest.mark.parametrize("backend", backends())
def test_quantization_flag_w8a8(llama, backend):
    """--quantization w8a8: int8 weights and int8 inputs for every linear layer but the LM head, which stays as it
    is; greedy equal to transformers doing the same arithmetic, and close to the unquantized model."""
    llm = make_llm(llama.path, backend, quantization="w8a8", enable_prefix_caching=False)
    model = llm.engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head]
    assert all(m.weight_scale is not None and m.quantize_activations for m in linears)
    assert model.lm_head.weight_scale is None and model.lm_head.weight.dtype == torch.float32
    reference = dequantized_copy(llama.hf_model, "w8a8")
    prompts = mixed_prompts()
    assert_greedy_matches_up_to_near_ties(reference, generate(llm, prompts))
    continued = [p + hf_greedy(llama.hf_model, p, MAX_NEW_TOKENS)[:-1] for p in prompts]
    agreement, kl = agreement_and_kl(llama.hf_model, reference, continued, [len(p) - 1 for p in prompts])
    print(f"w8a8 vs fp32 (teacher-forced): greedy agreement {agreement:.3f}, mean KL {kl:.5f}")
    assert agreement >= 0.8 and kl < 0.15


@pytest.mark.parametrize("arch", FLAG_ARCHS)
def test_quantization_flag_int8_per_family(arch, tmp_path):
    """--quantization int8 on each family's layers (biases, q/k norms, fused qkv and gate_up, Gemma's soft-capped
    head, OPT's layout): greedy equal to transformers on the same per-channel int8 weights."""
    checkpoint = build_checkpoint(arch, tmp_path)
    llm = make_llm(checkpoint.path, "ext", quantization="int8", enable_prefix_caching=False)
    assert all(m.weight_scale is not None for m in llm.engine.runner.model.modules() if isinstance(m, Linear))
    reference = dequantized_copy(checkpoint.hf_model, "int8")
    prompts = mixed_prompts()[:6]
    assert generate(llm, prompts) == [hf_greedy(reference, p, MAX_NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return build_checkpoint("qwen2-moe", tmp_path_factory.mktemp("moe-quant"))


@pytest.mark.parametrize("backend", backends())
def test_quantization_flag_int8_moe(moe, backend):
    """--quantization int8 on an MoE model: attention, the shared expert and its gate, the LM head in int8; the
    experts and the router as they were (transformers' experts are stacked weights, its router a plain weight,
    so the dequantised reference leaves them too); greedy equal to transformers on those weights."""
    llm = make_llm(moe.path, backend, quantization="int8", enable_prefix_caching=False)
    model = llm.engine.runner.model
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(b.experts.w13.dtype == torch.float32 and b.gate.weight_scale is None for b in blocks)
    dense = [m for m in model.modules() if isinstance(m, Linear) and not isinstance(m, Router)]
    assert all(m.weight_scale is not None for m in dense)
    reference = dequantized_copy(moe.hf_model, "int8")
    prompts = mixed_prompts()[:8]
    assert generate(llm, prompts) == [hf_greedy(reference, p, MAX_NEW_TOKENS) for p in prompts]


def test_quantized_experts_fail_clearly(moe, tmp_path):
    write_quantized(moe.path, tmp_path, "int8", ct_config())  # every projection, the experts' too
    with pytest.raises(ValueError, match=r"experts\.0\.down_proj\.weight_scale': quantized or biased MoE experts "
                                         "are not supported"):
        make_llm(str(tmp_path), "torch")


def test_quantization_flag_fp8(llama):
    """--quantization fp8 on CPU: fp8 per channel, dequantized at load (the CPU kernels have no fp8 path)."""
    llm = make_llm(llama.path, "ext", quantization="fp8", enable_prefix_caching=False)
    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, Linear)]
    assert all(m.weight_scale is None and m.weight.dtype == torch.float32 for m in linears)
    reference = dequantized_copy(llama.hf_model, "fp8")
    prompts = mixed_prompts()[:6]
    assert generate(llm, prompts) == [hf_greedy(reference, p, MAX_NEW_TOKENS) for p in prompts]


def edited(tmp_path, llama, config: dict | None = None, drop: str | None = None, weights: dict | None = None,
           **changes) -> str:
    """A quantized llama checkpoint with ``changes`` to its quantization_config (``config``: another one; its
    weights scheme updated with ``weights``) and the tensor ``drop`` left out."""
    config = config or ct_config(**(weights or {}))
    write_quantized(llama.path, tmp_path, "int8", config | changes)
    if drop is not None:
        file = os.path.join(tmp_path, "model.safetensors")
        tensors = load_file(file)
        del tensors[drop]
        save_file(tensors, file, metadata={"format": "pt"})
    return str(tmp_path)


BAD = {
    "method": (dict(quant_method="bitsandbytes"), "quant_method 'bitsandbytes' is not supported"),
    "bits": (dict(weights=dict(num_bits=2)), r"weights.num_bits = 2"),
    "4 bits unpacked": (dict(weights=dict(num_bits=4)), r"format = 'int-quantized' is not supported"),
    "group": (dict(weights=dict(strategy="group", group_size=128)), r"weights.strategy = 'group'"),
    "asymmetric": (dict(weights=dict(symmetric=False)), r"weights.symmetric = False"),
    "packed": (dict(format="pack-quantized"), r"format = 'pack-quantized'"),
    "kv cache": (dict(kv_cache_scheme={"num_bits": 8}), r"kv_cache_scheme"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_unsupported_quantization_config(llama, tmp_path, case):
    changes, message = BAD[case]
    with pytest.raises(ValueError, match=message):
        make_llm(edited(tmp_path, llama, **copy.deepcopy(changes)), "torch")


def test_block_wise_fp8_and_static_activations(llama, tmp_path):
    block = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match=r"weight_block_size = \[128, 128\]"):
        make_llm(edited(tmp_path / "block", llama, config=block), "torch")
    static = ct_config()
    static["config_groups"]["group_0"]["input_activations"]["dynamic"] = False
    with pytest.raises(ValueError, match=r"input_activations.dynamic = False"):
        make_llm(edited(tmp_path / "static", llama, config=static), "torch")


@pytest.mark.parametrize("tensor", ["model.layers.1.self_attn.k_proj.weight_scale",
                                    "model.layers.0.mlp.down_proj.weight_scale"])
def test_missing_scale_tensor(llama, tmp_path, tensor):
    """A fused layer's part (k of q|k|v) or a whole layer without its scales."""
    with pytest.raises(ValueError, match=tensor.replace(".", r"\.")):
        make_llm(edited(tmp_path, llama, drop=tensor), "torch")


def test_quantized_weights_without_config(llama, tmp_path):
    path = edited(tmp_path, llama)
    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    del hf["quantization_config"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match=r"_proj.weight' is I8, but .* does not quantize it"):
        make_llm(path, "torch")


def test_unquantized_weight_of_a_quantized_layer(llama, tmp_path):
    with pytest.raises(ValueError, match=r"'lm_head.weight' is F32, but .* quantizes it to torch.int8"):
        make_llm(edited(tmp_path, llama, ignore=[]), "torch")


def test_flag_must_match_the_checkpoint(int8_checkpoint):
    with pytest.raises(ValueError, match="quantization='fp8', but .* describes w8a8"):
        make_llm(int8_checkpoint[0], "torch", quantization="fp8")
    with pytest.raises(ValueError, match="quantization='int8', but .* describes w8a8"):
        make_llm(int8_checkpoint[0], "torch", quantization="int8")
