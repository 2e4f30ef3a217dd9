"""Train the demo checkpoint: ``python -m engine.demo.train --out DIR`` (the full recipe: docs/demo_model.md).

Seeded end to end: the corpus stream, the tokenizer's training text, the weight init and the batch order come
from ``--seed``. Without ``--decay-steps`` the learning rate is constant after warm-up, so ``--steps N``
reproduces the checkpoint a longer run saved at step N (same torch version, CPU and threads); ``--init``
continues from a saved checkpoint (its weights and tokenizer, a fresh optimizer). Loss on the assistant turns.
"""
from __future__ import annotations

import argparse
import itertools
import os
import random
import time
from collections.abc import Iterator

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from engine import demo_model
from engine.demo.corpus import Corpus, Message, Question, held_out_questions, render

IGNORE = -100  # label of a token the loss skips
POOL_BATCHES = 8  # batches drawn at once and cut by length, so a batch pads little
PAD_MULTIPLE = 16  # batch widths round up to this: each new shape costs oneDNN a kernel build


def train_tokenizer(texts: list[str], vocab_size: int = demo_model.VOCAB) -> Tokenizer:
    """Byte-level BPE (any text encodes, none is unknown), one token per digit, ChatML tokens special."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=demo_model.SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in demo_model.SPECIAL_TOKENS])
    return tokenizer


def encode_dialogue(tokenizer: Tokenizer, messages: list[Message]) -> tuple[list[int], list[int]]:
    """Token ids of ``render(messages)`` and their labels: the assistant's words and its <|im_end|>, else IGNORE."""
    ids: list[int] = []
    labels: list[int] = []
    for m in messages:
        head = tokenizer.encode(f"<|im_start|>{m['role']}\n").ids
        body = tokenizer.encode(f"{m['content']}<|im_end|>").ids
        tail = tokenizer.encode("\n").ids
        learnt = body if m["role"] == "assistant" else [IGNORE] * len(body)
        ids += head + body + tail
        labels += [IGNORE] * len(head) + learnt + [IGNORE] * len(tail)
    return ids, labels


def batches(tokenizer: Tokenizer, corpus: Corpus, batch_size: int, seed: int) -> Iterator[torch.Tensor]:
    """(2, batch, length) tensors of ids and labels, right-padded (causal attention never looks right)."""
    rng = random.Random(seed)
    dialogues = iter(corpus)
    while True:
        pool = sorted((encode_dialogue(tokenizer, next(dialogues)) for _ in range(batch_size * POOL_BATCHES)),
                      key=lambda pair: len(pair[0]))
        chunks = [pool[i:i + batch_size] for i in range(0, len(pool), batch_size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            width = -(-max(len(ids) for ids, _ in chunk) // PAD_MULTIPLE) * PAD_MULTIPLE
            yield torch.tensor([[ids + [demo_model.PAD_ID] * (width - len(ids)) for ids, _ in chunk],
                                [labels + [IGNORE] * (width - len(labels)) for _, labels in chunk]])


def build_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    skip = ("architectures", "model_type", "torch_dtype")
    return LlamaForCausalLM(LlamaConfig(**{k: v for k, v in demo_model.llama_config().items() if k not in skip}))


@torch.no_grad()
def answers(model: LlamaForCausalLM, tokenizer: Tokenizer, questions: list[str], max_new_tokens: int = 32) -> list[str]:
    """Greedy replies to single-turn chats, batched with left padding."""
    prompts = [tokenizer.encode(render([{"role": "user", "content": q}]) + "<|im_start|>assistant\n").ids
               for q in questions]
    width = max(map(len, prompts))
    ids = torch.tensor([[demo_model.PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=demo_model.EOS_ID, pad_token_id=demo_model.PAD_ID)
    return [tokenizer.decode([t for t in row if t not in (demo_model.EOS_ID, demo_model.PAD_ID)])
            for row in out[:, width:].tolist()]


def accuracy(model: LlamaForCausalLM, tokenizer: Tokenizer, questions: list[Question]) -> dict[str, float]:
    """Exact-match rate per category (and ``all``) of greedy replies."""
    model.eval()
    replies = answers(model, tokenizer, [q.question for q in questions])
    model.train()
    right = [reply.strip() == q.answer for q, reply in zip(questions, replies)]
    categories = sorted({q.category for q in questions})
    scores = {c: [r for q, r in zip(questions, right) if q.category == c] for c in categories}
    return {c: sum(r) / len(r) for c, r in scores.items()} | {"all": sum(right) / len(right)}


def eval_sample(n: int, seed: int) -> list[Question]:
    """``n`` held-out questions, spread over the categories, fixed by ``seed``."""
    questions = held_out_questions()
    by_category = {c: [q for q in questions if q.category == c] for c in ("arithmetic", "spelling", "calendar")}
    rng = random.Random(seed)
    share = {"arithmetic": n // 2, "spelling": n // 4, "calendar": n - n // 2 - n // 4}
    return [q for c, qs in by_category.items() for q in rng.sample(qs, min(share[c], len(qs)))]


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up, constant after; with ``--decay-steps``, linear to zero over the run's last steps."""
    decay = (args.steps - step) / args.decay_steps if args.decay_steps else 1.0
    return args.lr * min(1.0, (step + 1) / args.warmup, decay)


def starting_point(args: argparse.Namespace) -> tuple[Tokenizer, LlamaForCausalLM]:
    """A new tokenizer and a freshly initialised model, or (``--init``) those of an earlier run's checkpoint."""
    if args.init:
        model = LlamaForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        return Tokenizer.from_file(os.path.join(args.init, "tokenizer.json")), model.train()
    corpus = Corpus(args.seed)
    return train_tokenizer([render(corpus.dialogue()) for _ in range(args.tokenizer_dialogues)]), build_model(args.seed)


def train(args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    tokenizer, model = starting_point(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)
    stream = batches(tokenizer, Corpus(args.seed + 1), args.batch_size, args.seed + 2)
    probe = eval_sample(args.eval_questions, args.seed)
    scores: dict[str, float] = {}
    started = time.monotonic()
    bar = tqdm(itertools.islice(stream, args.steps), total=args.steps, desc="training the demo model", unit="step")
    for step, batch in enumerate(bar, 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            logits = model(input_ids=batch[0]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[1, :, 1:].flatten(),
                                                 ignore_index=IGNORE)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if step % args.eval_every == 0 or step == args.steps:
            scores = accuracy(model, tokenizer, probe)
            demo_model.save_checkpoint(args.out, tokenizer, model.state_dict())
            tqdm.write(f"step {step}: loss {loss.item():.4f}, held-out accuracy {scores}, "
                       f"{time.monotonic() - started:.0f} s")
    return scores


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.demo.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="checkpoint folder to write (rewritten at every evaluation)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (AdamW), constant after warm-up")
    p.add_argument("--warmup", type=int, default=100, help="steps of linear warm-up")
    p.add_argument("--decay-steps", type=int, default=0, help="the last steps, over which the rate falls to zero")
    p.add_argument("--init", help="start from this checkpoint folder (weights and tokenizer), not from scratch")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (the result depends on it, in rounding)")
    p.add_argument("--no-bf16", dest="bf16", action="store_false", help="fp32 matmuls, not bf16 autocast")
    p.add_argument("--eval-every", type=int, default=250, help="steps between held-out checks and saves")
    p.add_argument("--eval-questions", type=int, default=96, help="held-out questions per check")
    p.add_argument("--tokenizer-dialogues", type=int, default=20000, help="dialogues the tokenizer is trained on")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


if __name__ == "__main__":
    main()
