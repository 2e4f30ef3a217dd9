"""How close a quantized model stays to its unquantized self: teacher-forced next-token agreement, KL and the
log-likelihood of the unquantized model's greedy continuations, on transformers models (the engine's quantized
greedy equals transformers on the dequantised weights: tests/engine/test_quantization.py, test_int4.py).

    python -m loadtest.quant_quality   # the demo model and a random-weight checkpoint, every --quantization scheme
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import random
import tempfile

import torch
import torch.nn.functional as F
import transformers

from cuda_ext import reference
from engine import int4
from engine.demo_model import ensure_demo_model
from loadtest import output_path
from engine.quantization import LOAD_SCHEMES, dequantize, quantize


def dequantized_copy(model: transformers.PreTrainedModel, scheme: str, group_size: int = 128
                     ) -> transformers.PreTrainedModel:
    """``model`` with every linear weight (the LM head too, as ``--quantization`` does, but for ``w8a8``)
    replaced by its quantized-then-dequantised value (per output channel; int4 per group of ``group_size``
    input columns, a layer whose input size it does not divide left as it is, as the engine does); ``w8a8``: every
    linear layer but the LM head also rounds its input to the per-row int8 grid."""
    method, activations = LOAD_SCHEMES[scheme]
    copied = copy.deepcopy(model)
    head = copied.get_output_embeddings()
    with torch.no_grad():
        for layer in copied.modules():
            if isinstance(layer, torch.nn.Linear) and not (activations and layer is head
                                                           or method == "int4" and layer.in_features % group_size):
                layer.weight = torch.nn.Parameter(_round_trip(layer.weight, scheme, group_size), requires_grad=False)
    return quantize_activations(copied) if activations else copied


def _round_trip(weight: torch.Tensor, scheme: str, group_size: int) -> torch.Tensor:
    method = LOAD_SCHEMES[scheme][0]
    if method == "int4":
        return int4.dequantize(*int4.quantize(weight, group_size, scheme == "int4"), weight.dtype)
    return dequantize(*quantize(weight, method), weight.dtype)


def quantize_activations(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """``model`` (in place) with every linear layer but the LM head rounding its input to the per-row int8 grid
    first, as the engine's W8A8 layers do."""
    head = model.get_output_embeddings()
    for layer in model.modules():
        if isinstance(layer, torch.nn.Linear) and layer is not head:
            layer.register_forward_pre_hook(_fake_quantize_input)
    return model


def _fake_quantize_input(layer: torch.nn.Module, args: tuple) -> tuple:
    x = args[0]
    q, t = reference.quantize_rows(x.reshape(-1, x.shape[-1]))
    return ((q.float() * t).to(x.dtype).view(x.shape), *args[1:])


@torch.inference_mode()
def agreement_and_kl(model, quantized, sequences: list[list[int]], start: list[int] | None = None
                     ) -> tuple[float, float]:
    """Over every position of ``sequences`` (from ``start[i]`` on, else all): the share where ``quantized``'s
    next-token argmax is ``model``'s, and the mean KL(model || quantized) of their next-token distributions."""
    quality = quality_report(model, quantized, sequences, start)
    return quality["greedy_agreement"], quality["kl"]


@torch.inference_mode()
def quality_report(model, quantized, sequences: list[list[int]], start: list[int] | None = None,
                   margin: float = 1.0) -> dict[str, float]:
    """agreement_and_kl's two figures, and the agreement where ``model`` is confident: its best next token ahead
    of the second by ``margin`` nats or more (``confident_share`` of the positions). A random-weight model's
    distributions are nearly flat, so most of its positions are near-ties that any noise flips; a trained
    model's greedy path runs mostly through confident positions."""
    same = kl = count = confident = confident_same = 0
    nll = [0.0, 0.0]  # of the sequences' next tokens under model and quantized
    for i, sequence in enumerate(sequences):
        ids, first = torch.tensor([sequence]), 0 if start is None else start[i]
        p, q = (m(ids).logits[0, first:].float().log_softmax(-1) for m in (model, quantized))
        agree = p.argmax(-1) == q.argmax(-1)
        top = p.topk(2, dim=-1).values
        sure = top[:, 0] - top[:, 1] >= margin
        same, count = same + agree.sum().item(), count + len(p)
        confident, confident_same = confident + sure.sum().item(), confident_same + (agree & sure).sum().item()
        kl += F.kl_div(q, p, log_target=True, reduction="sum").item()
        following = ids[0, first + 1:].unsqueeze(-1)
        for j, logp in enumerate((p, q)):
            nll[j] -= logp[:-1].gather(-1, following).sum().item()
    tokens = max(count - len(sequences), 1)
    return dict(greedy_agreement=same / count, kl=kl / count, confident_share=confident / count,
                confident_agreement=confident_same / max(confident, 1), nll=nll[0] / tokens,
                nll_quantized=nll[1] / tokens, perplexity_ratio=math.exp((nll[1] - nll[0]) / tokens))


DEMO_QUESTIONS = ["What is 12 + 7?", "Spell the word apple.", "What day comes after Monday?", "What is 40 + 25?",
                  "Which month comes after March?", "Spell the word river.", "What is 3 + 9?", "Hello!"]


def demo_sequences(path: str, model, new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """The demo model's chat prompts with its own greedy answers, and where each answer starts."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False) for q in DEMO_QUESTIONS]
    prompts = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]
    return continued(model, prompts, new_tokens)


def continued(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Each prompt with ``model``'s greedy continuation (up to ``new_tokens``: the demo model's answers end)."""
    sequences = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                             pad_token_id=0)
        sequences.append(out[0].tolist())
    return sequences, [len(p) - 1 for p in prompts]


def measure(name: str, path: str, schemes: list[str], new_tokens: int, random_prompts: bool) -> list[dict]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        if random_prompts:
            rng = random.Random(0)
            prompts = [[rng.randrange(1, model.config.vocab_size) for _ in range(24)] for _ in range(8)]
            sequences, start = continued(model, prompts, new_tokens)
        else:
            sequences, start = demo_sequences(path, model, new_tokens)
    rows = []
    for scheme in schemes:
        quality = quality_report(model, dequantized_copy(model, scheme), sequences, start)
        rows.append({"model": name, "scheme": scheme, **{k: round(v, 4) for k, v in quality.items()}})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", default="int8,w8a8,int4,int4-asym",
                        help="--quantization values to measure (int4: group size 128)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens continued per prompt")
    parser.add_argument("--out", default="results/quant_quality.json")
    args = parser.parse_args(argv)
    schemes = args.schemes.split(",")
    from loadtest.bench_offline import write_checkpoint  # its random-weight checkpoints

    rows = measure("demo", ensure_demo_model(), schemes, args.new_tokens, random_prompts=False)
    with tempfile.TemporaryDirectory() as folder:
        rows += measure("llama-19m (random)", write_checkpoint("llama-19m", folder), schemes, args.new_tokens,
                        random_prompts=True)
    with open(output_path(args.out), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
