"""Diffusion Transformer (Peebles & Xie 2023): patches as tokens, adaLN-Zero blocks, a learned class table.

Written for diffrelay from the paper's description. Sizes S/B/L/XL and patch sizes 2/4/8 are presets;
`depth`, `hidden_size` and `num_heads` may be given instead of `size` for small models.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {  # (depth, hidden size, heads), table 1 of the paper
    "S": (12, 384, 6),
    "B": (12, 768, 12),
    "L": (24, 1024, 16),
    "XL": (28, 1152, 16),
}
FREQ_DIM = 256  # sinusoidal features of the noise level before its MLP


def _modulate(x, shift, scale):  # x (B, N, D); shift, scale (B, D)
    return x * (1 + scale[:, None]) + shift[:, None]


def _sincos_2d(grid: int, dim: int) -> torch.Tensor:
    """Fixed 2-D sine/cosine position table (grid*grid, dim): half the features for rows, half for columns."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    pos = torch.arange(grid, dtype=torch.float64)
    ang = pos[:, None] * omega[None]  # (grid, quarter)
    axis = torch.cat([ang.sin(), ang.cos()], dim=1)  # (grid, dim/2)
    rows = axis[:, None, :].expand(grid, grid, -1)
    cols = axis[None, :, :].expand(grid, grid, -1)
    return torch.cat([rows, cols], dim=-1).reshape(grid * grid, dim).float()


class NoiseEmbedder(nn.Module):
    """Scalar noise condition -> sinusoidal features -> MLP to the hidden size."""

    def __init__(self, hidden: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FREQ_DIM, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, c_noise):  # (B,) -> (B, hidden)
        half = FREQ_DIM // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=c_noise.device, dtype=torch.float32) / half)
        # EDM's c_noise = ln(sigma)/4 spans about [-1.6, 1.1]; stretch it so the slow frequencies still vary.
        x = (c_noise.float() * 1000)[:, None] * freqs[None]
        return self.mlp(torch.cat([x.cos(), x.sin()], dim=1).to(self.mlp[0].weight.dtype))


class Block(nn.Module):
    """Pre-norm attention and MLP, each scaled, shifted and gated by the condition; gates start at zero."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        inner = int(hidden * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(hidden, inner), nn.GELU(approximate="tanh"), nn.Linear(inner, hidden))
        self.ada = nn.Linear(hidden, 6 * hidden)
        nn.init.zeros_(self.ada.weight)  # adaLN-Zero: every block starts as the identity
        nn.init.zeros_(self.ada.bias)

    def attention(self, x):  # (B, N, D) -> (B, N, D)
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d))

    def forward(self, x, cond):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(cond)).chunk(6, dim=1)
        x = x + gate1[:, None] * self.attention(_modulate(self.norm1(x), shift1, scale1))
        return x + gate2[:, None] * self.mlp(_modulate(self.norm2(x), shift2, scale2))


class DiT(nn.Module):
    """F(x, c_noise, labels) -> same shape as x (out_channels = in_channels unless asked otherwise)."""

    def __init__(self, resolution: int, in_channels: int, num_classes: int, patch: int = 2, depth: int = 12,
                 hidden_size: int = 384, num_heads: int = 6, mlp_ratio: float = 4.0, out_channels: int | None = None):
        super().__init__()
        if resolution % patch:
            raise ValueError(f"patch={patch} does not divide the resolution {resolution}")
        if hidden_size % num_heads or hidden_size % 4:
            raise ValueError(f"hidden_size={hidden_size} must be a multiple of num_heads={num_heads} and of 4")
        self.patch, self.out_channels, self.grid = patch, out_channels or in_channels, resolution // patch
        self.embed = nn.Conv2d(in_channels, hidden_size, patch, stride=patch)
        self.register_buffer("pos", _sincos_2d(self.grid, hidden_size)[None], persistent=False)
        self.noise_emb = NoiseEmbedder(hidden_size)
        # Row `num_classes` is the null class that label dropout trains and guidance samples with.
        self.class_emb = nn.Embedding(num_classes + 1, hidden_size) if num_classes else None
        self.blocks = nn.ModuleList(Block(hidden_size, num_heads, mlp_ratio) for _ in range(depth))
        self.norm_out = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Linear(hidden_size, 2 * hidden_size)
        self.out = nn.Linear(hidden_size, patch * patch * self.out_channels)
        for layer in (self.ada_out, self.out):  # the output starts at zero, like the UNet's last conv
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def unpatchify(self, x):  # (B, N, p*p*C) -> (B, C, H, W)
        b, p, g, c = x.shape[0], self.patch, self.grid, self.out_channels
        return x.reshape(b, g, g, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, g * p, g * p)

    def forward(self, x, c_noise, labels=None):
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos.to(x.dtype)  # (B, N, D)
        cond = self.noise_emb(c_noise)
        if self.class_emb is not None:
            cond = cond + self.class_emb(labels)
        for block in self.blocks:
            h = block(h, cond)
        shift, scale = self.ada_out(F.silu(cond)).chunk(2, dim=1)
        return self.unpatchify(self.out(_modulate(self.norm_out(h), shift, scale)))


def build(resolution: int, in_channels: int, num_classes: int, size: str | None = None, patch: int = 2,
          **kwargs) -> DiT:
    """The network contract of diffrelay.nets; `size` S/B/L/XL fills depth, hidden_size and num_heads."""
    if size is not None:
        if size not in SIZES:
            raise ValueError(f"size={size!r}: choose one of {', '.join(SIZES)}")
        depth, hidden, heads = SIZES[size]
        kwargs = {"depth": depth, "hidden_size": hidden, "num_heads": heads} | kwargs
    return DiT(resolution, in_channels, num_classes, patch=patch, **kwargs)
