"""Random-weight vision-language checkpoints built locally (the tests' tiny ones, or bench_vision's larger ones): a
Qwen2.5-VL or Qwen3-VL with its image processor (Qwen2VLImageProcessor, the config's patch size: 8 pixels for the
tiny Qwen2.5-VL, 16 for Qwen3-VL as its checkpoints have it), or a Gemma 3 with its (Gemma3ImageProcessor, a
56-pixel square image, no pan-and-scan), and beside it a character tokenizer with the family's special tokens and
a chat template in its style; and transformers' greedy generation on (prompt, images), the reference."""
from __future__ import annotations

import base64
import io

import numpy as np
import torch
import transformers
from PIL import Image
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

VOCAB = 300
IMAGE, VIDEO, VISION_START, VISION_END, IM_START, IM_END = range(290, 296)
SPECIALS = ["<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>"]
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
DEEPSTACK_SCALE = 8.0
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}"
    "{{ p.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Gemma 3's: the template writes <start_of_image> per image, which its processor wraps in "\n\n" and fills with
# mm_tokens_per_image <image_soft_token>s; newline runs are one token each, as in Gemma's vocabulary.
GEMMA_SPECIALS = ["<image_soft_token>", "<start_of_image>", "<end_of_image>", "<start_of_turn>", "<end_of_turn>"]
GEMMA_IMAGE, BOI, EOI = range(IMAGE, IMAGE + 3)
GEMMA_PLACEHOLDER = "<start_of_image>"
GEMMA_CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content %}{% if p.type == 'image' %}<start_of_image>{% else %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
    "{% endif %}")


def vl_config(layers: int = 2, heads: int = 2, depth: int = 2, vision_hidden: int = 32
              ) -> transformers.Qwen2_5_VLConfig:
    """By default two text layers (head_dim 64, M-RoPE sections 8/12/12), a two-block tower (the last block full
    attention, the others in 32-pixel windows: 2 x 2 merged cells)."""
    text = dict(vocab_size=VOCAB, hidden_size=64 * heads, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=1, intermediate_size=128 * heads, max_position_embeddings=2048,
                initializer_range=0.3, bos_token_id=None, eos_token_id=None, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]})
    vision = dict(depth=depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=2,
                  patch_size=8, spatial_merge_size=2, temporal_patch_size=2, window_size=32,
                  out_hidden_size=64 * heads, fullatt_block_indexes=[depth - 1], initializer_range=0.3)
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                         video_token_id=VIDEO, vision_start_token_id=VISION_START,
                                         vision_end_token_id=VISION_END, tie_word_embeddings=False)


def qwen3_vl_config(layers: int = 3, heads: int = 2, depth: int = 3, vision_hidden: int = 32
                    ) -> transformers.Qwen3VLConfig:
    """By default three text layers (head_dim 64, interleaved M-RoPE sections 12/10/10), a three-block tower with
    16-pixel patches, a 4 x 4 learned position grid (resampled to every image) and DeepStack from its first two
    blocks (added after the first two text layers)."""
    text = dict(vocab_size=VOCAB, hidden_size=64 * heads, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=1, head_dim=64, intermediate_size=128 * heads, max_position_embeddings=2048,
                initializer_range=0.3, pad_token_id=0,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10],
                                 "mrope_interleaved": True})
    vision = dict(depth=depth, hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=2,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64 * heads,
                  num_position_embeddings=16, deepstack_visual_indexes=[0, 1], initializer_range=0.3)
    return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE,
                                      video_token_id=VIDEO, vision_start_token_id=VISION_START,
                                      vision_end_token_id=VISION_END, tie_word_embeddings=False)


def gemma3_vl_config(layers: int = 2, heads: int = 2, depth: int = 2, vision_hidden: int = 32
                     ) -> transformers.Gemma3Config:
    """By default two text layers (a sliding one of window 8, shorter than an image's 16 tokens, then a global one;
    more alternate), a SigLIP tower on 56-pixel images of 7-pixel patches (8 x 8), pooled to 4 x 4 = 16 image tokens."""
    text = dict(vocab_size=VOCAB, hidden_size=32 * heads, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=1, head_dim=32, intermediate_size=64 * heads, max_position_embeddings=2048,
                sliding_window=8, layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
                query_pre_attn_scalar=32, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    vision = dict(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_hidden_layers=depth,
                  num_attention_heads=2, image_size=56, patch_size=7, vision_use_head=False)
    return transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=16,
                                     image_token_index=GEMMA_IMAGE, boi_token_index=BOI, eoi_token_index=EOI)


# the model table's (tests/model_table.py)
VL_CONFIGS = {"qwen2.5-vl": vl_config, "qwen3-vl": qwen3_vl_config, "gemma3-vl": gemma3_vl_config}


def build_vl_checkpoint(folder, config: transformers.PretrainedConfig | None = None) -> transformers.PreTrainedModel:
    """``config``: a Qwen2.5-VL (by default ``vl_config()``), Qwen3-VL or Gemma 3 one."""
    config = config or vl_config()
    gemma = isinstance(config, transformers.Gemma3Config)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    with torch.no_grad():  # the towers' norms start at 1 (Gemma's projector at 0): drawn, so they count
        for name, param in model.named_parameters():
            if name.startswith(("model.visual", "model.vision_tower")) and name.endswith("weight") and param.dim() == 1:
                param.normal_(1.0, 0.5)
            elif name.startswith("model.multi_modal_projector") or (gemma and name.endswith("norm.weight")):
                param.normal_(0.0, 0.5)  # Gemma's norms scale by 1 + weight
            if "deepstack_merger_list" in name and "linear_fc2" in name:  # as large as the hidden states they join
                param.mul_(DEEPSTACK_SCALE)
    model.save_pretrained(folder)
    if gemma:
        transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(folder)
    else:
        patch = model.config.vision_config.patch_size  # images up to 16 x 16 patches
        transformers.Qwen2VLImageProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2,
                                           size={"shortest_edge": 256, "longest_edge": (16 * patch) ** 2}
                                           ).save_pretrained(folder)
    _char_tokenizer(gemma).save_pretrained(folder)
    return model


def _char_tokenizer(gemma: bool) -> transformers.PreTrainedTokenizerFast:
    """One token per character (Gemma: a run of newlines is one token), the family's special tokens after."""
    chars = [chr(c) for c in range(32, 127)] + ["\n" * n for n in range(1, 9 if gemma else 2)]
    specials = GEMMA_SPECIALS if gemma else SPECIALS
    vocab = {p: i for i, p in enumerate(chars + [f"<x{i}>" for i in range(IMAGE - len(chars))])}
    tok = Tokenizer(models.WordLevel(vocab | {s: IMAGE + i for i, s in enumerate(specials)}, unk_token="<x0>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("\n+|." if gemma else "."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters decode back to the text, without spaces between
    tok.add_special_tokens(specials)
    if not gemma:
        return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=CHAT_TEMPLATE)
    named = {"image_token": specials[0], "boi_token": specials[1], "eoi_token": specials[2]}  # Gemma3Processor's
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=GEMMA_CHAT_TEMPLATE,
                                                extra_special_tokens=named)


def image(seed: int, width: int = 64, height: int = 80) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def data_url(img: Image.Image, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


@torch.inference_mode()
def hf_vl_greedy(model, path: str, text: str, images: list[Image.Image], max_new_tokens: int) -> list[int]:
    """transformers' own pipeline on one prompt: its image processor, placeholders expanded as its processor
    does (one per embedding row), generate with the image inputs."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    if model.config.model_type == "gemma3":
        return _hf_gemma3_greedy(model, path, tokenizer, text, images, max_new_tokens)
    ids = tokenizer(text).input_ids
    kwargs = {}
    if images:
        processed = transformers.AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
        rows = iter((processed["image_grid_thw"].prod(-1) // 4).tolist())
        ids = [t for token in ids for t in ([token] * next(rows) if token == IMAGE else [token])]
        kwargs = dict(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"])
    input_ids = torch.tensor([ids])
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=0,
                         mm_token_type_ids=(input_ids == IMAGE).int(), **kwargs)
    return out[0, len(ids):].tolist()


def _hf_gemma3_greedy(model, path: str, tokenizer, text: str, images: list[Image.Image], max_new_tokens: int
                      ) -> list[int]:
    """Gemma3Processor's own expansion (on the text) and token types: an image's tokens attend both ways."""
    processor = transformers.Gemma3Processor(transformers.AutoImageProcessor.from_pretrained(path), tokenizer,
                                             image_seq_length=model.config.mm_tokens_per_image)
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
