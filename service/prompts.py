"""A request's prompt at the edge, each rule checked once: its size capped before it is tokenized (at
``max_chars_per_token`` characters a token, whatever the tokenizer makes of it, it cannot fit the context),
its tokenizing (the chat template, with tools), and its token ids held to the vocabulary."""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from service.errors import APIError
from service.protocol import GenerationRequest, TokenizeRequest, message_text_chars
from service.tokenization import encode_chat, encode_prompt, template_chars_per_message
from service.tools import ToolRequest


class Prompts:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_chars_per_token: int) -> None:
        self._tokenizer = tokenizer
        self._max_chars_per_token = max_chars_per_token
        # Characters the chat template adds per message: empty messages must count against the cap too.
        self._chars_per_message = template_chars_per_message(tokenizer)

    def check_size(self, messages: list[dict[str, Any]] | None, tools: ToolRequest | None,
                   prompts: list[str | list[int]], context: int, param: str | None = None) -> None:
        """Rejects a chat's ``messages`` (with ``tools``), or else any of ``prompts``, that cannot fit
        ``context`` tokens, before paying for tokenizing it. /tokenize is held to the same cap (the
        tokenizer's time is everyone's), /detokenize's ids too. ``param``: the field to blame, when not
        "messages" or "prompt"."""
        chars = context * self._max_chars_per_token
        if messages is not None:
            size = _chat_chars(messages, tools, self._chars_per_message)
            sizes = [(size, chars, "characters of messages, tools and their template")]
        else:  # each prompt is its own engine request and must fit on its own
            sizes = [(len(p), context, "token ids") if isinstance(p, list) else (len(p), chars, "characters")
                     for p in prompts]
        for size, limit, what in sizes:
            if size > limit:
                raise APIError(400, f"This model's maximum context length is {context} tokens, so this server "
                                    f"accepts at most {limit} {what}; this request has {size}.",
                               param=param or ("prompt" if messages is None else "messages"),
                               code="context_length_exceeded")

    def encode(self, req: GenerationRequest) -> list[int]:
        """The prompt's token ids (the chat template's rendering of the messages, for a chat), checked
        against the vocabulary like the request's other token ids; ``top_k`` capped at the vocabulary."""
        with _client_errors("messages" if req.chat else "prompt"):
            if req.chat:
                ids = self._render_chat(req.messages, req.add_generation_prompt, req.tools, req.chat_template_kwargs)
            else:
                ids = self._tokens(req.prompt)
        self._checked("prompt", ids)
        req.params.top_k = min(req.params.top_k, len(self._tokenizer))  # beyond the vocabulary, top-k keeps all
        for name, values in (("stop_token_ids", req.params.stop_token_ids),
                             ("logit_bias", list(req.params.logit_bias or ()))):
            self.check_ids(name, values)
        return ids

    def prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """A text's token ids, or token ids, held to the vocabulary; a 400 naming ``param`` if empty."""
        with _client_errors(param):
            ids = self._tokens(prompt)
        return self._checked(param, ids)

    def _tokens(self, prompt: str | list[int]) -> list[int]:
        return prompt if isinstance(prompt, list) else encode_prompt(self._tokenizer, prompt)

    def _checked(self, param: str, ids: list[int]) -> list[int]:
        """``ids``, held to the vocabulary and non-empty."""
        self.check_ids(param, ids)
        if not ids:
            raise APIError(400, "the prompt is empty after tokenization", param=param)
        return ids

    def encode_tokenize(self, req: TokenizeRequest) -> list[int]:
        """What /tokenize answers: the prompt's ids, or the messages' as the chat template renders them."""
        with _client_errors("prompt" if req.messages is None else "messages"):
            if req.messages is None:
                return self._tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            return self._render_chat(req.messages, req.add_generation_prompt, req.tools, req.chat_template_kwargs)

    def check_ids(self, name: str, ids: list[int]) -> None:
        vocab = len(self._tokenizer)
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(400, f"{name} holds token ids outside the vocabulary [0, {vocab})", param=name)

    def _render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: ToolRequest | None,
                     template_kwargs: dict[str, Any]) -> list[int]:
        listed = tools.template_tools() if tools is not None else None
        return encode_chat(self._tokenizer, messages, add_generation_prompt, listed, template_kwargs)


@contextmanager
def _client_errors(param: str) -> Iterator[None]:
    """No chat template, or a template that refused the messages: the client's 400, blaming ``param``."""
    try:
        yield
    except (ValueError, TemplateError) as exc:
        raise APIError(400, str(exc), param=param) from exc


def _chat_chars(messages: list[dict[str, Any]], tools: ToolRequest | None, chars_per_message: int) -> int:
    """The characters a chat request renders: message text, tool-call arguments, tool definitions, and what
    the template adds around each message (so a flood of empty messages counts too)."""
    size = sum(message_text_chars(m["content"])
               + sum(len(json.dumps(c["function"]["arguments"])) for c in m.get("tool_calls", ())) for m in messages)
    listed = tools.template_tools() if tools is not None else None
    return size + len(messages) * chars_per_message + (len(json.dumps(listed)) if listed else 0)
