"""Diffusion Transformer (Peebles & Xie 2023): patches as tokens, adaLN-Zero blocks, a learned class table.

Written for diffrelay from the paper and checked number for number against facebookresearch/DiT's models.py
(benchmarks/checks/check_dit_equivalence.py): the same computation, fixed 2-D sine/cosine position table (columns
first), initialisation (xavier-uniform linears, class table and time MLP N(0, 0.02^2), adaLN and output at
zero) and, with `out_channels` = 2 x in_channels, DiT's learned-sigma output layout. diffrelay's objectives
predict no variance: those extra channels are computed (so DiT's checkpoints load and count as published) and
dropped. `official_keys` maps DiT's state-dict names onto these modules. Sizes S/B/L/XL and patch sizes 2/4/8
are presets; `depth`, `hidden_size` and `num_heads` may be given instead of `size` for small models.

The time input is multiplied by `time_scale` before the sinusoids: 1000 (the default) for EDM's c_noise =
ln(sigma)/4 and flow's t in [0, 1]; 1 gives DiT's own embedding of its integer timesteps (and SiT's of t).
`pos_order: rows` is the table diffrelay's DiT had before it was checked (rows first); snapshots written
then record no `dit_layout` and load with it (checkpoint.load_snapshot), new runs never use it.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from diffrelay.nets import memory

SIZES = {  # (depth, hidden size, heads), table 1 of the paper
    "S": (12, 384, 6),
    "B": (12, 768, 12),
    "L": (24, 1024, 16),
    "XL": (28, 1152, 16),
}
FREQ_DIM = 256  # sinusoidal features of the noise level before its MLP


def _modulate(x, shift, scale):  # x (B, N, D); shift, scale (B, D)
    return x * (1 + scale[:, None]) + shift[:, None]


def _sincos_2d(grid: int, dim: int, columns_first: bool = True) -> torch.Tensor:
    """Fixed 2-D sine/cosine position table (grid*grid, dim), tokens row by row: the first half of the features
    encodes the token's column and the second its row, as DiT's get_2d_sincos_pos_embed (its meshgrid puts
    the width coordinate first); each half is sin then cos of position x 10000^(-k / (dim/4))."""
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float64) / quarter)
    pos = torch.arange(grid, dtype=torch.float64)
    ang = pos[:, None] * omega[None]  # (grid, quarter)
    axis = torch.cat([ang.sin(), ang.cos()], dim=1)  # (grid, dim/2)
    rows = axis[:, None, :].expand(grid, grid, -1)
    cols = axis[None, :, :].expand(grid, grid, -1)
    halves = [cols, rows] if columns_first else [rows, cols]
    return torch.cat(halves, dim=-1).reshape(grid * grid, dim).float()


class NoiseEmbedder(nn.Module):
    """Scalar noise condition -> sinusoidal features -> MLP to the hidden size."""

    def __init__(self, hidden: int, time_scale: float = 1000.0):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(FREQ_DIM, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        self.time_scale = float(time_scale)

    def forward(self, c_noise):  # (B,) -> (B, hidden)
        half = FREQ_DIM // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, device=c_noise.device, dtype=torch.float32) / half)
        # EDM's c_noise = ln(sigma)/4 spans about [-1.6, 1.1]; stretch it so the slow frequencies still vary.
        t = c_noise.float() if self.time_scale == 1 else c_noise.float() * self.time_scale
        x = t[:, None] * freqs[None]
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
    """F(x, c_noise, labels) -> same shape as x. out_channels: in_channels, or twice that for DiT's learned-sigma
    layout, whose second half (the variance) is computed and dropped."""

    def __init__(self, resolution: int, in_channels: int, num_classes: int, patch: int = 2, depth: int = 12,
                 hidden_size: int = 384, num_heads: int = 6, mlp_ratio: float = 4.0, out_channels: int | None = None,
                 time_scale: float = 1000.0, pos_order: str = "columns"):
        super().__init__()
        if resolution % patch:
            raise ValueError(f"patch={patch} does not divide the resolution {resolution}")
        if hidden_size % num_heads or hidden_size % 4:
            raise ValueError(f"hidden_size={hidden_size} must be a multiple of num_heads={num_heads} and of 4")
        if out_channels not in (None, in_channels, 2 * in_channels):
            raise ValueError(f"out_channels={out_channels}: {in_channels} (the image's channels) or "
                             f"{2 * in_channels} (DiT's learned-sigma layout)")
        if pos_order not in ("columns", "rows"):
            raise ValueError(f"pos_order={pos_order!r}: columns (DiT's) or rows (diffrelay's DiT before dit_layout 2)")
        self.patch, self.out_channels, self.grid = patch, out_channels or in_channels, resolution // patch
        self.in_channels = in_channels
        self.embed = nn.Conv2d(in_channels, hidden_size, patch, stride=patch)
        self.register_buffer("pos", _sincos_2d(self.grid, hidden_size, pos_order == "columns")[None], persistent=False)
        # DiT keeps this fixed table as a frozen parameter and counts it (registry.num_params adds it).
        self.fixed_parameters = self.pos.numel()
        self.noise_emb = NoiseEmbedder(hidden_size, time_scale)
        # Row `num_classes` is the null class that label dropout trains and guidance samples with.
        self.class_emb = nn.Embedding(num_classes + 1, hidden_size) if num_classes else None
        self.blocks = nn.ModuleList(Block(hidden_size, num_heads, mlp_ratio) for _ in range(depth))
        self.checkpointing = False  # train.activation_checkpointing: recompute each block in the backward pass
        self.norm_out = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.ada_out = nn.Linear(hidden_size, 2 * hidden_size)
        self.out = nn.Linear(hidden_size, patch * patch * self.out_channels)
        self._init_weights()

    def _init_weights(self):
        """DiT's initialize_weights: xavier-uniform linears and patch projection (as a linear) with zero biases,
        class table and time MLP weights N(0, 0.02^2), every adaLN layer and the output layer at zero (each
        block starts as the identity and the network's output at zero)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.xavier_uniform_(self.embed.weight.view(self.embed.weight.shape[0], -1))
        nn.init.zeros_(self.embed.bias)
        if self.class_emb is not None:
            nn.init.normal_(self.class_emb.weight, std=0.02)
        nn.init.normal_(self.noise_emb.mlp[0].weight, std=0.02)
        nn.init.normal_(self.noise_emb.mlp[2].weight, std=0.02)
        for layer in [b.ada for b in self.blocks] + [self.ada_out, self.out]:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def unpatchify(self, x):  # (B, N, p*p*C) -> (B, C, H, W)
        b, p, g, c = x.shape[0], self.patch, self.grid, self.out_channels
        return x.reshape(b, g, g, p, p, c).permute(0, 5, 1, 3, 2, 4).reshape(b, c, g * p, g * p)

    def forward_all(self, x, c_noise, labels=None):
        """Every output channel, the learned-sigma half too (DiT's own output)."""
        h = self.embed(x).flatten(2).transpose(1, 2) + self.pos.to(x.dtype)  # (B, N, D)
        cond = self.noise_emb(c_noise)
        if self.class_emb is not None:
            cond = cond + self.class_emb(labels)
        for block in self.blocks:
            h = memory.call(self.checkpointing, block, h, cond)
        shift, scale = self.ada_out(F.silu(cond)).chunk(2, dim=1)
        return self.unpatchify(self.out(_modulate(self.norm_out(h), shift, scale)))

    def forward(self, x, c_noise, labels=None):
        out = self.forward_all(x, c_noise, labels)
        return out[:, :self.in_channels] if self.out_channels != self.in_channels else out


def build(resolution: int, in_channels: int, num_classes: int, size: str | None = None, patch: int = 2,
          **kwargs) -> DiT:
    """The network contract of diffrelay.nets; `size` S/B/L/XL fills depth, hidden_size and num_heads."""
    return _build(DiT, resolution, in_channels, num_classes, size, patch, kwargs)


def _build(cls, resolution, in_channels, num_classes, size, patch, kwargs):
    if size is not None:
        if size not in SIZES:
            raise ValueError(f"size={size!r}: choose one of {', '.join(SIZES)}")
        depth, hidden, heads = SIZES[size]
        kwargs = {"depth": depth, "hidden_size": hidden, "num_heads": heads} | kwargs
    return cls(resolution, in_channels, num_classes, patch=patch, **kwargs)


class SiT(DiT):
    """SiT (Ma et al. 2024): DiT's network under SiT's transport convention (willisma/SiT transport/), so SiT's
    checkpoints sample with diffrelay's flow objective. SiT's time s = 1 - t runs from noise (0) to data (1)
    and its network predicts x - eps, the negative of flow's eps - x at t (objectives/flow.py); it embeds s
    itself (time_scale 1). benchmarks/checks/check_dit_equivalence.py --sit-src compares it with SiT's models.py."""

    def forward(self, x, c_noise, labels=None):
        return -super().forward(x, 1 - c_noise, labels)


def build_sit(resolution: int, in_channels: int, num_classes: int, size: str | None = None, patch: int = 2,
              **kwargs) -> SiT:
    """The SiT network (flow objective only; config.py says so): DiT's sizes and patches, SiT's time."""
    return _build(SiT, resolution, in_channels, num_classes, size, patch, {"time_scale": 1} | kwargs)


# DiT's (and SiT's) state-dict names (facebookresearch/DiT models.py) -> these modules'; pos_embed is the fixed table.
_OFFICIAL = [("x_embedder.proj.", "embed."), ("t_embedder.mlp.", "noise_emb.mlp."),
             ("y_embedder.embedding_table.", "class_emb."), ("final_layer.linear.", "out."),
             ("final_layer.adaLN_modulation.1.", "ada_out."), (".attn.qkv.", ".qkv."), (".attn.proj.", ".proj."),
             (".mlp.fc1.", ".mlp.0."), (".mlp.fc2.", ".mlp.2."), (".adaLN_modulation.1.", ".ada.")]


def official_keys(state: dict) -> dict:
    """A state dict in DiT's own layout, renamed to this module's (its fixed pos_embed left out)."""
    out = {}
    for key, value in state.items():
        if key == "pos_embed":
            continue
        for theirs, ours in _OFFICIAL:
            if key.startswith(theirs) or (theirs.startswith(".") and theirs in key):
                key = key.replace(theirs, ours, 1)
                break
        out[key] = value
    return out
