"""The engine's grammar state for constrained decoding (xgrammar): compiled grammars, matchers and token masks.
The request's spec and its checks are ``engine.structured_output``'s."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import xgrammar as xgr

from engine.core.scheduler_output import ScheduledSeq, TokenMask
from engine.sequence import Sequence, SequenceGroup, SequenceStatus
from engine.structured_output import StructuredOutputParams, build_grammar


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
    """The one owner of grammar state: the tokenizer info (built on first use), the compile pool and its LRU
    cache, each constrained request's grammar (compiling, then compiled, by request id) and each constrained
    sequence's matcher (by ``seq_id``). The scheduler calls it: ``start`` on arrival, ``ready`` before
    scheduling, ``mask`` for a scheduled step, ``verdicts`` after it, ``forget`` when the request leaves."""

    def __init__(self, tokenizer_info: Callable[[], xgr.TokenizerInfo], max_grammar_bytes: int, vocab_size: int,
                 num_threads: int = 2, cache_size: int = 64) -> None:
        self._tokenizer_info_factory = tokenizer_info
        self.vocab_size = vocab_size
        self._compiling: deque[tuple[SequenceGroup, Future]] = deque()  # in arrival order
        self._compiled: dict[str, xgr.CompiledGrammar] = {}
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

    # ---- per request ---------------------------------------------------------
    def start(self, group: SequenceGroup) -> None:
        """Compile the request's grammar; it waits (``WAITING_FOR_GRAMMAR``) until ``ready`` hands it back."""
        self._compiling.append((group, self.compile(group.params.structured_output)))

    def ready(self) -> list[tuple[SequenceGroup, BaseException | None]]:
        """The requests whose grammar is done compiling, in arrival order, each with its compile error or None."""
        done = []
        while self._compiling and self._compiling[0][1].done():
            group, future = self._compiling.popleft()
            error = future.exception()
            if error is None:
                self._compiled[group.request_id] = future.result()
            done.append((group, error))
        return done

    @property
    def compiling(self) -> bool:
        return bool(self._compiling)

    @property
    def active(self) -> bool:
        """Whether a constrained request is scheduled (its next mask needs each token)."""
        return bool(self._compiled)

    def mask(self, samples: list[tuple[int, ScheduledSeq, Sequence]]) -> TokenMask | None:
        """The mask of the constrained rows, synced to their sequences' tokens (a matcher whose count differs,
        after preemption, a failed step, resume or a fork, is rebuilt from the tokens). A row whose grammar
        allows nothing draws a placeholder (token 0), and ``verdicts`` fails its choice."""
        rows, matchers = [], []
        for i, (_, s, seq) in enumerate(samples):
            compiled = self._compiled.get(s.group.request_id)
            if compiled is not None:
                m = self.matcher(seq.seq_id, compiled)
                if m.sync(seq.output_token_ids):
                    rows.append(i)
                    matchers.append(m)
        if not rows:
            return None
        mask, dead = self.fill_mask(rows, matchers, self.vocab_size)
        for i in dead:
            matchers[rows.index(i)].consumed = -1
        return mask

    def verdicts(self, samples: list[tuple[int, ScheduledSeq, Sequence]]
                 ) -> list[tuple[SequenceGroup, Sequence, SequenceStatus]]:
        """Feed each constrained choice its new token: a completed grammar stops it, a token the grammar refuses
        (no token was allowed) ends it with an error. Returns those finishes; a finished choice's matcher goes."""
        finishes = []
        for _, s, seq in samples:
            compiled = self._compiled.get(s.group.request_id)
            if compiled is None:
                continue
            m = self.matcher(seq.seq_id, compiled)
            if not seq.is_finished:
                if m.consumed < 0 or not m.sync(seq.output_token_ids):
                    finishes.append((s.group, seq, SequenceStatus.FINISHED_ERROR))
                elif m.terminated:
                    finishes.append((s.group, seq, SequenceStatus.FINISHED_STOPPED))
            if seq.is_finished or (finishes and finishes[-1][1] is seq):
                self.release(seq.seq_id)
        return finishes

    def forget(self, group: SequenceGroup) -> None:
        """The request left (finished, aborted, failed): its grammar, its matchers, a compile it waits for."""
        if self._compiled.pop(group.request_id, None) is not None:
            for seq in group.seqs:
                self.release(seq.seq_id)
        if any(g is group for g, _ in self._compiling):
            self._compiling = deque((g, f) for g, f in self._compiling if g is not group)

    # ---- compiling and masks -------------------------------------------------
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
        compiled = self._get_compiler().compile_grammar(build_grammar(kind, text))
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
