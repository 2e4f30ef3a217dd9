"""Next-token selection for a batch of sequences, vectorised over the batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cuda_ext import KernelOps, load_ops

from engine.beam_search import TopTokens, top_tokens
from engine.core.scheduler_output import SchedulerOutput, TokenMask
from engine.model_runner import Logits, PromptLogprobs
from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

_MASK64 = (1 << 63) - 1


@dataclass(slots=True)
class SamplerOutput:
    """Everything a step drew: a token (and its logprobs) per ``SchedulerOutput.samples()`` row, the best next
    tokens of each ``beam_samples()`` row, and the prompt logprobs and pooled rows its prefill chunks computed."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    beam_tokens: TopTokens | None = None
    prompt: PromptLogprobs | None = None
    pooled: torch.Tensor | None = None  # Logits.pooled


class Sampler:
    """logit_bias -> penalties -> min_tokens mask -> grammar mask -> temperature -> top-k / top-p / min-p -> sample.

    Random rows draw ``argmax(p / E)`` with ``E ~ Exp(1)`` noise (equivalent to
    sampling from ``p``). A seeded row gets its noise from a generator seeded by
    (seed, choice index, output position), so its tokens do not depend on the
    rest of the batch or on preemption. Logprobs are of the raw model
    distribution, before any processing (vLLM's default).
    """

    def __init__(self, eos_token_ids: set[int], seed: int, device: torch.device | str = "cpu",
                 ops: KernelOps | None = None) -> None:
        self.eos_token_ids = sorted(eos_token_ids)
        self._eos = frozenset(eos_token_ids)
        self.generator = torch.Generator(device).manual_seed(seed)
        # row_argmax (the compiled one is ~10x torch's on CPU) and the grammar mask's ops; default the reference.
        self.ops = ops or load_ops("torch")

    def sample(self, out: SchedulerOutput, logits: Logits | None) -> SamplerOutput:
        """The step's draw (``draw_step`` then ``step_output``)."""
        return self.step_output(out, logits, *self.draw_step(out, logits))

    def draw_step(self, out: SchedulerOutput, logits: Logits | None
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The tokens of ``out.samples()``, still on the device (None: nothing to draw), with the step's grammar
        mask (``out.token_mask``); and their rows' raw logits (None: argmax only), for ``step_output``."""
        samples = out.samples()
        if not samples:
            return None, None
        if len(samples) != len(logits):  # forks draw several tokens from one row
            logits = logits.select([row for row, _, _ in samples])
        seqs, params = [seq for _, _, seq in samples], [s.group.params for _, s, _ in samples]
        return self.draw(logits.values, seqs, params, logits.argmax, out.token_mask), logits.values

    def step_output(self, out: SchedulerOutput, logits: Logits | None, tokens: torch.Tensor | None,
                    values: torch.Tensor | None) -> SamplerOutput:
        """``draw_step``'s tokens on the host, with the logprobs of its ``values``, the beam rows' best tokens and
        the prompt logprobs."""
        samples, beams = out.samples(), out.beam_samples()
        if samples:
            sampled = self.output(values, tokens, [s.group.params for _, s, _ in samples])
        else:
            sampled = SamplerOutput([], [])
        if beams:
            sampled.beam_tokens = top_tokens(logits.values, beams, self._eos)
        if logits is not None:
            sampled.prompt, sampled.pooled = logits.prompt, logits.pooled
        return sampled

    def __call__(self, logits: torch.Tensor | None, seqs: list[Sequence], params: list[SamplingParams],
                 argmax: torch.Tensor | None = None, mask: TokenMask | None = None) -> SamplerOutput:
        """``argmax``: the logits' row-wise argmax when the LM head already computed it (fused into its GEMM).
        No ``logits``: every row is ``SamplingParams.argmax_only`` and the LM head gave the argmax alone.
        ``mask``: the structured-output rows' allowed tokens."""
        return self.output(logits, self.draw(logits, seqs, params, argmax, mask), params)

    def draw(self, logits: torch.Tensor | None, seqs: list[Sequence], params: list[SamplingParams],
             argmax: torch.Tensor | None = None, mask: TokenMask | None = None) -> torch.Tensor:
        """The tokens (``__call__``'s arguments), on the logits' device: nothing waits for them yet."""
        if logits is None:
            return argmax
        raw = logits
        logits = _bias(logits, params)
        logits = self._penalize(logits, seqs, params)
        logits = self._mask_early_stops(logits, seqs, params)
        greedy_tokens = argmax if argmax is not None and logits is raw else self.ops.row_argmax(logits)
        if mask is not None:
            logits, greedy_tokens = self._constrain(logits, raw, greedy_tokens, params, mask)
        if all(p.greedy for p in params):  # the common case: one argmax, one host copy, no per-row Python
            return greedy_tokens
        return self._sample(logits, seqs, params, greedy_tokens)

    @staticmethod
    def output(logits: torch.Tensor | None, tokens: torch.Tensor, params: list[SamplingParams]) -> SamplerOutput:
        """``draw``'s tokens (on any device) on the host, with the logprobs of ``logits`` (the raw ones ``draw``
        got) asked for."""
        token_ids = tokens.tolist()
        if logits is None:
            return SamplerOutput(token_ids, [None] * len(params))
        return SamplerOutput(token_ids, _logprobs(logits, tokens, token_ids, params))

    def _constrain(self, logits: torch.Tensor, raw: torch.Tensor, greedy_tokens: torch.Tensor,
                   params: list[SamplingParams], mask: TokenMask) -> tuple[torch.Tensor, torch.Tensor]:
        """Greedy constrained rows take the argmax over their allowed tokens, reading only those (no pass over
        the logits); sampled ones get -inf over the forbidden tokens (on a copy: ``raw`` feeds the logprobs)."""
        rows, greedy = torch.tensor(mask.rows), torch.tensor([params[r].greedy for r in mask.rows])
        if bool(greedy.all()):  # the common case: no row copies of the bitmask
            greedy_tokens = greedy_tokens.clone()
            greedy_tokens[rows] = self.ops.masked_row_argmax(logits, mask.bitmask, rows)
            return logits, greedy_tokens
        if bool(greedy.any()):
            greedy_tokens = greedy_tokens.clone()
            greedy_tokens[rows[greedy]] = self.ops.masked_row_argmax(logits, mask.bitmask[greedy], rows[greedy])
        logits = logits.clone() if logits is raw else logits
        self.ops.apply_token_bitmask(logits, mask.bitmask[~greedy], rows[~greedy])
        return logits, greedy_tokens

    def _penalize(self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]) -> torch.Tensor:
        rows = [i for i, p in enumerate(params)
                if p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0]
        if not rows:
            return logits
        logits, dev = logits.clone(), logits.device
        counts = _token_counts([seqs[i].output_token_ids for i in rows], logits.shape[1]).to(dev)
        prompts = [seqs[i].token_ids[:seqs[i].num_prompt_tokens] for i in rows]
        in_prompt = _token_counts(prompts, logits.shape[1]).to(dev) > 0
        sub = logits[rows]
        rep = _column([params[i].repetition_penalty for i in rows], dev)
        seen = in_prompt | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        freq = _column([params[i].frequency_penalty for i in rows], dev)
        pres = _column([params[i].presence_penalty for i in rows], dev)
        logits[rows] = sub - freq * counts - pres * (counts > 0).float()
        return logits

    def _mask_early_stops(self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams]) -> torch.Tensor:
        """Below min_tokens, eos (unless ignore_eos) and stop_token_ids cannot be drawn."""
        if not any(p.min_tokens for p in params):  # the common case, without a per-row property call
            return logits
        early = [i for i, (s, p) in enumerate(zip(seqs, params)) if s.num_output_tokens < p.min_tokens]
        if not early:
            return logits
        logits = logits.clone()
        for i in early:
            banned = params[i].stop_token_ids + ([] if params[i].ignore_eos else self.eos_token_ids)
            logits[i, [t for t in banned if t < logits.shape[1]]] = float("-inf")
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], params: list[SamplingParams],
                greedy_tokens: torch.Tensor) -> torch.Tensor:
        dev = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        temps = _column([1.0 if p.greedy else p.temperature for p in params], dev)
        probs = _filter(logits / temps, params).softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, (s, p) in enumerate(zip(seqs, params)):
            if p.seed is not None:  # drawn on CPU so a seed means the same tokens on any device
                g = torch.Generator().manual_seed(_seed_key(p.seed, s.index, s.num_output_tokens))
                noise[i] = torch.empty(probs.shape[1]).exponential_(generator=g).to(dev)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)


def _bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:  # ids were checked against the vocabulary by LLMEngine.add_request
        bias = params[i].logit_bias
        logits[i, list(bias)] += torch.tensor(list(bias.values()), device=logits.device)
    return logits


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top-k, top-p and min-p in one sort, only when some row asks for them."""
    if all(p.top_k == -1 and p.top_p == 1.0 and p.min_p == 0.0 for p in params):
        return logits
    vocab, dev = logits.shape[1], logits.device
    top_k = _column([p.top_k if p.top_k != -1 else vocab for p in params], dev)
    top_p = _column([p.top_p for p in params], dev)
    min_p = _column([p.min_p for p in params], dev)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=dev).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
    outside_p = (probs.cumsum(dim=-1) - probs) >= top_p
    below_min = probs < min_p * probs[:, :1]
    sorted_logits = sorted_logits.masked_fill(outside_p | below_min, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, device=device).unsqueeze(1)


def _token_counts(token_lists: list[list[int]], vocab: int) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1)
    if width:
        # Pad with an extra "vocab" column that is dropped afterwards.
        padded = torch.tensor([t + [vocab] * (width - len(t)) for t in token_lists], dtype=torch.int64)
        counts.scatter_add_(1, padded, torch.ones(padded.shape))
    return counts[:, :vocab]


def _seed_key(seed: int, index: int, position: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + position) & _MASK64


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, token_ids: list[int],
              params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
    result: list[TokenLogprobs | None] = [None] * len(params)
    if not wanted:
        return result
    lp = raw[wanted].log_softmax(dim=-1)
    chosen = lp.gather(1, tokens[wanted].to(lp.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(params[i].logprobs for i in wanted)
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()  # one device->host copy each, not one per row
    for row, i in enumerate(wanted):
        n = params[i].logprobs
        result[i] = [(token_ids[i], chosen[row]), *zip(top_ids[row][:n], top_lp[row][:n])]
    return result
