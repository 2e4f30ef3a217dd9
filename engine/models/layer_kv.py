"""Each attention layer's K/V as the paged pools hold it: its shape, and the layer whose blocks it reads. Most
families give every layer one shape and its own K/V; Gemma 4 gives its global layers their own head size (and,
with ``attention_k_eq_v``, KV heads), and its last ``num_kv_shared_layers`` layers read an earlier layer's K/V
instead of computing their own, so they take no room in the pool. Multi-head latent attention (DeepSeek) keeps one
latent "head" per layer, stored once and read as both K and V."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# Gemma 4's global layers' head size where config.json gives neither per_layer_config nor global_head_dim
# (transformers' default).
_GEMMA4_GLOBAL_HEAD_DIM = 512
_PER_LAYER_KEYS = ("head_dim", "num_key_value_heads")


@dataclass(frozen=True, slots=True)
class LayerKV:
    num_kv_heads: int
    head_dim: int
    source: int  # the layer whose blocks this one reads: itself, or the earlier layer it shares K/V with
    parts: int = 2  # 2: a K and a V tensor; 1: one tensor read as both (MLA's latent, stored once)


@dataclass(frozen=True, slots=True)
class KVPoolGroup:
    """The layers that keep K/V of one shape: one pool, a slice per layer."""

    num_kv_heads: int
    head_dim: int
    layers: tuple[int, ...]
    parts: int = 2  # LayerKV.parts


def uniform_layer_kv(num_layers: int, num_kv_heads: int, head_dim: int) -> tuple[LayerKV, ...]:
    return tuple(LayerKV(num_kv_heads, head_dim, i) for i in range(num_layers))


def pool_groups(layers: Sequence[LayerKV]) -> list[KVPoolGroup]:
    """One group per K/V shape, of the layers that own their K/V (a sharing layer needs no room)."""
    owners: dict[tuple[int, int, int], list[int]] = {}
    for i, layer in enumerate(layers):
        if layer.source == i:
            owners.setdefault((layer.num_kv_heads, layer.head_dim, layer.parts), []).append(i)
    return [KVPoolGroup(heads, dim, tuple(group), parts) for (heads, dim, parts), group in owners.items()]


def kv_token_bytes(layers: Sequence[LayerKV], token_bytes: Callable[[int, int, int, int], int],
                   kv_heads: Callable[[int], int] = int) -> int:
    """One token's K/V in the pools: ``token_bytes(layers, heads, head_dim, parts)`` summed over the groups, with
    ``kv_heads`` the heads a rank keeps of each."""
    return sum(token_bytes(len(g.layers), kv_heads(g.num_kv_heads), g.head_dim, g.parts) for g in pool_groups(layers))


def mla_layer_kv(path: str, hf: dict) -> tuple[LayerKV, ...]:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2): per token and layer one KV "head" of the normalised
    latent and the rotated shared key, ``kv_lora_rank + qk_rope_head_dim`` wide, stored once and read as both K and
    V (the heads' keys and values are projections of it, absorbed into the queries and the output)."""
    width = sum(_positive(path, hf, key) for key in ("kv_lora_rank", "qk_rope_head_dim"))
    return tuple(LayerKV(1, width, i, parts=1) for i in range(hf["num_hidden_layers"]))


def _positive(path: str, hf: dict, key: str) -> int:
    value = hf.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{path}/config.json: {key} must be a positive integer, got {value!r}")
    return value


def gemma4_layer_kv(path: str, hf: dict, windows: tuple[int, ...]) -> tuple[LayerKV, ...]:
    """Gemma 4's layers as transformers builds them: global layers (window 0) with per_layer_config's head size
    and KV heads (or ``global_head_dim``, and ``num_global_key_value_heads`` under ``attention_k_eq_v``), and
    the last ``num_kv_shared_layers`` reading the last earlier layer of their own kind."""
    if windows[-1]:
        raise ValueError(f"{path}/config.json: layer_types must end with a full_attention layer (transformers "
                         "forces it; the engine runs the layers as listed)")
    overrides = _per_layer_overrides(path, hf, windows)
    heads = hf["num_attention_heads"]
    base = (hf.get("num_key_value_heads") or heads, hf.get("head_dim") or hf["hidden_size"] // heads)
    shapes = [(o.get("num_key_value_heads", base[0]), o.get("head_dim", base[1])) for o in overrides]
    sources = _kv_sources(path, hf, windows)
    return tuple(LayerKV(heads, dim, source) for (heads, dim), source in zip(shapes, sources))


def _per_layer_overrides(path: str, hf: dict, windows: tuple[int, ...]) -> list[dict]:
    given = hf.get("per_layer_config")
    if given is None:
        dims = {"head_dim": hf.get("global_head_dim") or _GEMMA4_GLOBAL_HEAD_DIM}
        if hf.get("attention_k_eq_v") and hf.get("num_global_key_value_heads"):
            dims["num_key_value_heads"] = hf["num_global_key_value_heads"]
        return [{} if window else dims for window in windows]
    for layer, fields in given.items():
        unknown = set(fields) - set(_PER_LAYER_KEYS)
        if unknown or not str(layer).isdigit() or int(layer) >= len(windows):
            raise ValueError(f"{path}/config.json: per_layer_config[{layer!r}] must name a layer and only "
                             f"{', '.join(_PER_LAYER_KEYS)} (got {sorted(fields)})")
    return [given.get(str(i), {}) for i in range(len(windows))]


def _kv_sources(path: str, hf: dict, windows: tuple[int, ...]) -> list[int]:
    """Each layer's own index, but for the shared layers: the last unshared layer with the same window."""
    shared = hf.get("num_kv_shared_layers") or 0
    first = len(windows) - shared
    if not 0 <= shared < len(windows):
        raise ValueError(f"{path}/config.json: num_kv_shared_layers={shared} must be in [0, num_hidden_layers="
                         f"{len(windows)}) (a layer must compute the K/V the others share)")
    sources = list(range(len(windows)))
    for i in range(first, len(windows)):
        owners = [j for j in range(first) if windows[j] == windows[i]]
        if not owners:
            raise ValueError(f"{path}/config.json: num_kv_shared_layers={shared} leaves no earlier layer of "
                             f"layer {i}'s kind (layer_types) to share K/V with")
        sources[i] = owners[-1]
    return sources
