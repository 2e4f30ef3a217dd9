"""Constrained decoding with xgrammar: the request's spec, its checks, and the engine's grammar state.

Why xgrammar: its token masks are precomputed per grammar state (a mask fill is microseconds, not a
vocabulary scan), it takes JSON schema, regex and EBNF alike, and it rolls back cheaply; llguidance is
comparable but Rust-first, outlines precompiles a regex FSM per vocabulary (slow for large schemas).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import lru_cache

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
        build_grammar(kind, text)
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the parser's message
        raise ValueError(f"invalid structured_output {kind}: {exc}") from None


def build_grammar(kind: str, text: str) -> xgr.Grammar:
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
