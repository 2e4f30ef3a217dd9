"""The built-in demo checkpoint: a small random-weight Llama with a byte-level tokenizer.

It is a real Hugging Face folder (``transformers.AutoModelForCausalLM`` and
``AutoTokenizer`` load it), written without importing transformers so it takes
well under a second. It generates noise: the weights are random.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

DEFAULT_DIR = os.path.join(os.path.expanduser("~"), ".cache", "pagedserve", "demo-model")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256, 257, 258
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
DEMO_VERSION = "2"
SEED = 1234
HIDDEN, LAYERS, HEADS, KV_HEADS, INTERMEDIATE, MAX_POSITIONS = 256, 4, 4, 2, 688, 2048
VOCAB = 256 + len(SPECIAL_TOKENS)
EOS_ID = 256 + SPECIAL_TOKENS.index("<|im_end|>")


def ensure_demo_model(path: str | None = None) -> str:
    """Write the demo model once (``PAGEDSERVE_DEMO_MODEL_DIR`` overrides the default folder); return its folder."""
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
    """Write into a temporary sibling folder, then rename, so concurrent writers never see half a model."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".demo-model-", dir=parent)
    try:
        _write_config(tmp)
        _write_tokenizer(tmp)
        save_file(_random_weights(), os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
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


def _write_config(folder: str) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": None, "eos_token_id": EOS_ID, "pad_token_id": SPECIAL_TOKENS.index("<|endoftext|>") + 256,
        "torch_dtype": "float32",
    }
    _write_json(os.path.join(folder, "config.json"), config)
    _write_json(os.path.join(folder, "generation_config.json"), {"eos_token_id": EOS_ID, "bos_token_id": None})


def _write_tokenizer(folder: str) -> None:
    byte_chars = _bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    _write_json(os.path.join(folder, "tokenizer_config.json"), {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    })


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE convention: printable bytes map to themselves, the rest to code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}


def _random_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    head_dim = HIDDEN // HEADS
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
                   p + "self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
                   p + "self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
                   p + "self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
                   p + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
                   p + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
                   p + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE)}
    weights = {name: torch.randn(shape, generator=g) * 0.02 for name, shape in shapes.items()}
    norms = [f"model.layers.{i}.{n}.weight" for i in range(LAYERS) for n in ("input_layernorm", "post_attention_layernorm")]
    weights |= {name: torch.ones(HIDDEN) for name in [*norms, "model.norm.weight"]}
    return weights


def _make_readable(folder: str) -> None:
    # mkdtemp and safetensors create owner-only entries; the model is shared data.
    os.chmod(folder, 0o755)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o644)


def _write_json(file: str, data: dict) -> None:
    with open(file, "w") as f:
        json.dump(data, f, indent=2)
