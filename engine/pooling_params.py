"""Per-request embedding parameters: a pooling request runs its prompt's prefill only and returns one vector
(``RequestOutput.embedding``) instead of tokens."""
from __future__ import annotations

from dataclasses import dataclass

from engine.pooler_config import POOLING_TYPES, PoolerConfig


@dataclass(slots=True, frozen=True)
class PoolingParams:
    """None: the model's own choice (``PoolerConfig``, from its sentence-transformers files)."""

    pooling: str | None = None  # "last" | "mean" | "cls"
    normalize: bool | None = None  # L2-normalize the pooled vector
    dimensions: int | None = None  # keep the first ``dimensions`` (Matryoshka), then normalize again

    def __post_init__(self) -> None:
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {self.normalize!r}")

    def resolve(self, model: PoolerConfig) -> ResolvedPooling:
        """These params with the model's defaults filled in; ValueError for ``dimensions`` it cannot give."""
        model.check_dimensions(self.dimensions)
        return ResolvedPooling(self.pooling or model.pooling,
                               model.normalize if self.normalize is None else self.normalize, self.dimensions)


@dataclass(slots=True, frozen=True)
class ResolvedPooling:
    pooling: str
    normalize: bool
    dimensions: int | None

    @property
    def needs_every_position(self) -> bool:
        """Mean and CLS pooling read positions a prefix-cache hit would skip: they run the whole prompt."""
        return self.pooling != "last"
