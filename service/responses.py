"""OpenAI response bodies and stream chunks, built from ChoiceUpdates; embeddings lists."""
from __future__ import annotations

import base64
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from engine.outputs import TokenLogprobs

from service.assembler import ChoiceUpdate
from service.messages import EMBEDDING_DTYPE


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def embeddings(vectors: list[bytes], encoding_format: str, model: str, prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's list of embeddings, in input order; each vector (float32 little-endian bytes, as the engine's
    wire carries it) as numbers, or ``base64`` of those bytes (what the openai SDK asks for and decodes)."""
    data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(v).decode("ascii")
             if encoding_format == "base64" else np.frombuffer(v, EMBEDDING_DTYPE).tolist()}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def sum_usage(parts: list[dict[str, Any]]) -> dict[str, Any]:
    return usage(*(sum(p[key] for p in parts) for key in ("prompt_tokens", "completion_tokens")),
                 sum(p["prompt_tokens_details"]["cached_tokens"] for p in parts))


def merge_prompts(bodies: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """The responses of a list of prompts as one (OpenAI's): choice i of prompt k is choice k * n + i."""
    for k, body in enumerate(bodies):
        for choice in body["choices"]:
            choice["index"] += k * n
    return {**bodies[0], "choices": [c for body in bodies for c in body["choices"]],
            "usage": sum_usage([body["usage"] for body in bodies])}


def prepend_echo(choice: dict[str, Any], prompt_text: str, prompt_logprobs: dict[str, Any] | None,
                 echo_only: bool) -> None:
    """``echo``: the prompt's text (and its tokens' logprobs) before the choice's; with max_tokens=0
    (``echo_only``) the prompt's alone."""
    text, logprobs = ("", None) if echo_only else (choice["text"], choice["logprobs"])
    choice["text"] = prompt_text + text
    if prompt_logprobs is not None:
        tail = logprobs or {key: [] for key in prompt_logprobs}
        offset = len(prompt_text)
        choice["logprobs"] = {key: prompt_logprobs[key] + ([o + offset for o in tail[key]] if key == "text_offset"
                                                           else tail[key]) for key in prompt_logprobs}
    if echo_only:
        choice["finish_reason"] = "length"


def envelope(request_id: str, obj: str, created: int, model: str, choices: list[dict[str, Any]],
             usage_body: dict[str, Any] | None = None, with_usage: bool = False) -> dict[str, Any]:
    body = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if with_usage or usage_body is not None:
        body["usage"] = usage_body
    return body


def chat_chunk_choice(update: ChoiceUpdate, logprobs: dict[str, Any] | None) -> dict[str, Any]:
    delta = {"content": update.text} if update.text else {}
    return {"index": update.index, "delta": delta, "logprobs": logprobs, "finish_reason": update.finish_reason}


def completion_choice(index: int, text: str, logprobs: dict[str, Any] | None,
                      finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, message: dict[str, Any], logprobs: dict[str, Any] | None,
                finish_reason: str | None) -> dict[str, Any]:
    """``message``: content, and maybe reasoning_content and tool_calls (then an empty content is null)."""
    if message.get("tool_calls") and not message["content"]:
        message = {**message, "content": None}
    return {"index": index, "message": {"role": "assistant", **message}, "logprobs": logprobs,
            "finish_reason": chat_finish_reason(finish_reason, bool(message.get("tool_calls")))}


def chat_delta_choice(index: int, delta: dict[str, Any], logprobs: dict[str, Any] | None,
                      finish_reason: str | None, called: bool) -> dict[str, Any]:
    """A stream chunk's choice with a parsed delta (reasoning_content, content or tool_calls parts)."""
    return {"index": index, "delta": delta, "logprobs": logprobs,
            "finish_reason": chat_finish_reason(finish_reason, called)}


def chat_finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a choice that called tools and stopped by itself (not at max_tokens)."""
    return "tool_calls" if called and reason == "stop" else reason


class LogprobFormatter:
    """vLLM's logprob shapes: chat ``{"content": [...]}``, completions
    ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, from the
    engine's pairs: the sampled token first, then the alternatives in order."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, top_n: int) -> None:
        self._tokenizer = tokenizer
        self._top_n = top_n

    def chat(self, update: ChoiceUpdate) -> dict[str, Any]:
        content = []
        for (token_id, logprob), *top in update.logprobs or []:
            entry = self._entry(token_id, logprob)
            entry["top_logprobs"] = [self._entry(t, lp) for t, lp in top]
            content.append(entry)
        return {"content": content}

    def completion(self, update: ChoiceUpdate, text_offset: int) -> dict[str, Any]:
        body: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for (token_id, logprob), *top in update.logprobs or []:
            token = self._text(token_id)
            body["tokens"].append(token)
            body["token_logprobs"].append(logprob)
            body["top_logprobs"].append({self._text(t): lp for t, lp in top} if self._top_n else None)
            body["text_offset"].append(text_offset)
            text_offset += len(token)
        return body

    def prompt_completion(self, prompt_ids: list[int], entries: list[TokenLogprobs | None]) -> dict[str, Any]:
        """The prompt's tokens in the completions shape (echo with logprobs): the first token, which nothing
        predicts, has a null logprob, as do tokens the engine sent no logprob for."""
        body: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for token_id, entry in zip(prompt_ids, entries):
            token = self._text(token_id)
            body["tokens"].append(token)
            body["token_logprobs"].append(None if entry is None else entry[0][1])
            top = None if entry is None or not self._top_n else {self._text(t): lp for t, lp in entry[1:1 + self._top_n]}
            body["top_logprobs"].append(top)
            body["text_offset"].append(offset)
            offset += len(token)
        return body

    def prompt_logprobs(self, entries: list[TokenLogprobs | None], top_n: int) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token ``{token id: {logprob, rank, decoded_token}}``, the
        token itself and the top ``top_n`` (ranked 1, 2, ...; the token's own rank only when among them)."""
        listed: list[dict[str, Any] | None] = []
        for entry in entries:
            if entry is None:
                listed.append(None)
                continue
            (token_id, logprob), *top = entry
            ranks = {t: rank for rank, (t, _) in enumerate(top[:top_n], 1)}
            pairs = [(token_id, logprob), *top[:top_n]]
            listed.append({str(t): {"logprob": lp, "decoded_token": self._text(t)} | (
                {"rank": ranks[t]} if t in ranks else {}) for t, lp in pairs})
        return listed

    @staticmethod
    def merge_completion(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not parts:
            return None
        return {key: [v for part in parts for v in part[key]] for key in parts[0]}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def _text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])
