"""A hybrid model's recurrent layers as the state pools hold them (Qwen3-Next, Qwen3.5: Gated DeltaNet layers
listed as ``linear_attention`` in ``layer_types``, between full-attention ones). Each keeps, per sequence, a
fixed-size state instead of K/V per token: the causal conv's window (its last ``conv_width`` inputs of every conv
channel, in the model's dtype) and the delta rule's recurrent matrix (key dim x value dim per value head, fp32)."""
from __future__ import annotations

from engine.layers.gated_delta_net import LinearStateSpec

LINEAR, FULL = "linear_attention", "full_attention"
_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
           "linear_conv_kernel_dim")


def layer_kinds(path: str, hf: dict) -> tuple[str, ...]:
    """``layer_types`` as config.json lists them (transformers writes them for these families)."""
    kinds, layers = hf.get("layer_types"), hf["num_hidden_layers"]
    if not isinstance(kinds, list) or len(kinds) != layers or set(kinds) - {LINEAR, FULL}:
        raise ValueError(f"{path}/config.json: layer_types must list {layers} entries, each {LINEAR!r} or "
                         f"{FULL!r}, got {kinds!r}")
    if FULL not in kinds:
        raise ValueError(f"{path}/config.json: layer_types has no {FULL!r} layer (the engine needs one to page)")
    return tuple(kinds)


def linear_state_spec(path: str, hf: dict) -> LinearStateSpec | None:
    """The recurrent layers' state, None for a model without ``linear_attention`` layers."""
    if LINEAR not in (hf.get("layer_types") or ()):
        return None
    kinds = layer_kinds(path, hf)
    for key in _FIELDS:
        value = hf.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{path}/config.json: {key} must be a positive integer, got {value!r}")
    if hf["linear_num_value_heads"] % hf["linear_num_key_heads"]:
        raise ValueError(f"{path}/config.json: linear_num_value_heads={hf['linear_num_value_heads']} must be a "
                         f"multiple of linear_num_key_heads={hf['linear_num_key_heads']}")
    if hf["linear_conv_kernel_dim"] < 2:
        raise ValueError(f"{path}/config.json: linear_conv_kernel_dim must be at least 2")
    return LinearStateSpec(layers=tuple(i for i, kind in enumerate(kinds) if kind == LINEAR),
                           num_key_heads=hf["linear_num_key_heads"], num_value_heads=hf["linear_num_value_heads"],
                           key_dim=hf["linear_key_head_dim"], value_dim=hf["linear_value_head_dim"],
                           conv_width=hf["linear_conv_kernel_dim"] - 1)
