"""Model families, looked up by the checkpoint's ``architectures`` entry."""
from __future__ import annotations

from torch import nn

from engine.models.llama import LlamaForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from engine.models.opt import OPTForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "OPTForCausalLM": OPTForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(sorted(MODEL_REGISTRY))}")
    return MODEL_REGISTRY[architecture]
