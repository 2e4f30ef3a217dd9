"""lm-evaluation-harness end to end: its ``local-completions`` model (echo + logprobs on /v1/completions)
against the server on a small multiple-choice task written here. Every choice's loglikelihood must be what
transformers gives on the same checkpoint (lm-eval's ``hf`` model would need accelerate; the sum it takes is
a few lines), and the accuracy the one those reference scores give."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from service.local_stack import LocalStack
from tests.service.conftest import API_KEY, MODEL_NAME

lm_eval = pytest.importorskip("lm_eval")

QUESTIONS = [
    ("The sky on a clear day is", ["blue", "green", "plaid"], 0),
    ("Two plus two equals", ["three", "four", "five"], 1),
    ("Water freezes at zero degrees", ["Kelvin", "Fahrenheit", "Celsius"], 2),
    ("A paged KV cache stores keys and values in", ["blocks", "pages of a book"], 0),
    ("The opposite of hot is", ["cold", "warm", "tepid", "lukewarm"], 0),
]
ATOL = 1e-3  # a sum of a few dozen token logprobs, each within 1e-4 of the reference
DELIMITER = " "  # lm-eval's target_delimiter: between the question and each choice


@pytest.fixture(scope="module")
def task(tmp_path_factory: pytest.TempPathFactory) -> dict:
    data = tmp_path_factory.mktemp("lm_eval") / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    return {
        "task": "pagedserve_demo_mc", "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}],
    }


def evaluate(task: dict, model: str, model_args: dict) -> tuple[float, dict[int, list[float]]]:
    """The task's accuracy and each question's per-choice loglikelihoods."""
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task], batch_size=1,
                                      log_samples=True, bootstrap_iters=0, verbosity="WARNING")
    acc = results["results"][task["task"]]["acc,none"]
    lls = {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in results["samples"][task["task"]]}
    return acc, lls


def reference_loglikelihoods(demo_model: str) -> dict[int, list[float]]:
    """log p(delimiter + choice | question) per choice, as lm-eval scores it: the question's tokens, then
    the continuation's, from encoding the whole text."""
    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    scores: dict[int, list[float]] = {}
    for doc_id, (question, choices, _) in enumerate(QUESTIONS):
        context = tokenizer.encode(question)
        scores[doc_id] = []
        for choice in choices:
            ids = tokenizer.encode(question + DELIMITER + choice)
            assert ids[:len(context)] == context
            with torch.no_grad():
                rows = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            scores[doc_id].append(sum(rows[i - 1, ids[i]].item() for i in range(len(context), len(ids))))
    return scores


def test_local_completions_scores_like_transformers(stack: LocalStack, demo_model: str, task: dict,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # what local-completions sends as its bearer token
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    served_acc, served = evaluate(task, "local-completions", {
        "model": MODEL_NAME, "base_url": f"{stack.url}/v1/completions", "tokenizer": demo_model,
        "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1})
    reference = reference_loglikelihoods(demo_model)
    assert isinstance(served_acc, float) and 0.0 <= served_acc <= 1.0
    assert sorted(served) == list(range(len(QUESTIONS)))
    for doc_id, (_, choices, _) in enumerate(QUESTIONS):
        assert len(served[doc_id]) == len(choices)
        assert served[doc_id] == pytest.approx(reference[doc_id], abs=ATOL), doc_id
    picked = [max(range(len(lls)), key=lls.__getitem__) for _, lls in sorted(reference.items())]
    assert served_acc == pytest.approx(sum(p == a for p, (_, _, a) in zip(picked, QUESTIONS)) / len(QUESTIONS))
