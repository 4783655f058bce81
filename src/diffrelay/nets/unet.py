"""A compact UNet for EDM denoising: residual blocks with noise/class modulation, optional attention."""

import math

import torch
import torch.nn.functional as F
from torch import nn

from diffrelay.nets import memory


def _groups(ch: int) -> int:
    # GroupNorm needs a divisor of the channel count; aim for about 4 channels a group, at most 32 groups.
    g = min(32, max(1, ch // 4))
    while ch % g:
        g -= 1
    return g


class NoiseEmbedding(nn.Module):
    """Sinusoidal features of the (scalar) noise condition, then an MLP."""

    def __init__(self, dim: int):
        super().__init__()
        self.freqs = dim // 2
        self.mlp = nn.Sequential(nn.Linear(dim, dim * 4), nn.SiLU(), nn.Linear(dim * 4, dim * 4))

    def forward(self, c_noise):  # (B,) -> (B, 4*dim)
        k = torch.arange(self.freqs, device=c_noise.device, dtype=torch.float32)
        freqs = torch.exp(-math.log(10000) * k / self.freqs)
        x = c_noise.float()[:, None] * freqs[None]
        return self.mlp(torch.cat([x.cos(), x.sin()], dim=1).to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, emb_dim: int, dropout: float):
        super().__init__()
        self.norm1 = nn.GroupNorm(_groups(cin), cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.affine = nn.Linear(emb_dim, cout * 2)  # per-channel scale and shift from the embedding
        self.norm2 = nn.GroupNorm(_groups(cout), cout)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        nn.init.zeros_(self.conv2.weight)  # each block starts as the identity
        nn.init.zeros_(self.conv2.bias)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, emb):
        h = self.conv1(F.silu(self.norm1(x)))
        scale, shift = self.affine(emb)[:, :, None, None].chunk(2, dim=1)
        h = F.silu(self.norm2(h) * (1 + scale) + shift)
        h = self.conv2(self.dropout(h))
        skip = pointwise(self.skip, x) if isinstance(self.skip, nn.Conv2d) else x
        return (h + skip) / math.sqrt(2)


def pointwise(conv: nn.Conv2d, x):
    """A 1x1 convolution computed as a matrix product over channels, with the Conv2d's own parameters.

    Conv backward may hand back a channels-last gradient for a 1x1 kernel, which DDP reports as
    "grad strides do not match bucket view strides" on every run; the gradient of this form keeps the
    weight's own layout."""
    b, _, h, w = x.shape
    y = F.linear(x.flatten(2).transpose(1, 2), conv.weight.flatten(1), conv.bias)
    return y.transpose(1, 2).reshape(b, -1, h, w)


class Attention(nn.Module):
    def __init__(self, ch: int, head_dim: int = 32):
        super().__init__()
        self.heads = max(1, ch // head_dim)
        self.norm = nn.GroupNorm(_groups(ch), ch)
        self.qkv = nn.Conv2d(ch, ch * 3, 1)
        self.proj = nn.Conv2d(ch, ch, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = pointwise(self.qkv, self.norm(x)).reshape(b, 3, self.heads, c // self.heads, h * w).unbind(1)
        y = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2))
        y = y.transpose(-1, -2).reshape(b, c, h, w)
        return (x + pointwise(self.proj, y)) / math.sqrt(2)


class UNet(nn.Module):
    """F(x, c_noise, labels) -> same shape as x. Level i works at resolution / 2**i."""

    def __init__(self, resolution: int, in_channels: int = 3, channels: int = 32, channel_mult=(1, 2, 2),
                 num_blocks: int = 1, attn_resolutions=(), dropout: float = 0.0, num_classes: int = 0):
        super().__init__()
        emb_dim = channels * 4
        self.num_classes = num_classes
        self.noise_emb = NoiseEmbedding(channels)
        # One row more than the classes: label `num_classes` is the null class of classifier-free guidance.
        self.class_emb = nn.Embedding(num_classes + 1, emb_dim) if num_classes else None
        self.conv_in = nn.Conv2d(in_channels, channels, 3, padding=1)

        self.down, skips, ch, res = nn.ModuleList(), [channels], channels, resolution
        for level, mult in enumerate(channel_mult):
            if level:
                self.down.append(nn.AvgPool2d(2))
                skips.append(ch)
                res //= 2
            for _ in range(num_blocks):
                self.down.append(ResBlock(ch, channels * mult, emb_dim, dropout))
                ch = channels * mult
                if res in attn_resolutions:
                    self.down.append(Attention(ch))
                skips.append(ch)

        self.mid = nn.ModuleList([ResBlock(ch, ch, emb_dim, dropout), Attention(ch), ResBlock(ch, ch, emb_dim, dropout)])

        self.up = nn.ModuleList()
        for level, mult in reversed(list(enumerate(channel_mult))):
            for _ in range(num_blocks + 1):
                self.up.append(ResBlock(ch + skips.pop(), channels * mult, emb_dim, dropout))
                ch = channels * mult
                if res in attn_resolutions:
                    self.up.append(Attention(ch))
            if level:
                self.up.append(nn.Upsample(scale_factor=2, mode="nearest"))
                res *= 2
        self.norm_out = nn.GroupNorm(_groups(ch), ch)
        self.conv_out = nn.Conv2d(ch, in_channels, 3, padding=1)
        self.checkpointing = False  # train.activation_checkpointing: recompute each block in the backward pass
        nn.init.zeros_(self.conv_out.weight)
        nn.init.zeros_(self.conv_out.bias)

    def _block(self, layer, h, emb):
        if isinstance(layer, ResBlock):
            return memory.call(self.checkpointing, layer, h, emb)
        return memory.call(self.checkpointing and isinstance(layer, Attention), layer, h)

    def forward(self, x, c_noise, labels=None):
        emb = self.noise_emb(c_noise)
        if self.class_emb is not None:
            emb = emb + self.class_emb(labels)
        emb = F.silu(emb)
        h = self.conv_in(x)
        skips = [h]
        for layer in self.down:
            h = self._block(layer, h, emb)
            if not isinstance(layer, Attention):
                skips.append(h)
            else:
                skips[-1] = h
        for layer in self.mid:
            h = self._block(layer, h, emb)
        for layer in self.up:
            h = self._block(layer, torch.cat([h, skips.pop()], dim=1) if isinstance(layer, ResBlock) else h, emb)
        return self.conv_out(F.silu(self.norm_out(h)))


def build(resolution: int, in_channels: int, num_classes: int, channel_mult=(1, 2, 2), attn_resolutions=(),
          **kwargs) -> UNet:
    """The network contract of diffrelay.nets (see there); kwargs are UNet's own keywords."""
    return UNet(resolution=resolution, in_channels=in_channels, channel_mult=tuple(channel_mult),
                attn_resolutions=tuple(attn_resolutions), num_classes=num_classes, **kwargs)
