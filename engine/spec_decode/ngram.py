"""N-gram prompt lookup: propose what followed the latest earlier occurrence of the sequence's last tokens."""
from __future__ import annotations

from array import array

from engine.sequence import Sequence

_WIDTH = 4  # bytes per token id in the searched buffer (ids are < 2**31)


class NgramProposer:
    """No model: the longest suffix of ``max_n`` down to ``min_n`` tokens found earlier in the sequence (prompt
    and output) proposes the tokens that followed it there. Strong where the output quotes its context (code
    edits, summaries, retrieval answers); silent, and free, where nothing repeats."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], ks: list[int], salts: list[bytes | None]) -> list[list[int]]:
        return [lookup(seq.token_ids, k, self.min_n, self.max_n) for seq, k in zip(seqs, ks)]

    def release_inactive(self) -> None:
        """Nothing kept between steps."""


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens after an earlier occurrence of the longest matching suffix n-gram: the latest one that
    ``k`` tokens follow, else the latest one (a short proposal); [] when none matches. The search is bytes.rfind
    over the ids packed 4 bytes each (C speed)."""
    data = array("i", tokens).tobytes()
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        pattern = data[-_WIDTH * n:]
        start = _rfind_aligned(data, pattern, _WIDTH * max(len(tokens) - k, 0))
        if start < 0:
            start = _rfind_aligned(data, pattern, _WIDTH * (len(tokens) - 1))
        if start >= 0:
            return tokens[start + n:start + n + k]
    return []


def _rfind_aligned(data: bytes, pattern: bytes, end: int) -> int:
    """Token index of the latest occurrence of ``pattern`` in ``data[:end]`` on a token boundary, or -1."""
    pos = data.rfind(pattern, 0, end)
    while pos >= 0 and pos % _WIDTH:
        pos = data.rfind(pattern, 0, pos + len(pattern) - 1)
    return pos // _WIDTH if pos >= 0 else -1
