"""The engine's one configuration object, as the user writes it (the engine never writes to it).
Each field declares its valid values once (``spec``); one with a ``help`` is a command-line
option (service/flags.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.field_specs import check_fields, spec

PreemptionMode = Literal["recompute", "swap"]
AttentionBackend = Literal["ext", "torch"]
AttentionKernel = Literal["simple", "split"]
KVCacheDtypeName = Literal["auto", "int8", "fp8"]
KVAllocatorName = Literal["paged", "contiguous-max", "contiguous-pow2", "contiguous-oracle"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs; validated in ``__post_init__``.

    ``model``, ``max_model_len``, ``num_device_blocks`` and ``num_cpu_blocks`` may
    be left ``None``: ``engine.resolved_config.resolve_config`` settles them (the
    demo model; the checkpoint's context length; block counts from
    ``kv_cache_memory_bytes``, or ``kv_cache_memory_fraction`` of available memory,
    and ``swap_space_bytes``) into a separate frozen ``ResolvedConfig``.
    """

    model: str | None = spec(help="Hugging Face checkpoint folder (default: the built-in demo model, which "
                                  "generates noise)", group="model")
    tokenizer: str | None = None
    block_size: int = spec(16, help="KV block size in tokens", choices=(8, 16, 32, 64, 128))
    num_device_blocks: int | None = spec(low=1, help="KV blocks on the device (overrides the memory options)")
    num_cpu_blocks: int | None = spec(low=0)
    kv_cache_memory_bytes: int | None = spec(low=1, help="KV cache size (default: a fraction of free memory)")
    kv_cache_memory_fraction: float = spec(0.5, low=0, high=1, low_open=True,
                                           help="share of free memory for the KV cache")
    swap_space_bytes: int = spec(0, low=0, help="CPU swap space for preempted sequences")
    max_num_seqs: int = spec(256, low=1, help="sequences per batch")
    max_num_batched_tokens: int = spec(2048, low=1, help="tokens per step")
    max_model_len: int | None = spec(low=1, help="context length (default: the checkpoint's)", group="model")
    enable_prefix_caching: bool = spec(True, help="disable prefix caching", flag="--no-prefix-caching")
    enable_chunked_prefill: bool = spec(True, help="disable chunked prefill", flag="--no-chunked-prefill")
    preemption_mode: PreemptionMode = spec("recompute", help="what to do with a preempted sequence")
    dtype: str = spec("auto", help="weights/activations dtype (auto, float32, bfloat16, float16)")
    quantization: str | None = spec(choices=(None, "int8", "w8a8", "fp8", "int4", "int4-asym"),
                                    help="quantize the linear layers' weights at load, per output channel (w8a8: "
                                         "their inputs per row too, int8 on AVX512-VNNI CPUs; int4: 4-bit weights "
                                         "per group of input columns, symmetric or with zero points (int4-asym); "
                                         "a checkpoint's own quantization_config (AWQ, GPTQ, compressed-tensors) "
                                         "needs no flag)")
    quantization_group_size: int = spec(128, choices=(32, 64, 128), help="input columns per int4 scale")
    kv_cache_dtype: KVCacheDtypeName = spec("auto", help="KV cache elements: auto (the model's dtype), or int8 / "
                                                         "fp8 (e4m3) with a scale per token and KV head, ~2x the "
                                                         "tokens of bf16 in the same memory")
    device: str = spec("cpu", help="torch device")
    attention_backend: AttentionBackend = spec("ext", help="paged attention implementation")
    attention_kernel: AttentionKernel = spec("simple", help="CUDA paged attention kernel: simple (a CTA per query "
                                                            "row and head) or split (flash-decoding partitions, "
                                                            "tensor-core prefill tiles)")
    kv_allocator: KVAllocatorName = spec("paged", help="KV allocator (paged, or the paper's contiguous baselines)")
    enforce_eager: bool = spec(False, help="run every step eagerly: no CUDA graphs for decode-only steps")
    async_scheduling: bool = spec(False, help="schedule and prepare the next step, and process this step's "
                                              "outputs, while its forward pass runs (docs/engine.md)")
    seed: int = spec(0, help="engine sampling seed")
    num_threads: int | None = spec(help="torch CPU threads")
    tensor_parallel_size: int = spec(1, low=1, help="split the model across this many processes (one GPU each on "
                                                    "CUDA; gloo on CPU), sharing one scheduler and block table")
    max_grammar_bytes: int = spec(64 << 20, low=1, help="largest compiled structured-output grammar; a request "
                                                        "over it fails alone")
    speculative_method: str | None = spec(choices=(None, "ngram", "draft"),
                                          help="speculative decoding: propose tokens by n-gram lookup in the "
                                               "sequence (ngram) or with a small draft model (draft), verified in "
                                               "the batched forward pass; output exactly as without (docs/engine.md)")
    num_speculative_tokens: int = spec(4, low=1, high=16, help="tokens proposed per sequence and step")
    speculative_model: str | None = spec(help="the draft model's checkpoint (speculative_method=draft), with the "
                                              "model's tokenizer")
    ngram_prompt_lookup_max: int = spec(4, low=1, help="longest suffix n-gram the ngram proposer looks up")
    ngram_prompt_lookup_min: int = spec(2, low=1, help="shortest suffix n-gram the ngram proposer looks up")
    num_state_snapshots: int | None = spec(low=0, help="hybrid recurrent-state models (Qwen3-Next, Qwen3.5): "
                                                        "state snapshots kept for prefix-cache hits, each as "
                                                        "large as one sequence's state (default: max_num_seqs)")
    max_num_encoder_tokens: int | None = spec(low=1, help="image embedding rows the vision tower encodes per step "
                                                          "(default: max_num_batched_tokens; a larger image runs "
                                                          "in a step of its own)")
    encoder_cache_tokens: int = spec(16384, low=1, help="image embedding rows the encoder cache keeps "
                                                       "(vision-language models; an image's rows stay while a step "
                                                       "needs them)")
    show_progress: bool = True  # LLM.generate's progress bar; a server shows none

    def __post_init__(self) -> None:
        check_fields(self)
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling needs tensor_parallel_size=1 (the ranks run the plans as rank 0 "
                             "sends them, with every input id known)")
        if (self.speculative_method == "draft") != (self.speculative_model is not None):
            raise ValueError("speculative_model goes with speculative_method='draft', and only with it")
        if self.ngram_prompt_lookup_min > self.ngram_prompt_lookup_max:
            raise ValueError("ngram_prompt_lookup_min must be <= ngram_prompt_lookup_max")

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        """The speculative decoding settings, None when off."""
        if self.speculative_method is None:
            return None
        return SpeculativeConfig(method=self.speculative_method, num_speculative_tokens=self.num_speculative_tokens,
                                 model=self.speculative_model, prompt_lookup_min=self.ngram_prompt_lookup_min,
                                 prompt_lookup_max=self.ngram_prompt_lookup_max)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str  # "ngram" or "draft"
    num_speculative_tokens: int  # k: the most tokens proposed per sequence and step
    model: str | None  # the draft model's checkpoint
    prompt_lookup_min: int
    prompt_lookup_max: int
