"""Constrained decoding with xgrammar: the request's spec, its checks, and the engine's grammar state.

Why xgrammar: its token masks are precomputed per grammar state (a mask fill is microseconds, not a
vocabulary scan), it takes JSON schema, regex and EBNF alike, and it rolls back cheaply; llguidance is
comparable but Rust-first, outlines precompiles a regex FSM per vocabulary (slow for large schemas).
"""
from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields
from functools import lru_cache

import numpy as np
import torch
import xgrammar as xgr

_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_CHOICES = 1024


@dataclass(slots=True)
class StructuredOutputParams:
    """Exactly one constraint: a JSON schema (as JSON text), any JSON object, a regex, a choice of
    strings, or an EBNF grammar (xgrammar's / GBNF syntax)."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_output needs exactly one of {', '.join(_KINDS)}, got {set_ or 'none'}")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_output.json_object must be a boolean")
        for k in ("json", "regex", "grammar"):
            if getattr(self, k) is not None and not isinstance(getattr(self, k), str):
                raise ValueError(f"structured_output.{k} must be a string")
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_output.choice must be 1 to {MAX_CHOICES} strings")
            self.choice = list(self.choice)

    @classmethod
    def from_wire(cls, d: dict) -> StructuredOutputParams:
        if not isinstance(d, dict):
            raise ValueError("structured_output must be an object")
        unknown = set(d) - set(_KINDS)
        if unknown:
            raise ValueError(f"unknown structured_output fields: {sorted(unknown)}")
        return cls(**d)

    def to_wire(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) not in (None, False)}

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what a compiled grammar is cached by."""
        kind = next(k for k in _KINDS if getattr(self, k) not in (None, False))
        return kind, {"json_object": "", "choice": json.dumps(self.choice)}.get(kind, getattr(self, kind))

    @property
    def size(self) -> int:
        return len(self.key[1])


def check_structured_output(so: StructuredOutputParams, max_chars: int) -> None:
    """ValueError when the spec is over ``max_chars`` or does not compile (no tokenizer needed)."""
    if so.size > max_chars:
        raise ValueError(f"structured_output {so.key[0]} is {so.size} characters, more than the {max_chars} allowed")
    _check_compiles(*so.key)


@lru_cache(maxsize=256)
def _check_compiles(kind: str, text: str) -> None:
    try:
        _grammar(kind, text)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the parser's message
        raise ValueError(f"invalid structured_output {kind}: {exc}") from None


def _grammar(kind: str, text: str) -> xgr.Grammar:
    if kind == "json":
        schema = _bounded_strings_as_patterns(json.loads(text))
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    if kind == "choice":
        # JSON string literals are valid EBNF string literals (same escapes).
        return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in json.loads(text)))
    return xgr.Grammar.from_ebnf(text)


# Keywords whose values are data, not subschemas: a rewrite must leave them as written.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _bounded_strings_as_patterns(schema: object) -> object:
    """xgrammar turns a bare ``minLength``/``maxLength`` string into raw characters that let control
    characters through (invalid JSON); the same bounds as a ``pattern`` get its JSON-safe characters."""
    if isinstance(schema, list):
        return [_bounded_strings_as_patterns(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else _bounded_strings_as_patterns(v) for k, v in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^.{{{low},{high}}}$"
    return out


@dataclass(slots=True)
class TokenMask:
    """A step's constrained logits rows and their allowed tokens: xgrammar's int32 bitmask, a row each (bit
    ``j % 32`` of word ``j // 32`` set when token ``j`` is allowed). The sampler applies it (cuda_ext's
    ``masked_row_argmax`` / ``apply_token_bitmask``)."""

    rows: list[int]
    bitmask: torch.Tensor


class GrammarMatcher:
    """One sequence's grammar state. ``consumed`` counts the output tokens it has accepted: when the
    sequence's tokens differ from that (preemption, a failed step, resume, a fork), it is rebuilt."""

    __slots__ = ("compiled", "matcher", "consumed")

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.consumed = 0

    def sync(self, output_tokens: list[int]) -> bool:
        """Accept the output tokens not consumed yet; False when one is not allowed."""
        if self.consumed > len(output_tokens):
            self.matcher, self.consumed = xgr.GrammarMatcher(self.compiled), 0
        for token in output_tokens[self.consumed:]:
            self.consumed += 1
            if not self.matcher.accept_token(token):
                return False
        return True

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


class StructuredOutputManager:
    """The engine's one owner of grammar state: the tokenizer info (built on first use), the compile
    pool and its LRU cache, and each constrained sequence's matcher (by ``seq_id``)."""

    def __init__(self, tokenizer_info: Callable[[], xgr.TokenizerInfo], max_grammar_bytes: int,
                 num_threads: int = 2, cache_size: int = 64) -> None:
        self._tokenizer_info_factory = tokenizer_info
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._cache_size = cache_size
        self.max_grammar_bytes = max_grammar_bytes
        self._matchers: dict[int, GrammarMatcher] = {}
        self._buffer: torch.Tensor | None = None  # the step's bitmask (fill_mask)
        self.mask_seconds = 0.0
        self.mask_steps = 0

    def compile(self, so: StructuredOutputParams) -> Future:
        """The compiled grammar of ``so`` (a future: compiled on the pool, cached by its spec)."""
        key = so.key
        future = self._cache.get(key)
        if future is None:
            future = self._cache[key] = self._pool.submit(self._compile, *key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        return future

    def _compile(self, kind: str, text: str) -> xgr.CompiledGrammar:
        compiled = self._get_compiler().compile_grammar(_grammar(kind, text))
        if compiled.memory_size_bytes > self.max_grammar_bytes:
            raise ValueError(f"the compiled grammar takes {compiled.memory_size_bytes} bytes, more than "
                             f"max_grammar_bytes={self.max_grammar_bytes}")
        return compiled

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:  # built once, on the first constrained request
            if self._compiler is None:
                self._compiler = xgr.GrammarCompiler(self._tokenizer_info_factory(), max_threads=1)
            return self._compiler

    def matcher(self, seq_id: int, compiled: xgr.CompiledGrammar) -> GrammarMatcher:
        m = self._matchers.get(seq_id)
        if m is None:
            m = self._matchers[seq_id] = GrammarMatcher(compiled)
        return m

    def release(self, seq_id: int) -> None:
        self._matchers.pop(seq_id, None)

    def fill_mask(self, rows: list[int], matchers: list[GrammarMatcher], vocab_size: int) -> tuple[TokenMask, list[int]]:
        """The mask of ``rows`` (one bitmask row per matcher), and the rows that allow no token at all."""
        start = time.perf_counter()
        bitmask = self._bitmask(len(rows), vocab_size)
        for i, m in enumerate(matchers):
            m.matcher.fill_next_token_bitmask(bitmask, i)  # writes the whole row
        # numpy: torch's reduction waits on its thread pool, ~0.4 ms a step beside the kernels' own pool
        dead = [rows[i] for i in np.flatnonzero(~bitmask.numpy().any(axis=1)).tolist()]
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1
        return TokenMask(rows, bitmask), dead

    def _bitmask(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """The first ``num_rows`` rows of a buffer kept across steps (a fresh one each step costs more than the fill)."""
        if self._buffer is None or self._buffer.shape[0] < num_rows or self._buffer.shape[1] != (vocab_size + 31) // 32:
            self._buffer = xgr.allocate_token_bitmask(max(num_rows, 64), vocab_size)
        return self._buffer[:num_rows]
