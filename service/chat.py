"""``pagedserve chat``: a terminal chat client on the server's OpenAI-compatible API.

It streams each answer as it is generated and keeps the conversation's history, so every turn sends the
whole dialogue (the server's prefix cache makes the repeated part cheap). Standard library only: the client
must run where nothing but the package is installed.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TextIO

HELP = "/reset clears the conversation, /help shows this, /exit (or Ctrl-D) quits"


class ChatError(Exception):
    """The server refused a request: its OpenAI error message, or why it could not be reached."""


@dataclass(slots=True)
class ChatSession:
    base_url: str  # ends in /v1
    api_key: str = ""
    model: str = ""  # "" = the first model the server lists
    system: str = ""
    temperature: float = 0.0
    max_tokens: int = 256
    history: list[dict[str, str]] = field(default_factory=list)

    def reset(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def ask(self, text: str) -> Iterator[str]:
        """Send one user turn; yield the answer's text pieces as they stream; keep both turns in the history."""
        self.history.append({"role": "user", "content": text})
        pieces: list[str] = []
        try:
            for piece in self._stream(self.history):
                pieces.append(piece)
                yield piece
        except BaseException:
            self.history.pop()  # a failed or interrupted turn is not part of the conversation
            raise
        self.history.append({"role": "assistant", "content": "".join(pieces)})

    def resolve_model(self) -> str:
        if not self.model:
            models = self._request("GET", "/models", None)
            data = json.load(models).get("data") or []
            if not data:
                raise ChatError("the server lists no model")
            self.model = data[0]["id"]
        return self.model

    def _stream(self, messages: list[dict[str, str]]) -> Iterator[str]:
        body = {"model": self.resolve_model(), "messages": messages, "stream": True,
                "temperature": self.temperature, "max_tokens": self.max_tokens}
        with self._request("POST", "/chat/completions", body) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise ChatError(event["error"].get("message", "the server ended the answer with an error"))
                for choice in event.get("choices", []):
                    if content := choice.get("delta", {}).get("content"):
                        yield content

    def _request(self, method: str, path: str, body: dict | None):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base_url.rstrip("/") + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=600)
        except urllib.error.HTTPError as exc:
            raise ChatError(_error_message(exc)) from None
        except urllib.error.URLError as exc:
            raise ChatError(f"cannot reach {self.base_url}: {exc.reason}") from None


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return f"{exc.code}: {json.load(exc)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{exc.code}: {exc.reason}"


def run(session: ChatSession, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    """The read-answer loop. Returns the exit code: 0 on /exit or end of input, 1 if the server is unusable."""
    session.reset()
    interactive = stdin.isatty()
    try:
        print(f"chatting with {session.resolve_model()} at {session.base_url} ({HELP})", file=stdout)
    except ChatError as exc:
        print(f"pagedserve chat: {exc}", file=sys.stderr)
        return 1
    while True:
        if interactive:
            stdout.write("> ")
            stdout.flush()
        try:
            line = stdin.readline()
        except KeyboardInterrupt:
            line = ""  # Ctrl-C at the prompt quits, as Ctrl-D does
        if not line:
            return 0
        text = line.strip()
        if text in ("/exit", "/quit"):
            return 0
        if text in ("/reset", "/help") or not text:
            if text == "/reset":
                session.reset()
                print("(conversation cleared)", file=stdout)
            elif text == "/help":
                print(HELP, file=stdout)
            continue
        _answer(session, text, stdout)


def _answer(session: ChatSession, text: str, stdout: TextIO) -> None:
    try:
        for piece in session.ask(text):
            stdout.write(piece)
            stdout.flush()
    except ChatError as exc:
        stdout.write(f"[error: {exc}]")
    except KeyboardInterrupt:
        stdout.write(" [interrupted]")
    stdout.write("\n")
    stdout.flush()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("PAGEDSERVE_URL", "http://127.0.0.1:8000/v1"),
                        help="the server's API base URL, ending in /v1 (env PAGEDSERVE_URL)")
    parser.add_argument("--api-key", default=None,
                        help="API key (default: env PAGEDSERVE_API_KEY, else OPENAI_API_KEY; the first of a list)")
    parser.add_argument("--model", default="", help="model name (default: the first the server lists)")
    parser.add_argument("--system", default="", help="a system message that starts every conversation")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--max-tokens", type=int, default=256, help="the longest answer, in tokens")


def session_from_args(args: argparse.Namespace) -> ChatSession:
    key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY") or ""
    return ChatSession(base_url=args.url, api_key=key.split(",")[0].strip(), model=args.model, system=args.system,
                       temperature=args.temperature, max_tokens=args.max_tokens)
