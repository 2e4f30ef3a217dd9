"""`pagedserve chat` against the real stack: its answers are the official openai client's for the same
conversation (history kept across turns, cleared by /reset), and a refused key is a clear error."""
from __future__ import annotations

import os
import subprocess
import sys

import openai

from service.chat import HELP
from service.local_stack import LocalStack
from tests.service.conftest import API_KEY, ROOT

TURNS = ["Hello there", "What is 17 plus 25?"]
MAX_TOKENS = 12


def chat(url: str, stdin: str, api_key: str = API_KEY) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", "chat", "--url", f"{url}/v1", "--max-tokens",
                           str(MAX_TOKENS)], input=stdin, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PAGEDSERVE_API_KEY": api_key})


def reference_answers(url: str, turns: list[str]) -> list[str]:
    """Each turn's greedy answer given the turns before it, from the official client."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY)
    history, answers = [], []
    for turn in turns:
        history.append({"role": "user", "content": turn})
        reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=history,
                                               max_tokens=MAX_TOKENS, temperature=0)
        answers.append(reply.choices[0].message.content)
        history.append({"role": "assistant", "content": answers[-1]})
    return answers


def test_chat_keeps_history_and_reset_clears_it(stack: LocalStack) -> None:
    expected = reference_answers(stack.url, TURNS)
    fresh = reference_answers(stack.url, TURNS[1:])
    done = chat(stack.url, "\n".join([TURNS[0], TURNS[1], "/reset", TURNS[1], "/help", "/exit"]) + "\n")
    assert done.returncode == 0, done.stderr
    header, _, answers = done.stdout.partition("\n")
    assert header.startswith("chatting with ")
    assert answers == "".join(f"{text}\n" for text in [*expected, "(conversation cleared)", *fresh, HELP])


def test_chat_reports_a_refused_key(stack: LocalStack) -> None:
    done = chat(stack.url, "Hello\n", api_key="wrong-key")
    assert done.returncode == 1
    assert "401" in done.stderr and "wrong-key" not in done.stderr
