"""SigLIP's vision tower (Gemma 3's): a patch-embedding convolution and learned position embeddings over one fixed
image size, pre-LayerNorm encoder layers (full attention over the image's patches, a GELU-tanh MLP), a final
LayerNorm. Plain torch layers in transformers' eager order (the tower runs once per image, then the encoder cache
serves it); module names follow the checkpoint's ``vision_tower.*``."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class SiglipConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    eps: float

    @classmethod
    def from_hf(cls, v: dict) -> SiglipConfig:
        act = v.get("hidden_act", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"config.json vision_config.hidden_act: only gelu_pytorch_tanh is supported, got {act!r}")
        return cls(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                   num_layers=v["num_hidden_layers"], num_heads=v["num_attention_heads"],
                   num_channels=v.get("num_channels", 3), image_size=v["image_size"], patch_size=v["patch_size"],
                   eps=v.get("layer_norm_eps", 1e-6))

    @property
    def side(self) -> int:
        """Patches along each side of the image."""
        return self.image_size // self.patch_size


class SiglipAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.scale = num_heads, (hidden // num_heads) ** -0.5
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [images, patches, hidden]: each image's patches attend to all of its patches."""
        b, n, _ = x.shape
        q, k, v = (proj(x).view(b, n, self.num_heads, -1).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))
        probs = F.softmax((q @ k.transpose(-1, -2)) * self.scale, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.out_proj((probs @ v).transpose(1, 2).reshape(b, n, -1))


class SiglipMLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, inter), nn.Linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, c: SiglipConfig) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.eps)
        self.self_attn = SiglipAttention(c.hidden_size, c.num_heads)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.eps)
        self.mlp = SiglipMLP(c.hidden_size, c.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipVisionTower(nn.Module):
    def __init__(self, c: SiglipConfig) -> None:
        super().__init__()
        self.config = c
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, c.patch_size, stride=c.patch_size)
        self.embeddings.position_embedding = nn.Embedding(c.side * c.side, c.hidden_size)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipEncoderLayer(c) for _ in range(c.num_layers))
        self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=c.eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [images, channels, image_size, image_size] -> [images, patches (row-major), hidden]."""
        conv = self.embeddings.patch_embedding
        x = conv(pixels.to(conv.weight.dtype)).flatten(2).transpose(1, 2)
        x = x + self.embeddings.position_embedding.weight
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)
