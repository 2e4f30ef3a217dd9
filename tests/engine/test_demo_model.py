"""The demo checkpoint's recipe and the shipped result: the corpus keeps its held-out questions out of
training, the tokenizer and template agree with transformers, the engine's greedy answers equal
transformers' on the shipped weights, and the training script reproduces itself."""
from __future__ import annotations

import os
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file

from engine import LLM, SamplingParams, demo_model
from engine.demo import corpus, train
from engine.demo_model import CHECKPOINT_DIR, ensure_demo_model

TRAINING_SAMPLE = 20_000  # dialogues, ~8 times the held-out questions' share of any one pair or word


@pytest.fixture(scope="module")
def training_messages() -> list[corpus.Message]:
    stream = corpus.Corpus(seed=0)
    return [m for _ in range(TRAINING_SAMPLE) for m in stream.dialogue()]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(CHECKPOINT_DIR)


def test_held_out_questions_never_appear_in_training(training_messages) -> None:
    held_pairs, held_words, held_calendar = corpus.split()
    assert ("plus", 17, 25) in held_pairs
    said = {m["content"].lower().rstrip("?.") for m in training_messages}
    words = {w for text in said for w in re.findall(r"[a-z]+", text)}
    for op, a, b in held_pairs:
        assert corpus.arithmetic_answer(op, a, b).lower().rstrip(".") not in said
    assert not held_words & words
    for combo in held_calendar:
        assert corpus.calendar_question(*combo).lower().rstrip("?.") not in said
    # ... while training covers the rest of each topic.
    answers = " ".join(m["content"] for m in training_messages if m["role"] == "assistant")
    assert all(s in answers for s in (" plus ", " minus ", " is spelled ", "The month before", "The day after"))


def test_held_out_questions_are_answered_by_their_templates() -> None:
    questions = corpus.held_out_questions()
    assert {q.category for q in questions} == {"arithmetic", "spelling", "calendar"}
    q = next(q for q in questions if q.question == "What is 17 plus 25?")
    assert q.answer == "17 plus 25 is 42."
    assert corpus.spelling_answer("cat") == "cat is spelled c-a-t."
    assert corpus.calendar_answer("day", "before", "Monday") == "The day before Monday is Sunday."
    assert corpus.calendar_answer("month", "after", "December") == "The month after December is January."


def test_corpus_is_seeded() -> None:
    first, again, other = corpus.Corpus(7), corpus.Corpus(7), corpus.Corpus(8)
    dialogues = [first.dialogue() for _ in range(50)]
    assert dialogues == [again.dialogue() for _ in range(50)] != [other.dialogue() for _ in range(50)]


def test_render_is_the_chat_template_and_labels_are_the_assistant_turns(tokenizer) -> None:
    stream = corpus.Corpus(3)
    fast = tokenizer.backend_tokenizer
    for _ in range(30):
        messages = stream.dialogue()
        text = corpus.render(messages)
        assert tokenizer.apply_chat_template(messages, tokenize=False) == text
        ids, labels = train.encode_dialogue(fast, messages)
        assert ids == tokenizer(text).input_ids
        learnt = [t for t, label in zip(ids, labels) if label != train.IGNORE]
        assert learnt == [t for t, label in zip(ids, labels) if label == t]
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        assert tokenizer.decode(learnt) == "<|im_end|>".join(replies) + "<|im_end|>"


def test_tokenizer_splits_digits_and_keeps_chatml_whole(tokenizer) -> None:
    ids = tokenizer("<|im_start|>user\nWhat is 217 plus 5?<|im_end|>").input_ids
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens[0] == "<|im_start|>" and tokens[-1] == "<|im_end|>"
    assert ["2", "1", "7"] == tokens[tokens.index("2"):tokens.index("2") + 3]
    assert tokenizer.decode(tokenizer("naïve 世界 🙂").input_ids) == "naïve 世界 🙂"  # byte-level: nothing unknown
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, len(tokenizer)) == (demo_model.EOS_ID, demo_model.PAD_ID,
                                                                                demo_model.VOCAB)


def test_shipped_checkpoint_is_small_and_matches_its_config() -> None:
    weights = load_file(os.path.join(CHECKPOINT_DIR, "model.safetensors"))
    assert os.path.getsize(os.path.join(CHECKPOINT_DIR, "model.safetensors")) < 10 * 2**20
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    reference = train.build_model(seed=0).state_dict()
    assert {name: t.shape for name, t in weights.items()} == {name: t.shape for name, t in reference.items()}


def test_installed_copy_is_the_shipped_checkpoint(tmp_path) -> None:
    path = ensure_demo_model(str(tmp_path / "demo"))
    for name in demo_model.CHECKPOINT_FILES:
        with open(os.path.join(path, name), "rb") as copy, open(os.path.join(CHECKPOINT_DIR, name), "rb") as shipped:
            assert copy.read() == shipped.read(), name
    with open(os.path.join(path, "demo_version")) as f:
        assert f.read().strip() == demo_model.DEMO_VERSION


def test_engine_greedy_answers_equal_transformers(tokenizer) -> None:
    """The engine on the shipped checkpoint against transformers' generate, an independent reference."""
    model = transformers.AutoModelForCausalLM.from_pretrained(CHECKPOINT_DIR, dtype=torch.float32).eval()
    llm = LLM(CHECKPOINT_DIR, attention_backend="torch", num_device_blocks=32, show_progress=False)
    chats = [[{"role": "user", "content": q}] for q in ("What is 17 plus 25?", "How do you spell lamp?", "Hello")]
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in chats]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            reference = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=demo_model.EOS_ID,
                                       pad_token_id=demo_model.PAD_ID)[0, ids.shape[1]:].tolist()
        assert output.outputs[0].token_ids == reference
    assert outputs[0].outputs[0].text == "17 plus 25 is 42."


def test_training_is_reproducible(tmp_path) -> None:
    """Two short runs with one seed write the same weights; a continued run (``--init``) keeps the tokenizer;
    each folder is a loadable checkpoint."""
    args = ["--batch-size", "4", "--eval-questions", "4", "--tokenizer-dialogues", "300"]
    runs = [str(tmp_path / name) for name in ("a", "b")]
    for out in runs:
        train.main(["--out", out, "--steps", "3", "--eval-every", "3", *args])
    first, second = (load_file(os.path.join(out, "model.safetensors")) for out in runs)
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    continued = str(tmp_path / "c")
    train.main(["--out", continued, "--init", runs[0], "--steps", "2", "--decay-steps", "2", "--eval-every", "2",
                *args])
    with open(os.path.join(runs[0], "tokenizer.json")) as a, open(os.path.join(continued, "tokenizer.json")) as c:
        assert a.read() == c.read()
    third = load_file(os.path.join(continued, "model.safetensors"))
    assert not all(torch.equal(first[k], third[k]) for k in first)
    model = transformers.AutoModelForCausalLM.from_pretrained(continued)
    assert model.num_parameters() == sum(t.numel() for t in third.values())
