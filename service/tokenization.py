"""Text <-> token ids for the gateway: chat templates, incremental
detokenization and stop strings. The engine never sees text."""
from __future__ import annotations

from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

# Tokens of prompt context decoded with each new window, so tokenizers that
# drop a leading space at the start of a decode (SentencePiece) stay correct.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
# Without a template to measure, what ChatML adds per message ("<|im_start|>user\n" ... "<|im_end|>\n").
_FALLBACK_CHARS_PER_MESSAGE = 24


def load_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(model_path)


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                add_generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None,
                chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Render with the tokenizer's chat template (``tools`` and the kwargs, e.g. enable_thinking, reach the
    template as transformers passes them). ValueError without one."""
    if not tokenizer.chat_template:
        raise ValueError("this model has no chat template; use /v1/completions")
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         **(chat_template_kwargs or {}))
    # The template writes BOS itself where the model wants one.
    return tokenizer.encode(text, add_special_tokens=False)


def template_chars_per_message(tokenizer: PreTrainedTokenizerBase) -> int:
    """The characters the chat template adds around one message (roles, markers), measured on empty
    messages; _FALLBACK_CHARS_PER_MESSAGE when the template cannot render them (or there is none)."""
    one = [{"role": "user", "content": ""}]
    three = one + [{"role": "assistant", "content": ""}] + one
    try:
        lengths = [len(tokenizer.apply_chat_template(m, tokenize=False)) for m in (one, three)]
    except Exception:  # templates raise what they like (jinja errors, ValueError on a missing template)
        return _FALLBACK_CHARS_PER_MESSAGE
    return max(1, (lengths[1] - lengths[0]) // 2)


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    return tokenizer.encode(prompt, add_special_tokens=True)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes only a short window per call. Text is held back while the window
    ends in U+FFFD, which is how a UTF-8 character split across byte-level
    tokens shows; ``flush`` releases whatever is left at the end.
    """

    __slots__ = ("_tokenizer", "_ids", "_prefix_offset", "_read_offset", "_skip_special")

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        if self._decode(context).endswith(_REPLACEMENT):
            context = []  # the prompt ends mid-character: the output's text starts fresh
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)

    def append(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        # decode() is to_py_obj (a Python pass over the ids, twice a token here) then _decode: the ids are ints.
        return self._tokenizer._decode(ids, skip_special_tokens=self._skip_special)


class StopStringFilter:
    """Accumulates one choice's text and ends it at the first stop string.

    While streaming, the last ``max(len(stop)) - 1`` characters are held back
    so that text which a stop string will trim is never sent.
    """

    __slots__ = ("_stops", "_include_stop", "_longest", "_holdback", "text", "_sent", "stopped", "matched")

    def __init__(self, stops: list[str], include_stop: bool) -> None:
        self._stops = stops
        self._include_stop = include_stop
        self._longest = max((len(s) for s in stops), default=0)
        self._holdback = 0 if include_stop or not stops else self._longest - 1
        self.text = ""
        self._sent = 0
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def watching(self) -> bool:
        """Whether a stop string may still end the text."""
        return bool(self._stops) and not self.stopped

    def feed(self, new_text: str, final: bool) -> str:
        """Adds text; returns what may be sent now (everything when final or stopped)."""
        if not self.stopped and new_text:
            start = max(0, len(self.text) - self._longest + 1)
            self.text += new_text
            self._cut_at_stop(start)
        end = len(self.text) if final or self.stopped else max(self._sent, len(self.text) - self._holdback)
        delta, self._sent = self.text[self._sent:end], end
        return delta

    def _cut_at_stop(self, start: int) -> None:
        hits = [(pos, s) for s in self._stops if (pos := self.text.find(s, start)) >= 0]
        if not hits:
            return
        pos, stop = min(hits)
        self.text = self.text[:pos + len(stop) if self._include_stop else pos]
        self.stopped, self.matched = True, stop
