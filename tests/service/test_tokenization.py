"""Incremental detokenization and stop strings against whole-text references."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from engine.demo_model import VOCAB
from service.assembler import OutputAssembler
from service.messages import ChoiceDelta
from service.tokenization import IncrementalDetokenizer, StopStringFilter, encode_chat


@pytest.fixture(scope="module")
def tokenizer(demo_model: str):
    return AutoTokenizer.from_pretrained(demo_model)


def stream_text(tokenizer, prompt: list[int], ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.append([t]) for t in ids]
    deltas.append(detok.flush())
    return deltas


def test_multibyte_characters_split_across_tokens(tokenizer) -> None:
    text = "naïve 世界 🙂 ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text)  # byte-level: multi-byte characters span several tokens
    deltas = stream_text(tokenizer, tokenizer.encode("prompt"), ids)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)  # never half a character


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, VOCAB - 1), max_size=40), st.lists(st.integers(0, 255), min_size=1, max_size=8))
def test_stream_equals_whole_decode(tokenizer, ids: list[int], prompt: list[int]) -> None:
    assert "".join(stream_text(tokenizer, prompt, ids)) == tokenizer.decode(ids, skip_special_tokens=True)


def feed_in_pieces(stops: list[str], include: bool, text: str, piece: int) -> tuple[str, str, bool]:
    f = StopStringFilter(stops, include)
    sent = "".join(f.feed(text[i:i + piece], final=False) for i in range(0, len(text), piece))
    return sent + f.feed("", final=True), f.text, f.stopped


@pytest.mark.parametrize("piece", [1, 2, 5])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_match_a_find_reference(piece: int, include: bool) -> None:
    text = "the cat sat on the mat; the end"
    for stops in (["mat"], ["sat", "on"], ["t;", "zzz"], ["nothing"]):
        hits = [(text.find(s), s) for s in stops if s in text]
        pos, stop = min(hits) if hits else (len(text), "")
        expected = text[:pos + (len(stop) if include else 0)]
        sent, kept, stopped = feed_in_pieces(stops, include, text, piece)
        assert (sent, kept, stopped) == (expected, expected, bool(hits))


def test_stop_text_is_never_streamed_before_trimming() -> None:
    f = StopStringFilter(["STOP"], include_stop=False)
    sent = [f.feed(c, final=False) for c in "abcST"]
    assert "".join(sent) == "ab"  # "cST" may still become "STOP": held back
    assert f.feed("OP and more", final=False) == "c" and f.stopped


def test_assembler_ends_choice_at_stop_and_counts_tokens(tokenizer) -> None:
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    asm = OutputAssembler(tokenizer, [1], n=2, stop=["o w"], include_stop=False, skip_special_tokens=True)
    for t in ids:
        asm.apply([ChoiceDelta(0, [t]), ChoiceDelta(1, [t])])
    assert asm.text(0) == "hell" and asm.finish_reason(0) == "stop" and asm.finished


def test_chat_template_matches_transformers(tokenizer) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "héllo"}]
    reference = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert encode_chat(tokenizer, messages) == tokenizer.encode(reference, add_special_tokens=False)
    assert tokenizer.decode(encode_chat(tokenizer, messages)) == reference
