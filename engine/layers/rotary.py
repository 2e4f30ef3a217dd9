"""Rotary position embedding (neox / Hugging Face ``rotate_half`` layout) with the RoPE scalings of transformers'
``ROPE_INIT_FUNCTIONS``: linear, dynamic NTK, YaRN, LongRoPE (Phi-3's "su"), Llama 3; partial rotary (the leading
``rotary_dim`` dims of each head rotate, the rest pass through)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

import cuda_ext
from engine.layers.attention import AttentionMetadata

# Each scaling's fields that transformers reads without a default.
_REQUIRED = {"default": (), "linear": ("factor",), "dynamic": ("factor",), "yarn": ("factor",),
             "longrope": ("short_factor", "long_factor"),
             "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "proportional": ()}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """A checkpoint's rotary embedding, read and checked from config.json by ``rope_config``."""

    theta: float
    rotary_dim: int  # the leading dims of each head that rotate: head_dim * partial_rotary_factor
    max_position: int  # max_position_embeddings: the tables' length
    original_max_position: int  # the pre-training context that llama3 / yarn / longrope extend
    rope_type: str = "default"
    params: dict = field(default_factory=dict)  # the scaling's own fields (factor, short_factor, ...)


def rope_config(hf: dict, head_dim: int, max_position: int, aliases: dict[str, str] | None = None) -> RopeConfig:
    """transformers 5 writes ``rope_parameters`` (theta and scaling in one dict); older checkpoints
    ``rope_theta`` + ``rope_scaling``. ``aliases`` renames a family's legacy types (Phi-3: su -> longrope)."""
    key, params = _rope_dict(hf)
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = (aliases or {}).get(rope_type, rope_type)
    if rope_type not in _REQUIRED:
        raise ValueError(f"config.json {key}: unsupported rope_type {rope_type!r} (supported: {', '.join(_REQUIRED)})")
    for name in _REQUIRED[rope_type]:
        if name not in params:
            raise ValueError(f"config.json {key}: rope_type {rope_type!r} requires the field {name!r}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    # Proportional RoPE (Gemma 4) turns only some angle pairs, but pairs them across the whole head.
    rotary_dim = head_dim if rope_type == "proportional" else int(head_dim * partial)
    if rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise ValueError(f"config.json partial_rotary_factor={partial} gives {rotary_dim} rotary dims of a "
                         f"{head_dim}-dim head (must be even, 2..{head_dim})")
    # As transformers: a top-level original_max_position_embeddings (Phi-3 keeps it there) wins.
    original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if rope_type == "longrope":
        _check_longrope_factors(key, params, rotary_dim)
    return RopeConfig(theta=theta, rotary_dim=rotary_dim, max_position=max_position,
                      original_max_position=original or max_position, rope_type=rope_type, params=params)


def _check_longrope_factors(key: str, params: dict, rotary_dim: int) -> None:
    for name in ("short_factor", "long_factor"):
        if not isinstance(params[name], list) or len(params[name]) != rotary_dim // 2:
            raise ValueError(f"config.json {key}.{name}: expected a list of {rotary_dim // 2} numbers "
                             f"(rotary dims / 2), got {params[name]!r}")


def _rope_dict(hf: dict) -> tuple[str, dict]:
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        return "rope_parameters", params
    return "rope_scaling", hf.get("rope_scaling") or {}


def rope_inv_freq(rope: RopeConfig, long: bool = False) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim / 2] and the attention factor that scales cos and sin, as transformers'
    ``ROPE_INIT_FUNCTIONS`` compute them for sequences within max_position; ``long``: LongRoPE's long factors."""
    dim = rope.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    if rope.rope_type == "yarn":
        return _yarn(rope, exponents)
    if rope.rope_type == "longrope":
        return _longrope(rope, exponents, long)
    if rope.rope_type == "proportional":
        return _proportional(rope), 1.0
    inv_freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.params["factor"], 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope.params, rope.original_max_position), 1.0
    # default, and dynamic NTK: it rescales only past max_position_embeddings, where the engine never goes.
    return inv_freq, 1.0


def _proportional(rope: RopeConfig) -> torch.Tensor:
    """The head's first ``partial_rotary_factor`` of angle pairs turn at the default frequencies (of the whole
    head size); the others have frequency 0: cos 1, sin 0, so those dims pass through."""
    dim, params = rope.rotary_dim, rope.params
    turning = int(params.get("partial_rotary_factor", 1.0) * dim // 2)
    exponents = torch.arange(0, 2 * turning, 2, dtype=torch.int64, device="cpu").float() / dim
    inv_freq = torch.cat((1.0 / (rope.theta ** exponents), torch.zeros(dim // 2 - turning, device="cpu")))
    return inv_freq / params.get("factor", 1.0)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict, old_len: int) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    # Interpolate (divide by `factor`) the dims that turn less than beta_slow times over the original context,
    # keep those that turn more than beta_fast times, ramp linearly between.
    s, dim, old_len = rope.params, rope.rotary_dim, rope.original_max_position
    factor = s["factor"] or rope.max_position / old_len
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        attention_factor = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else _yarn_mscale(factor))

    def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times over the original context
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    pos_freqs = rope.theta ** exponents
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return inv_freq, float(attention_factor)


def softmax_mscale(rope: RopeConfig) -> float:
    """DeepSeek's MLA: under a scaled RoPE with ``mscale_all_dim``, the softmax scale of every q·k dim (not only the
    rotary ones) is multiplied by this twice (transformers' ``yarn_apply_mscale``); 1 otherwise."""
    mscale_all_dim = rope.params.get("mscale_all_dim")
    if rope.rope_type == "default" or not mscale_all_dim:
        return 1.0
    return _yarn_mscale(rope.params["factor"], mscale_all_dim)


def _yarn_mscale(scale: float, mscale: float = 1) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(rope: RopeConfig, exponents: torch.Tensor, long: bool) -> tuple[torch.Tensor, float]:
    # Per-dim rescale factors, one list for sequences within the original context and one past it.
    s, old_len = rope.params, rope.original_max_position
    factor = s.get("factor") or rope.max_position / old_len
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32, device="cpu")
    return 1.0 / (ext * rope.theta ** exponents), float(attention_factor)


def rope_tables(rope: RopeConfig, long: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin [max_position, rotary_dim / 2], scaled by the attention factor as transformers does."""
    inv_freq, attention_factor = rope_inv_freq(rope, long)
    freqs = torch.outer(torch.arange(rope.max_position, dtype=torch.float32, device="cpu"), inv_freq)
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables; ``rotary(rows, x)`` rotates x in place (one op per call).

    LongRoPE keeps two tables stacked, the short factors' rows then the long ones': a token takes the long row
    when its sequence is longer than the original context at this step (``step``), as transformers decides for
    one sequence."""

    # The pure-torch op until the loader hands the layer the compiled ones.
    ops: cuda_ext.KernelOps = cuda_ext.load_ops("torch")

    def __init__(self, rope: RopeConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        # Plain attributes on an explicit device: the model is built on "meta" and these tables are derived
        # state, not weights. One half each: the neox layout repeats the angles over both halves of a head.
        tables = [rope_tables(rope)] + ([rope_tables(rope, long=True)] if rope.rope_type == "longrope" else [])
        self.cos = torch.cat([cos for cos, _ in tables]).to(device, dtype)
        self.sin = torch.cat([sin for _, sin in tables]).to(device, dtype)
        self.rotary_dim, self.max_position = rope.rotary_dim, rope.max_position
        self.long_after = rope.original_max_position if len(tables) == 2 else None

    def step(self, positions: torch.Tensor, meta: AttentionMetadata) -> RopeStep:
        """The step's table rows: each token's position, past max_position where its sequence takes LongRoPE's
        long table (longer than the original context, counting this step's tokens)."""
        if self.long_after is None:
            return RopeStep(self, positions)
        seq_lens = meta.seq_lens.repeat_interleave(meta.query_start_loc.diff(), output_size=len(positions))
        return RopeStep(self, positions + (seq_lens > self.long_after) * self.max_position)

    def forward(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Rotates the leading rotary_dim dims of x [T, H, D] (e.g. the q|k view of a fused projection) in place
        by token t's table row, Hugging Face's ``x * cos + rotate_half(x) * sin`` with its rounding."""
        self.ops.rotary_embedding(x[..., :self.rotary_dim], rows, self.cos, self.sin)


@dataclass(slots=True, frozen=True)
class RopeStep:
    """One step's rotary for every layer: ``rope(x)`` rotates x [T, H, D] in place at the step's table rows
    (``positions``: the tokens' positions, LongRoPE's long ones offset by max_position)."""

    rotary: RotaryEmbedding
    positions: torch.Tensor

    def __call__(self, x: torch.Tensor) -> None:
        self.rotary(self.positions, x)
