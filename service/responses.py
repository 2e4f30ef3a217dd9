"""OpenAI response bodies and stream chunks, built from ChoiceUpdates."""
from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from service.assembler import ChoiceUpdate


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


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


def chat_choice(index: int, text: str, logprobs: dict[str, Any] | None, finish_reason: str | None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish_reason}


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
