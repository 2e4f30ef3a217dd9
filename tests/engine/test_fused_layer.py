"""The compiled decoder layer (``llama_decoder_layer``, CPU) against the model's own Python forward: the same
hidden states and KV cache, bit for bit, over a varlen prefill and a decode step."""
from __future__ import annotations

import pytest
import torch

import cuda_ext
from engine.layers.attention import AttentionMetadata
from engine.loader import load_model
from engine.models.config import read_model_config

from .conftest import build_checkpoint

BLOCK = 16


def _meta(positions: list[list[int]], tables: list[list[int]]) -> tuple[torch.Tensor, AttentionMetadata]:
    """Each sequence's positions this step (contiguous, ending at its context length) and block table."""
    flat = [p for seq in positions for p in seq]
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for seq, table in zip(positions, tables) for p in seq]
    starts = [0]
    for seq in positions:
        starts.append(starts[-1] + len(seq))
    seq_lens = [seq[-1] + 1 for seq in positions]
    meta = AttentionMetadata(torch.tensor(slots), torch.tensor(tables, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                             max(len(seq) for seq in positions), max(seq_lens))
    return torch.tensor(flat), meta


def _run(model, kv: torch.Tensor, fused: list, steps, vocab: int,
         scales: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The model's hidden states for each step, with the given per-layer ``fused`` and KV pool ``kv`` (and the
    scale pool of a quantized ``kv``)."""
    ops = cuda_ext.load_ops("ext")
    for i, (layer, f) in enumerate(zip(model.model.layers, fused)):
        layer.fused = f
        layer.self_attn.attn.bind(ops, kv[:, i, 0], kv[:, i, 1], *(() if scales is None else scales[:, i].unbind(1)))
    gen = torch.Generator().manual_seed(1)
    outs = []
    with torch.inference_mode():
        for positions, meta in steps:
            ids = torch.randint(vocab, (positions.numel(),), generator=gen)
            outs.append(model(ids, positions, meta))
    return outs


KV_DTYPES = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
CASES = [(arch, dtype, None, kv) for arch in ("llama", "qwen2", "qwen3") for dtype in (torch.float32, torch.bfloat16)
         for kv in KV_DTYPES]


@pytest.mark.parametrize("arch, dtype, quantization, kv", CASES + [("qwen2", torch.bfloat16, "w8a8", "auto"),
                                                                   ("qwen3", torch.float32, "w8a8", "int8"),
                                                                   ("qwen2", torch.bfloat16, "int4", "auto"),
                                                                   ("llama", torch.float32, "int4-asym", "int8")])
def test_fused_layer_is_bit_identical_to_the_python_forward(tmp_path, arch, dtype, quantization, kv):
    """Also with W8A8 or 4-bit linear layers, and over a quantized KV cache (``kv``: its codes, with a bf16 scale
    pool beside them)."""
    kv_dtype = KV_DTYPES[kv]
    cuda_ext.load_ops("ext")
    if not torch.ops.pagedserve.skinny_linear_supports(dtype):
        pytest.skip(f"{dtype} layers stay on F.linear here (no AVX512-BF16)")
    if quantization == "w8a8" and not torch.ops.pagedserve.skinny_linear_w8a8_supports():
        pytest.skip("W8A8 layers stay on F.linear here (no AVX512-VNNI)")
    if quantization and quantization.startswith("int4") and not torch.ops.pagedserve.skinny_linear_w4_supports():
        pytest.skip("4-bit layers stay on F.linear here (no AVX-512)")
    config = read_model_config(build_checkpoint(arch, tmp_path).path)
    model = load_model(config, torch.device("cpu"), dtype, cuda_ext.load_ops("ext"), False, quantization=quantization)
    with torch.no_grad():  # norms away from their initial ones (and biases), so a swapped weight would show
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    fused = [layer.fused for layer in model.model.layers]
    assert all(f is not None for f in fused)
    tables = [[0, 3], [1, 2]]
    steps = [_meta([list(range(5)), list(range(20))], tables),  # prefill of two lengths (the first layer's input
             _meta([[5], [20]], tables),                       # norm without an add, then decode steps
             _meta([[6], [21]], tables)]
    attn = model.model.layers[0].self_attn.attn
    shape = (4, config.num_layers, 2, attn.num_kv_heads, BLOCK, config.head_dim)
    kv_fused, kv_python = (torch.zeros(shape, dtype=kv_dtype or dtype) for _ in range(2))
    scales_fused, scales_python = (None, None) if kv_dtype is None else (
        torch.zeros(shape[:-1], dtype=torch.bfloat16) for _ in range(2))
    want = _run(model, kv_python, [None] * len(fused), steps, config.vocab_size, scales_python)
    got = _run(model, kv_fused, fused, steps, config.vocab_size, scales_fused)
    for g, w in zip(got, want):
        assert g.dtype == dtype and torch.equal(g, w)
    assert torch.equal(kv_fused.view(torch.uint8) if kv_dtype else kv_fused,
                       kv_python.view(torch.uint8) if kv_dtype else kv_python)
    if kv_dtype is not None:
        assert torch.equal(scales_fused, scales_python) and scales_fused.count_nonzero()


def test_weight_only_int8_keeps_the_python_forward(tmp_path):
    config = read_model_config(build_checkpoint("llama", tmp_path).path)
    model = load_model(config, torch.device("cpu"), torch.float32, cuda_ext.load_ops("ext"), False, quantization="int8")
    assert all(layer.fused is None for layer in model.model.layers)


def test_the_reference_backend_keeps_the_python_forward(tmp_path):
    config = read_model_config(build_checkpoint("llama", tmp_path).path)
    model = load_model(config, torch.device("cpu"), torch.float32, cuda_ext.load_ops("torch"), False)
    assert all(layer.fused is None for layer in model.model.layers)


def test_fused_layer_rejects_a_wrong_weight_list():
    cuda_ext.load_ops("ext")
    x = torch.zeros(1, 8)
    with pytest.raises(RuntimeError, match="takes 6 weights"):
        torch.ops.pagedserve.llama_decoder_layer(x, None, [x], [None] * 6, [1] * 7, torch.zeros(1, dtype=torch.long),
                                                 x, x, x, x, torch.zeros(1, dtype=torch.long), x, x, x, 1, 1, 1e-6, 1.0)
