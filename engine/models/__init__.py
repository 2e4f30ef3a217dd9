"""Model families, looked up by the checkpoint's ``architectures`` entry. ``FAMILIES`` is also what the README's
model table is generated from (``python -m tests.model_table --write``)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from engine.models.deepseek import DeepseekV3ForCausalLM
from engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from engine.models.gemma3_vl import Gemma3ForConditionalGeneration
from engine.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from engine.models.gpt_oss import GptOssForCausalLM
from engine.models.llama import LlamaForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from engine.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from engine.models.opt import OPTForCausalLM
from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from engine.models.qwen3_vl import Qwen3VLForConditionalGeneration
from engine.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM


_MOE_TP = "tp shards each expert's intermediate size"
_MOE_UNQUANTIZED = "experts, router"


@dataclass(frozen=True, slots=True)
class ModelFamily:
    name: str
    classes: dict[str, type[nn.Module]]  # config.json ``architectures`` entry -> the engine's model
    sliding_window: str = ""  # how the family's windows are laid out; "" = none
    moe: str = ""  # how experts are routed and sharded; "" = dense
    tensor_parallel: bool = True
    unquantized: str = ""  # layers --quantization leaves as they are (and a checkpoint may not quantize)
    vision: str = ""  # the image input it takes (engine/multimodal); "" = text only


FAMILIES: tuple[ModelFamily, ...] = (
    ModelFamily("Llama 2/3/3.1, TinyLlama, Mistral", {"LlamaForCausalLM": LlamaForCausalLM,
                                                      "MistralForCausalLM": LlamaForCausalLM},
                sliding_window="Mistral's `sliding_window`, every layer"),
    ModelFamily("Qwen2, Qwen2.5", {"Qwen2ForCausalLM": Qwen2ForCausalLM},
                sliding_window="`use_sliding_window` from `max_window_layers` on"),
    ModelFamily("Qwen2.5-VL", {"Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration},
                tensor_parallel=False, unquantized="vision tower",
                vision="images (window-attention ViT, encoder cache, M-RoPE)"),
    ModelFamily("Qwen3", {"Qwen3ForCausalLM": Qwen3ForCausalLM},
                sliding_window="`use_sliding_window` from `max_window_layers` on"),
    ModelFamily("Qwen3-VL (dense)", {"Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration},
                tensor_parallel=False, unquantized="vision tower",
                vision="images (ViT with DeepStack, encoder cache, interleaved M-RoPE)"),
    ModelFamily("Phi-3, Phi-3.5, Phi-4-mini", {"Phi3ForCausalLM": Phi3ForCausalLM},
                sliding_window="`sliding_window`, every layer"),
    ModelFamily("Gemma 2", {"Gemma2ForCausalLM": Gemma2ForCausalLM},
                sliding_window="alternating local / global layers"),
    ModelFamily("Gemma 3 (text)", {"Gemma3ForCausalLM": Gemma3ForCausalLM},
                sliding_window="5 local : 1 global (`layer_types`)"),
    ModelFamily("Gemma 3 (vision)", {"Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration},
                sliding_window="5 local : 1 global (`layer_types`)", tensor_parallel=False,
                unquantized="vision tower, projector",
                vision="images (SigLIP, one fixed square, no pan-and-scan; an image's tokens attend both ways)"),
    ModelFamily("Gemma 4 (text; the multimodal checkpoints' text model)",
                {"Gemma4ForCausalLM": Gemma4ForCausalLM,
                 "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration},
                sliding_window="`layer_types`; KV shared by the last `num_kv_shared_layers`",
                moe="`enable_moe_block`: softmax top-k renormalised, per-expert scales, GELU-tanh experts beside the "
                    "dense MLP; " + _MOE_TP, unquantized=_MOE_UNQUANTIZED),
    ModelFamily("Mixtral", {"MixtralForCausalLM": MixtralForCausalLM},
                sliding_window="`sliding_window`, every layer",
                moe="softmax, top-k renormalised; " + _MOE_TP, unquantized=_MOE_UNQUANTIZED),
    ModelFamily("Qwen2-MoE (Qwen1.5-MoE)", {"Qwen2MoeForCausalLM": Qwen2MoeForCausalLM},
                sliding_window="`layer_types`, else `use_sliding_window` from `max_window_layers` on",
                moe="softmax, top-k (`norm_topk_prob`), sigmoid-gated shared expert; " + _MOE_TP,
                unquantized=_MOE_UNQUANTIZED),
    ModelFamily("Qwen3-MoE", {"Qwen3MoeForCausalLM": Qwen3MoeForCausalLM},
                sliding_window="`use_sliding_window` from `max_window_layers` on",
                moe="softmax, top-k (`norm_topk_prob`), dense `mlp_only_layers`; " + _MOE_TP,
                unquantized=_MOE_UNQUANTIZED),
    ModelFamily("Qwen3-Next (hybrid)", {"Qwen3NextForCausalLM": Qwen3NextForCausalLM},
                sliding_window="Gated DeltaNet layers (`layer_types`): a recurrent state per sequence, no K/V",
                moe="softmax, top-k (`norm_topk_prob`), sigmoid-gated shared expert; " + _MOE_TP,
                unquantized=_MOE_UNQUANTIZED),
    ModelFamily("Qwen3.5 (text, hybrid)", {"Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
                                           "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM},
                sliding_window="Gated DeltaNet layers (`layer_types`): a recurrent state per sequence, no K/V",
                moe="MoE variant: softmax, top-k renormalised, sigmoid-gated shared expert; " + _MOE_TP,
                unquantized=_MOE_UNQUANTIZED),
    ModelFamily("gpt-oss", {"GptOssForCausalLM": GptOssForCausalLM},
                sliding_window="alternating sliding / full layers (`layer_types`), attention sinks",
                moe="top-k logits softmaxed, biased experts, clamped SwiGLU; " + _MOE_TP, unquantized=_MOE_UNQUANTIZED),
    ModelFamily("DeepSeek-V3, Kimi-K2", {"DeepseekV3ForCausalLM": DeepseekV3ForCausalLM},
                moe="sigmoid, grouped top-k with a selection bias, shared experts, dense first layers; " + _MOE_TP,
                unquantized=_MOE_UNQUANTIZED + ", latent up-projection (`kv_b_proj`)"),
    ModelFamily("OPT", {"OPTForCausalLM": OPTForCausalLM}),
)
MODEL_REGISTRY: dict[str, type[nn.Module]] = {arch: cls for family in FAMILIES for arch, cls in family.classes.items()}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")
    return MODEL_REGISTRY[architecture]
