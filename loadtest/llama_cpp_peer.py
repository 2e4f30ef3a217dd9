"""llama.cpp as a peer of ``bench_offline``: the same checkpoint written as GGUF, the same requests decoded with
llama.cpp's own batched decoding (one context whose KV cache holds every request at once, unified or one
stream per request, greedy sampling in C).

    pip install gguf llama-cpp-python   # the latter builds llama.cpp from source (~10 minutes on 2 cores)

``write_gguf`` converts a Llama or Qwen2 Hugging Face checkpoint the way llama.cpp's converter does: the same
tensor names, q/k rows permuted back to the interleaved rotary layout of llama.cpp's ``llama`` architecture
(Qwen2 keeps the neox layout), norms in fp32, the other tensors in the checkpoint's dtype. The random-weight
checkpoints have no tokenizer, so the GGUF carries a placeholder vocabulary of the right size; requests are fed
as token ids and never tokenized.

``run_llama_cpp`` drives the batch as llama.cpp's ``batched`` example does, with bench_offline's token budget:
each ``llama_decode`` carries one token for every decoding request, then prompt tokens (in chunks) up to the
budget; a finished request's cells are freed at once.
"""
from __future__ import annotations

import ctypes
import json
import os
import time
from dataclasses import dataclass

import torch
from safetensors import safe_open

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name (``model.layers.3.mlp.up_proj.weight`` ->
    ``blk.3.ffn_up.weight``)."""
    module, _, param = hf_name.rpartition(".")
    if module in _TOP_NAMES:
        return f"{_TOP_NAMES[module]}.{param}"
    if module.startswith("model.layers."):
        _, _, layer, rest = module.split(".", 3)
        if rest in _LAYER_NAMES:
            return f"blk.{layer}.{_LAYER_NAMES[rest]}.{param}"
    raise ValueError(f"no GGUF name for tensor {hf_name!r}")


def interleave_rotary(w: torch.Tensor, heads: int) -> torch.Tensor:
    """q/k projection rows from Hugging Face's rotate-half layout (each head: all first halves, then all
    second halves) to the interleaved pairs of llama.cpp's ``llama`` rotary: what its converter does."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def write_gguf(checkpoint: str, out: str) -> str:
    """Writes ``checkpoint`` (a folder with config.json and *.safetensors) as the GGUF file ``out``."""
    import gguf

    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    arch = ARCHITECTURES.get(config["architectures"][0])
    if arch is None:
        raise ValueError(f"llama.cpp peer: unsupported architecture {config['architectures'][0]!r}")
    writer = gguf.GGUFWriter(out, arch)
    _write_hparams(writer, config)
    _write_placeholder_vocab(writer, config["vocab_size"])
    for name, tensor in _tensors(checkpoint):
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else config["num_key_value_heads"]
            tensor = interleave_rotary(tensor, heads)
        _add_tensor(writer, gguf_name(name), tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_hparams(writer, config: dict) -> None:
    heads = config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads", heads))
    writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // heads)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(1 if config.get("torch_dtype", config.get("dtype")) == "bfloat16" else 0)


def _write_placeholder_vocab(writer, vocab_size: int) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(vocab_size)])
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types([1] * vocab_size)  # normal tokens


def _tensors(checkpoint: str):
    for file in sorted(f for f in os.listdir(checkpoint) if f.endswith(".safetensors")):
        with safe_open(os.path.join(checkpoint, file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _add_tensor(writer, name: str, tensor: torch.Tensor) -> None:
    import gguf

    if tensor.dtype == torch.bfloat16 and tensor.dim() > 1:  # bf16 bits as they are (numpy has no bf16)
        writer.add_tensor(name, tensor.contiguous().view(torch.int16).numpy(),
                          raw_shape=list(tensor.shape), raw_dtype=gguf.GGMLQuantizationType.BF16)
    else:  # fp32, and norms and biases in fp32 as llama.cpp's converter writes them
        writer.add_tensor(name, tensor.float().contiguous().numpy())


# The weight formats tried: the checkpoint's own dtype ("f": bf16 or f32 as written), and two of llama.cpp's
# quantizations made by its own quantizer (a K-quant falls back to another type per tensor whose rows are not a
# multiple of 256, as it does for the real checkpoints of these shapes).
WEIGHT_TYPES = {"f": None, "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def quantize_gguf(source: str, out: str, weights: str, threads: int) -> str:
    """``source`` quantized by llama.cpp's ``llama_model_quantize`` into ``out`` (``weights`` a WEIGHT_TYPES key)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, WEIGHT_TYPES[weights])
    params.nthread = threads
    if llama_cpp.llama_model_quantize(source.encode(), out.encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {weights}")
    return out


def write_ggufs(checkpoint: str, folder: str, weight_types: list[str], threads: int) -> dict[str, str]:
    """The checkpoint as a GGUF file per weight type: {type: path}."""
    plain = write_gguf(checkpoint, os.path.join(folder, "model-f.gguf"))
    return {w: plain if WEIGHT_TYPES[w] is None else quantize_gguf(plain, os.path.join(folder, f"model-{w}.gguf"),
                                                                    w, threads)
            for w in weight_types}


@dataclass(slots=True, frozen=True)
class LlamaCppSettings:
    threads: int
    flash_attn: bool
    # One KV buffer for all requests (attention then masks over every request's cells), or one stream per
    # request, each as long as the longest request.
    kv_unified: bool = True
    n_batch: int = 2048  # bench_offline's per-step token budget
    n_ubatch: int = 512
    weights: str = "f"  # a WEIGHT_TYPES key


class LlamaCppPeer:
    """The loaded GGUF models, one per weight type ({type: path}, or one path for the plain one); ``run`` times a
    workload in a fresh context sized to hold all of it."""

    def __init__(self, ggufs: dict[str, str] | str) -> None:
        import llama_cpp

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        llama_cpp.llama_log_set(_QUIET_LOG, ctypes.c_void_p())
        self.models = {w: self._load(path) for w, path in ({"f": ggufs} if isinstance(ggufs, str) else ggufs).items()}

    def _load(self, path: str):
        model = self.lib.llama_model_load_from_file(path.encode(), self.lib.llama_model_default_params())
        if not model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        return model

    def run(self, prompts: list[list[int]], output_lens: list[int], settings: LlamaCppSettings
            ) -> tuple[tuple[float, float], list[list[int]]]:
        """((wall, CPU) seconds, each request's greedy tokens)."""
        lib = self.lib
        ctx = lib.llama_init_from_model(self.models[settings.weights], self._context_params(prompts, output_lens, settings))
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        sampler = lib.llama_sampler_init_greedy()
        batch = lib.llama_batch_init(settings.n_batch, 0, 1)
        try:
            start, cpu_start = time.perf_counter(), time.process_time()
            outputs = _decode_all(lib, ctx, batch, sampler, prompts, output_lens, settings.n_batch)
            return (time.perf_counter() - start, time.process_time() - cpu_start), outputs
        finally:
            lib.llama_batch_free(batch)
            lib.llama_sampler_free(sampler)
            lib.llama_free(ctx)

    def _context_params(self, prompts, output_lens, settings: LlamaCppSettings):
        lib = self.lib
        params = lib.llama_context_default_params()
        lengths = [len(p) + n for p, n in zip(prompts, output_lens)]
        params.n_ctx = sum(lengths) + 256 if settings.kv_unified else len(lengths) * (max(lengths) + 256)
        params.n_batch, params.n_ubatch = settings.n_batch, settings.n_ubatch
        params.n_seq_max = len(prompts)
        params.n_threads = params.n_threads_batch = settings.threads
        params.kv_unified = settings.kv_unified
        params.flash_attn_type = (lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if settings.flash_attn
                                  else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        params.no_perf = True
        return params

    def close(self) -> None:
        for model in self.models.values():
            self.lib.llama_model_free(model)


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET_LOG(level, text, user_data):  # noqa: N802 - a C callback; llama.cpp logs every load otherwise
    return None


def _decode_all(lib, ctx, batch, sampler, prompts: list[list[int]], output_lens: list[int], budget: int
                ) -> list[list[int]]:
    """Every request to its output length: each step, one token per decoding request, then prompt chunks."""
    memory = lib.llama_get_memory(ctx)
    fed = [0] * len(prompts)  # prompt tokens in the cache
    outputs: list[list[int]] = [[] for _ in prompts]
    active = set(range(len(prompts)))
    while active:
        n, sample_rows = 0, []
        for s in sorted(active):
            if fed[s] == len(prompts[s]):
                n = _add(batch, n, outputs[s][-1], fed[s] + len(outputs[s]) - 1, s, True)
                sample_rows.append((s, n - 1))
        for s in sorted(active):
            take = min(budget - n, len(prompts[s]) - fed[s])
            if take <= 0 or fed[s] == len(prompts[s]):
                continue
            for i in range(fed[s], fed[s] + take):
                n = _add(batch, n, prompts[s][i], i, s, i == len(prompts[s]) - 1)
            fed[s] += take
            if fed[s] == len(prompts[s]):
                sample_rows.append((s, n - 1))
        batch.n_tokens = n
        if lib.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for s, row in sample_rows:
            outputs[s].append(lib.llama_sampler_sample(sampler, ctx, row))
            if len(outputs[s]) == output_lens[s]:
                active.discard(s)
                lib.llama_memory_seq_rm(memory, s, -1, -1)
    return outputs


def _add(batch, n: int, token: int, pos: int, seq: int, logits: bool) -> int:
    batch.token[n], batch.pos[n], batch.n_seq_id[n], batch.logits[n] = token, pos, 1, logits
    batch.seq_id[n][0] = seq
    return n + 1
