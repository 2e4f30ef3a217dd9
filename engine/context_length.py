"""The context-length rules, in one place: the gateway applies it at the edge, ``LLMEngine.add_request`` for
offline callers; nothing past them checks it again."""
from __future__ import annotations


class ContextLengthError(ValueError):
    """A request that cannot fit the model's context; ``param`` names the field to shorten (OpenAI's)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def fit_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, where: str = "prompt") -> int:
    """``max_tokens``, or all the room the prompt leaves when it is None; ContextLengthError when the prompt
    leaves no room or prompt + max_tokens exceeds ``max_model_len``. ``where``: what the prompt is called in
    the message ("prompt" or "messages")."""
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthError(f"This model's maximum context length is {max_model_len} tokens. However, your "
                                 f"{where} has {num_prompt_tokens} tokens, leaving no room for the completion.", where)
    if max_tokens is None:
        return max_model_len - num_prompt_tokens
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise ContextLengthError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested {total} tokens "
            f"({num_prompt_tokens} in the {where}, {max_tokens} in the completion). Please reduce the length of the "
            f"{where} or the completion.", "max_tokens")
    return max_tokens


def check_input_length(num_tokens: int, max_model_len: int, where: str = "input") -> None:
    """An embedding input runs its prefill alone: it may fill the context, not pass it; ContextLengthError
    otherwise. ``where``: the input's field ("input", or "input[i]" in a list)."""
    if num_tokens > max_model_len:
        raise ContextLengthError(f"This model's maximum context length is {max_model_len} tokens. However, {where} "
                                 f"has {num_tokens} tokens.", where)
