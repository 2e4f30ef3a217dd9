"""Turns an engine's token deltas for one request into text deltas per choice,
applying stop strings. Transport-agnostic: the gateway feeds it ReplyEvents."""
from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from engine.outputs import TokenLogprobs

from service.messages import ChoiceDelta
from service.tokenization import IncrementalDetokenizer, StopStringFilter


@dataclass(slots=True)
class ChoiceUpdate:
    """What one choice adds to the response now."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None


@dataclass(slots=True)
class _Choice:
    detokenizer: IncrementalDetokenizer
    stops: StopStringFilter
    num_tokens: int = 0
    finish_reason: str | None = None


class OutputAssembler:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], n: int,
                 stop: list[str], include_stop: bool, skip_special_tokens: bool) -> None:
        self._choices = [
            _Choice(IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens),
                    StopStringFilter(stop, include_stop))
            for _ in range(n)]

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self._choices)

    @property
    def num_completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self._choices)

    def text(self, index: int) -> str:
        return self._choices[index].stops.text

    def finish_reason(self, index: int) -> str | None:
        return self._choices[index].finish_reason

    def matched_stop(self, index: int) -> str | None:
        """The stop string that ended the choice (None: it ended otherwise, or runs on)."""
        return self._choices[index].stops.matched

    def apply(self, deltas: list[ChoiceDelta]) -> list[ChoiceUpdate]:
        """Updates for the choices these deltas touch; choices already ended
        (e.g. by a stop string while the engine kept going) ignore theirs."""
        updates = []
        for delta in deltas:
            choice = self._choices[delta.index]
            if choice.finish_reason is None:
                updates.append(self._advance(delta.index, choice, delta))
        return updates

    def finish_all(self, reason: str) -> list[ChoiceUpdate]:
        """Ends every unfinished choice (abort, engine failure)."""
        return [self._advance(i, c, ChoiceDelta(i, [], None, reason))
                for i, c in enumerate(self._choices) if c.finish_reason is None]

    def _advance(self, index: int, choice: _Choice, delta: ChoiceDelta) -> ChoiceUpdate:
        final = delta.finish_reason is not None
        text, taken = "", 0
        pieces = _pieces(choice, delta.token_ids)
        for k, ids in enumerate(pieces):
            ends = final and k == len(pieces) - 1
            new_text = choice.detokenizer.append(ids)
            if ends:
                new_text += choice.detokenizer.flush()
            text += choice.stops.feed(new_text, ends)
            taken += len(ids)
            if choice.stops.stopped:
                break
        choice.num_tokens += taken
        if choice.stops.stopped:
            choice.finish_reason = "stop"
        elif final:
            choice.finish_reason = delta.finish_reason
        logprobs = None if delta.logprobs is None else delta.logprobs[:taken]
        return ChoiceUpdate(index=index, text=text, token_ids=delta.token_ids[:taken], logprobs=logprobs,
                            finish_reason=choice.finish_reason)


def _pieces(choice: _Choice, token_ids: list[int]) -> list[list[int]]:
    """The delta whole, or a token at a time while a stop string may end the text: a delta of several tokens
    (a speculative step's) must end at the token that completes the stop string, the tokens after it neither
    counted in usage nor given logprobs, as when every step brings one token."""
    if len(token_ids) > 1 and choice.stops.watching:
        return [[t] for t in token_ids]
    return [token_ids]
