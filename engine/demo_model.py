"""The built-in demo checkpoint: a small Llama trained on templated dialogues, shipped in the package.

``engine/demo/checkpoint`` holds it (weights stored in bf16, run in fp32 as ``config.json`` says); the recipe
that made it is ``python -m engine.demo.train`` (docs/demo_model.md). It answers sums, spells words and names
days and months; beyond that it knows nothing.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

CHECKPOINT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo", "checkpoint")
DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", "demo-model")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
# ChatML as Qwen2.5 / Qwen3 write it: plain messages as <|im_start|>role\ncontent<|im_end|>; with tools, a system
# turn listing them in <tools></tools> (Hermes style), an assistant's calls as <tool_call>{json}</tool_call>,
# tool results as <tool_response> inside a user turn; enable_thinking=false closes an empty <think> block.
CHAT_TEMPLATE = "".join([
    "{%- set first_is_system = messages and messages[0]['role'] == 'system' -%}",
    "{%- if tools -%}",
    "{{- '<|im_start|>system\\n' -}}",
    "{%- if first_is_system -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}",
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'",
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}",
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}",
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments '",
    " + 'within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'",
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' -}}",
    "{%- endif -%}",
    "{%- for message in messages -%}",
    "{%- if tools and loop.first and first_is_system -%}",
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') -%}",
    "{{- '<|im_start|>assistant' -}}",
    "{%- if message['content'] -%}{{- '\\n' + message['content'] -}}{%- endif -%}",
    "{%- for call in message['tool_calls'] -%}",
    "{%- set call = call['function'] if call['function'] is defined else call -%}",
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['name'] + '\", \"arguments\": ' -}}",
    "{{- (call['arguments'] if call['arguments'] is string else call['arguments'] | tojson) + '}\\n</tool_call>' -}}",
    "{%- endfor -%}",
    "{{- '<|im_end|>\\n' -}}",
    "{%- elif message['role'] == 'tool' -%}",
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}",
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}",
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}",
    "{%- else -%}",
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}",
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- if add_generation_prompt -%}",
    "{{- '<|im_start|>assistant\\n' -}}",
    "{%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}",
    "{%- endif -%}",
])
# Written into the folder: a folder of an older version (another template, other weights) is rewritten.
DEMO_VERSION = "3"
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, MAX_POSITIONS = 256, 4, 4, 2, 688, 2048
VOCAB = 512
PAD_ID, EOS_ID = SPECIAL_TOKENS.index("<|endoftext|>"), SPECIAL_TOKENS.index("<|im_end|>")
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                    "model.safetensors")


def ensure_demo_model(path: str | None = None) -> str:
    """Install the demo model once (``PAGEDSERVE_DEMO_MODEL_DIR`` overrides the default folder); return its folder."""
    path = path or os.environ.get("PAGEDSERVE_DEMO_MODEL_DIR") or DEFAULT_DIR
    if not os.path.isfile(os.path.join(path, "model.safetensors")) or _version(path) != DEMO_VERSION:
        write_demo_model(path)
    return path


def _version(path: str) -> str | None:
    try:
        with open(os.path.join(path, "demo_version")) as f:
            return f.read().strip()
    except OSError:
        return None


def write_demo_model(path: str) -> str:
    """Copy the shipped checkpoint into a temporary sibling folder, then rename, so concurrent writers never
    see half a model."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-model-", dir=parent)
    try:
        for name in CHECKPOINT_FILES:
            shutil.copyfile(os.path.join(CHECKPOINT_DIR, name), os.path.join(tmp, name))
        with open(os.path.join(tmp, "demo_version"), "w") as f:
            f.write(DEMO_VERSION + "\n")
        _make_readable(tmp)
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    except OSError:
        # Lost a race with another writer: theirs is as good as ours.
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(path, "model.safetensors")):
            raise
    return path


def llama_config() -> dict:
    """The demo model's ``config.json``: fp32 compute (the weights are stored in bf16 to halve the file)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "torch_dtype": "float32",
    }


def save_checkpoint(folder: str, tokenizer: Tokenizer, weights: dict[str, torch.Tensor]) -> None:
    """A Hugging Face folder: config, ChatML tokenizer, and the weights rounded to bf16."""
    os.makedirs(folder, exist_ok=True)
    _write_json(os.path.join(folder, "config.json"), llama_config())
    _write_json(os.path.join(folder, "generation_config.json"), {"eos_token_id": EOS_ID, "bos_token_id": None})
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    _write_json(os.path.join(folder, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    })
    bf16 = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in weights.items()}
    save_file(bf16, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _make_readable(folder: str) -> None:
    # mkdtemp creates an owner-only folder; the model is shared data.
    os.chmod(folder, 0o755)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o644)


def _write_json(file: str, data: dict) -> None:
    with open(file, "w") as f:
        json.dump(data, f, indent=2)
