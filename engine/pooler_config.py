"""How a checkpoint pools its hidden states into an embedding, read from its sentence-transformers files
(``modules.json``, the Pooling module's ``config.json``, a Normalize module) and its ``config.json``'s
Matryoshka fields. Torch-free: the gateway validates embedding requests with it."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' Pooling config keys for the modes served; any other mode set is refused at load.
_MODE_KEYS = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
_UNSERVED_MODE_KEYS = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST = "sentence_transformers.models."


@dataclass(slots=True, frozen=True)
class PoolerConfig:
    """A decoder checkpoint without sentence-transformers files pools its last token and normalizes (as the
    Qwen3-Embedding-style models do, and vLLM's default for a decoder served as an embedder)."""

    hidden_size: int
    pooling: str = "last"
    normalize: bool = True
    # Matryoshka: any ``dimensions`` up to hidden_size (is_matryoshka), or only these (matryoshka_dimensions).
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> PoolerConfig:
        """ValueError naming the file and field for a pooling this engine does not serve."""
        folder = Path(model_dir)
        config = json.loads((folder / "config.json").read_text())
        text = config.get("text_config") or config  # a multimodal checkpoint pools its language model
        dims = tuple(config.get("matryoshka_dimensions") or ())
        base = cls(hidden_size=int(text["hidden_size"]), is_matryoshka=bool(config.get("is_matryoshka")) or bool(dims),
                   matryoshka_dimensions=dims)
        modules_file = folder / "modules.json"
        if not modules_file.exists():
            return base
        pooling, normalize = base.pooling, False
        for module in json.loads(modules_file.read_text()):
            kind = module.get("type", "")
            if kind == _ST + "Pooling":
                pooling = _pooling_mode(folder / module.get("path", "") / "config.json")
            elif kind == _ST + "Normalize":
                normalize = True
            elif kind != _ST + "Transformer":
                raise ValueError(f"{modules_file}: module {kind!r} is not served (only Transformer, Pooling "
                                 f"and Normalize)")
        return cls(base.hidden_size, pooling, normalize, base.is_matryoshka, base.matryoshka_dimensions)

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError unless the model can give ``dimensions`` (None: its whole vector)."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValueError("dimensions: this model does not support Matryoshka representations (its config "
                             "sets neither is_matryoshka nor matryoshka_dimensions)")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of {list(self.matryoshka_dimensions)}, got {dimensions}")
        if not 1 <= dimensions <= self.hidden_size:
            raise ValueError(f"dimensions must be in [1, {self.hidden_size}], got {dimensions}")


def _pooling_mode(path: Path) -> str:
    config = json.loads(path.read_text())
    unserved = [k for k in _UNSERVED_MODE_KEYS if config.get(k)]
    modes = [mode for key, mode in _MODE_KEYS.items() if config.get(key)]
    if unserved or len(modes) != 1:
        raise ValueError(f"{path}: exactly one of {', '.join(_MODE_KEYS)} must be set, got "
                         f"{', '.join(unserved + [k for k in _MODE_KEYS if config.get(k)]) or 'none'}")
    return modes[0]
