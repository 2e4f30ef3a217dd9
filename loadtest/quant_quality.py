"""How close a quantized model stays to its unquantized self: teacher-forced next-token agreement and KL, on
transformers models (the engine's quantized greedy equals transformers on the dequantised weights:
tests/engine/test_quantization.py)."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
import transformers

from cuda_ext import reference
from engine import int4
from engine.quantization import LOAD_SCHEMES, dequantize, quantize


def dequantized_copy(model: transformers.PreTrainedModel, scheme: str, group_size: int = 128
                     ) -> transformers.PreTrainedModel:
    """``model`` with every linear weight (the LM head too, as ``--quantization`` does, but for ``w8a8``)
    replaced by its quantized-then-dequantised value (per output channel; int4 per group of ``group_size``
    input columns); ``w8a8``: every linear layer but the LM head also rounds its input to the per-row int8 grid."""
    method, activations = LOAD_SCHEMES[scheme]
    copied = copy.deepcopy(model)
    head = copied.get_output_embeddings()
    with torch.no_grad():
        for layer in copied.modules():
            if isinstance(layer, torch.nn.Linear) and not (activations and layer is head):
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
    for i, sequence in enumerate(sequences):
        ids, first = torch.tensor([sequence]), 0 if start is None else start[i]
        p, q = (m(ids).logits[0, first:].float().log_softmax(-1) for m in (model, quantized))
        agree = p.argmax(-1) == q.argmax(-1)
        top = p.topk(2, dim=-1).values
        sure = top[:, 0] - top[:, 1] >= margin
        same, count = same + agree.sum().item(), count + len(p)
        confident, confident_same = confident + sure.sum().item(), confident_same + (agree & sure).sum().item()
        kl += F.kl_div(q, p, log_target=True, reduction="sum").item()
    return dict(greedy_agreement=same / count, kl=kl / count, confident_share=confident / count,
                confident_agreement=confident_same / max(confident, 1))
