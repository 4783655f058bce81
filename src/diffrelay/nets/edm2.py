"""edm2's magnitude-preserving UNet (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of
Diffusion Models") and its learned uncertainty head, written for diffrelay from the paper's formulas.

Checked number for number against NVlabs/edm2's training/networks_edm2.py (benchmarks/checks/check_edm2_equivalence.py):
the same computation on the same weights in float32, eval and train mode (dropout, forced weight normalisation,
gradients). edm2 computes norms, weights and Fourier features in float32 and its code refuses float64
(vector_norm will not narrow); here float64 stays float64 throughout, float16/bfloat16 widen to float32 as there.
Formulas name the paper's equations as that file does. Parameter and buffer names are edm2's (they are the
checkpoint format), so a state dict of edm2's Precond loads after `official_keys` strips the `unet.` prefix; the
Fourier buffers (freqs, phases) are random at init and persistent, as in edm2.

F(x, c_noise, labels) is edm2's UNet, not its Precond: diffrelay's Denoiser applies the same c_in, c_out,
c_skip and c_noise = ln(sigma)/4. Labels are integers; K (= num_classes) is "no class", the zero one-hot vector
(edm2's Precond feeds zeros when it has no labels). `logvar(c_noise)` is Precond's u(sigma) (Eq. 21), shaped
(B, 1, 1, 1), for edm2's loss (weight / exp(logvar)) * (D - y)^2 + logvar.

Forced weight normalisation (Eq. 66): in train mode every MPConv overwrites its stored weight with the
normalised weight *during forward*, before using it, so weights change in forward (every DDP rank applies the
same deterministic projection, and replicas stay equal). For float32 (and here float64) weights the layer then
computes with normalize(normalize(w)) (edm2 reads the weight after overwriting it: .to(float32) is the same
tensor), for half-precision weights with normalize(w) (a float32 copy); we keep both. Normalising twice is not
bitwise idempotent (eps and float32 rounding move most weights by an ulp or more), so a block recomputed by
activation checkpointing would compute with other weights than its first pass: with `checkpointing` on, the
network projects a block's weights once, before the block, and the block's MPConvs skip their own projection
(`forced`), which for float32/float64 weights is the same computation bit for bit, and the recomputation
repeats it exactly.

Presets are edm2's ImageNet sizes (train_edm2.py config_presets: model_channels, dropout) with its UNet defaults
(channel_mult 1,2,3,4, three blocks a level, attention at 16x16 and 8x8); other resolutions keep edm2's rule:
level l runs at resolution >> l and attends where that is in attn_resolutions.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from diffrelay.nets import memory, precision

# train_edm2.py config_presets: the same channels and dropout for edm2-img512-* and edm2-img64-* (xs, s: 0).
PRESETS = {
    "xs": {"model_channels": 128, "dropout": 0.0},
    "s": {"model_channels": 192, "dropout": 0.0},
    "m": {"model_channels": 256, "dropout": 0.1},
    "l": {"model_channels": 320, "dropout": 0.1},
    "xl": {"model_channels": 384, "dropout": 0.1},
    "xxl": {"model_channels": 448, "dropout": 0.1},
}
# Keywords build() takes besides the contract's three (nets.registry checks model.kwargs against them).
KWARGS = ("preset", "model_channels", "channel_mult", "channel_mult_noise", "channel_mult_emb", "num_blocks",
          "attn_resolutions", "label_balance", "concat_balance", "dropout", "logvar_channels", "channels_per_head",
          "res_balance", "attn_balance", "clip_act", "resample_filter")


def wide(dtype):
    # edm2 computes norms, weights and Fourier features in float32; float64 (which edm2's code refuses) stays.
    return torch.promote_types(dtype, torch.float32)


def normalize(x, dim=None, eps=1e-4):
    """x scaled to unit RMS over `dim` (default all but the first): x / (eps + |x| / sqrt(n)), the norm taken in
    at least float32."""
    dim = list(range(1, x.ndim)) if dim is None else dim
    norm = torch.linalg.vector_norm(x, dim=dim, keepdim=True, dtype=wide(x.dtype))
    norm = torch.add(eps, norm, alpha=math.sqrt(norm.numel() / x.numel()))
    return x / norm.to(x.dtype)


def mp_silu(x):
    # Eq. 81: SiLU of a unit normal has RMS 0.596; dividing restores unit magnitude.
    return F.silu(x) / 0.596


def mp_sum(a, b, t=0.5):
    # Eq. 88: (1-t) a + t b, rescaled so two independent unit-magnitude inputs give a unit-magnitude output.
    return a.lerp(b, t) / math.sqrt((1 - t) ** 2 + t ** 2)


def mp_cat(a, b, dim=1, t=0.5):
    # Eq. 103: concatenation weighted (1-t) : t per tensor, not per channel, with unit overall magnitude.
    na, nb = a.shape[dim], b.shape[dim]
    scale = math.sqrt((na + nb) / ((1 - t) ** 2 + t ** 2))
    return torch.cat([scale / math.sqrt(na) * (1 - t) * a, scale / math.sqrt(nb) * t * b], dim=dim)


class MPFourier(nn.Module):
    """Eq. 75: sqrt(2) cos(2 pi (f x + phi)) with fixed random f ~ N(0, 1), phi ~ U(0, 1), in at least float32."""

    def __init__(self, channels: int, bandwidth: float = 1.0):
        super().__init__()
        self.register_buffer("freqs", 2 * math.pi * torch.randn(channels) * bandwidth)
        self.register_buffer("phases", 2 * math.pi * torch.rand(channels))

    def forward(self, x):  # (B,) -> (B, channels)
        dtype = wide(x.dtype)
        y = x.to(dtype).ger(self.freqs.to(dtype)) + self.phases.to(dtype)
        return (y.cos() * math.sqrt(2)).to(x.dtype)


class MPConv(nn.Module):
    """Eq. 47 convolution (kernel k x k) or linear layer (kernel ()), no bias: the weight is normalised per output
    channel and scaled by gain / sqrt(fan_in), so unit-magnitude inputs give unit-magnitude outputs."""

    def __init__(self, in_channels: int, out_channels: int, kernel: tuple = ()):
        super().__init__()
        self.out_channels = out_channels
        self.weight = nn.Parameter(torch.randn(out_channels, in_channels, *kernel))
        self.forced = True  # project in forward (train mode); off while the network projects for checkpointing

    def project(self):
        """Eq. 66, forced weight normalisation: the stored weight becomes its normalised self."""
        with torch.no_grad():
            self.weight.copy_(normalize(self.weight.to(wide(self.weight.dtype))))

    def forward(self, x, gain=1):
        w = self.weight.to(wide(self.weight.dtype))  # float32 or float64 weights: the parameter itself (docstring)
        if self.training and self.forced:
            self.project()
        w = normalize(w)
        w = (w * (gain / math.sqrt(w[0].numel()))).to(x.dtype)
        if w.ndim == 2:
            return x @ w.t()
        return F.conv2d(x, w, padding=w.shape[-1] // 2)


class Block(nn.Module):
    """Figure 21: an encoder ('enc') or decoder ('dec') residual block, optionally resampling first and attending
    last. Encoder blocks project the skip on the main path and pixel-normalise it; decoder blocks project it only
    where the branches meet, since their input is a magnitude-preserving concatenation."""

    def __init__(self, in_channels: int, out_channels: int, emb_channels: int, flavor: str = "enc",
                 resample_mode: str = "keep", resample_filter=(1, 1), attention: bool = False,
                 channels_per_head: int = 64, dropout: float = 0.0, res_balance: float = 0.3,
                 attn_balance: float = 0.3, clip_act: float | None = 256):
        super().__init__()
        self.out_channels, self.flavor, self.resample_mode = out_channels, flavor, resample_mode
        # As edm2: fewer channels than channels_per_head means no heads, so no attention.
        self.num_heads = out_channels // channels_per_head if attention else 0
        self.dropout, self.res_balance, self.attn_balance, self.clip_act = dropout, res_balance, attn_balance, clip_act
        if resample_mode != "keep":
            f = torch.tensor(resample_filter, dtype=torch.float32)
            if f.ndim != 1 or len(f) % 2:
                raise ValueError(f"resample_filter={resample_filter}: an even-length 1-D filter")
            f = f / f.sum()
            self.register_buffer("filter", torch.outer(f, f)[None, None], persistent=False)
        self.emb_gain = nn.Parameter(torch.zeros([]))  # modulation starts off: c = 1
        self.conv_res0 = MPConv(out_channels if flavor == "enc" else in_channels, out_channels, (3, 3))
        self.emb_linear = MPConv(emb_channels, out_channels)
        self.conv_res1 = MPConv(out_channels, out_channels, (3, 3))
        self.conv_skip = MPConv(in_channels, out_channels, (1, 1)) if in_channels != out_channels else None
        if self.num_heads:
            self.attn_qkv = MPConv(out_channels, 3 * out_channels, (1, 1))
            self.attn_proj = MPConv(out_channels, out_channels, (1, 1))

    def resample(self, x):
        # 2x2 box by default: a depthwise stride-2 convolution down, its transpose (gain 4) up.
        if self.resample_mode == "keep":
            return x
        c, f = x.shape[1], self.filter.to(x.dtype)
        pad = (f.shape[-1] - 1) // 2
        if self.resample_mode == "down":
            return F.conv2d(x, f.tile([c, 1, 1, 1]), groups=c, stride=2, padding=pad)
        return F.conv_transpose2d(x, (f * 4).tile([c, 1, 1, 1]), groups=c, stride=2, padding=pad)

    def attention(self, x):
        # qkv channels are laid out (head, channel, q/k/v); q, k, v are pixel-normalised per head (cosine attention).
        b, _, h, w = x.shape
        qkv = self.attn_qkv(x).reshape(b, self.num_heads, -1, 3, h * w)
        q, k, v = normalize(qkv, dim=2).unbind(3)
        weights = torch.einsum("nhcq,nhck->nhqk", q, k / math.sqrt(q.shape[2])).softmax(dim=3)
        y = torch.einsum("nhqk,nhck->nhcq", weights, v)
        return self.attn_proj(y.reshape(*x.shape))

    def forward(self, x, emb):
        x = self.resample(x)
        if self.flavor == "enc":
            if self.conv_skip is not None:
                x = self.conv_skip(x)
            x = normalize(x, dim=1)  # pixel norm keeps the main path at unit magnitude
        y = self.conv_res0(mp_silu(x))
        scale = self.emb_linear(emb, gain=self.emb_gain) + 1
        y = mp_silu(y * scale[:, :, None, None].to(y.dtype))
        if self.training and self.dropout != 0:
            y = F.dropout(y, p=self.dropout)
        y = self.conv_res1(y)
        if self.flavor == "dec" and self.conv_skip is not None:
            x = self.conv_skip(x)
        x = mp_sum(x, y, t=self.res_balance)
        if self.num_heads:
            x = mp_sum(x, self.attention(x), t=self.attn_balance)
        if self.clip_act is not None:
            x = x.clip_(-self.clip_act, self.clip_act)  # in place, as edm2 (the gradient at the bound follows it)
        return x


class EDM2UNet(nn.Module):
    """F(x, c_noise, labels) -> shaped like x, plus logvar(c_noise). Names of modules follow edm2's checkpoints:
    enc/dec entries '{res}x{res}_conv|_down|_up|_in0|_in1|_block{i}', emb_*, out_*, logvar_*."""

    def __init__(self, resolution: int, in_channels: int, num_classes: int, model_channels: int = 192,
                 channel_mult=(1, 2, 3, 4), channel_mult_noise: int | None = None,
                 channel_mult_emb: int | None = None, num_blocks: int = 3, attn_resolutions=(16, 8),
                 label_balance: float = 0.5, concat_balance: float = 0.5, logvar_channels: int = 128,
                 dropout: float = 0.0, channels_per_head: int = 64, res_balance: float = 0.3,
                 attn_balance: float = 0.3, clip_act: float | None = 256, resample_filter=(1, 1)):
        super().__init__()
        channel_mult, attn_resolutions = list(channel_mult), list(attn_resolutions)
        if not channel_mult or resolution % (1 << (len(channel_mult) - 1)):
            raise ValueError(f"resolution {resolution} must halve evenly {len(channel_mult) - 1} times "
                             f"(channel_mult={channel_mult})")
        blk = dict(dropout=dropout, channels_per_head=channels_per_head, res_balance=res_balance,
                   attn_balance=attn_balance, clip_act=clip_act, resample_filter=tuple(resample_filter))
        cblock = [model_channels * m for m in channel_mult]
        cnoise = model_channels * channel_mult_noise if channel_mult_noise is not None else cblock[0]
        cemb = model_channels * channel_mult_emb if channel_mult_emb is not None else max(cblock)
        self.num_classes, self.label_balance, self.concat_balance = num_classes, label_balance, concat_balance
        self.out_gain = nn.Parameter(torch.zeros([]))  # the output starts at zero
        self.emb_fourier = MPFourier(cnoise)
        self.emb_noise = MPConv(cnoise, cemb)
        self.emb_label = MPConv(num_classes, cemb) if num_classes else None

        # Encoder: a 3x3 conv on the image and a ones channel (so the conv can see the image border), then per
        # level a downsampling block (not at the top) and num_blocks blocks; every output is a skip.
        self.enc = nn.ModuleDict()
        cout = in_channels + 1
        for level, channels in enumerate(cblock):
            res = resolution >> level
            if level == 0:
                self.enc[f"{res}x{res}_conv"] = MPConv(cout, channels, (3, 3))
                cout = channels
            else:
                self.enc[f"{res}x{res}_down"] = Block(cout, cout, cemb, "enc", resample_mode="down", **blk)
            for i in range(num_blocks):
                self.enc[f"{res}x{res}_block{i}"] = Block(cout, channels, cemb, "enc",
                                                          attention=res in attn_resolutions, **blk)
                cout = channels

        # Decoder: two blocks at the bottom (the first always attends), an upsampling block elsewhere, then
        # num_blocks + 1 blocks per level, each eating one skip, last in first out.
        self.dec = nn.ModuleDict()
        skips = [m.out_channels for m in self.enc.values()]
        for level in reversed(range(len(cblock))):
            res = resolution >> level
            if level == len(cblock) - 1:
                self.dec[f"{res}x{res}_in0"] = Block(cout, cout, cemb, "dec", attention=True, **blk)
                self.dec[f"{res}x{res}_in1"] = Block(cout, cout, cemb, "dec", **blk)
            else:
                self.dec[f"{res}x{res}_up"] = Block(cout, cout, cemb, "dec", resample_mode="up", **blk)
            for i in range(num_blocks + 1):
                self.dec[f"{res}x{res}_block{i}"] = Block(cout + skips.pop(), cblock[level], cemb, "dec",
                                                          attention=res in attn_resolutions, **blk)
                cout = cblock[level]
        self.out_conv = MPConv(cout, in_channels, (3, 3))

        # Precond's uncertainty head, kept here so it trains, averages and saves with the network.
        self.logvar_fourier = MPFourier(logvar_channels)
        self.logvar_linear = MPConv(logvar_channels, 1)
        self.checkpointing = False  # train.activation_checkpointing: recompute each block in the backward pass

    def run(self, block, x, emb):
        """block(x, emb), recomputed in the backward pass when checkpointing; the forced weight normalisation
        is then done here, once, so that the recomputation computes with the same weights (module docstring)."""
        recompute = self.checkpointing and self.training and torch.is_grad_enabled()
        for conv in block.modules():
            if isinstance(conv, MPConv):
                conv.forced = not recompute
                if recompute:
                    conv.project()
        return memory.call(recompute, block, x, emb)

    def one_hot(self, labels, like):
        """(B,) integer labels -> (B, K) one-hot in `like`'s dtype; label K (or no labels) -> zeros."""
        if labels is None:
            return torch.zeros(like.shape[0], self.num_classes, dtype=like.dtype, device=like.device)
        classes = torch.arange(self.num_classes, device=labels.device)
        return (labels.reshape(-1, 1) == classes).to(like.dtype)

    def embed(self, c_noise, labels):
        emb = self.emb_noise(self.emb_fourier(c_noise))
        if self.emb_label is not None:
            # one-hot x sqrt(K) has unit magnitude; the null class stays zero (edm2's unconditional input)
            onehot = self.one_hot(labels, c_noise)
            emb = mp_sum(emb, self.emb_label(onehot * math.sqrt(onehot.shape[1])), t=self.label_balance)
        return mp_silu(emb)

    def forward(self, x, c_noise, labels=None):
        emb = self.embed(c_noise, labels)
        x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        skips = []
        for name, block in self.enc.items():
            x = block(x) if name.endswith("_conv") else self.run(block, x, emb)
            skips.append(x)
        for name, block in self.dec.items():
            if "_block" in name:
                x = mp_cat(x, skips.pop(), t=self.concat_balance)
            x = self.run(block, x, emb)
        return self.out_conv(x, gain=self.out_gain)

    def logvar(self, c_noise):
        """edm2's u(sigma) from c_noise = ln(sigma)/4: (B,) -> (B, 1, 1, 1), in at least float32, autocast or not."""
        # edm2's Precond (networks_edm2.py) runs the head in float32 beside its fp16 UNet; under autocast its linear
        # would be fp16, and with train.loss_reduction sum its gradient (a sum over C x H x W) overflowed there.
        with precision.autocast_off(c_noise.device):
            c_noise = c_noise.to(wide(c_noise.dtype))
            return self.logvar_linear(self.logvar_fourier(c_noise)).reshape(-1, 1, 1, 1)


def build(resolution: int, in_channels: int, num_classes: int, preset: str | None = None, **kwargs) -> EDM2UNet:
    """The network contract of diffrelay.nets; `preset` xs..xxl fills model_channels and dropout (kwargs win).
    Without a preset: edm2's UNet defaults (192 channels, the S size, no dropout)."""
    if preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"preset={preset!r}: choose one of {', '.join(PRESETS)}")
        kwargs = PRESETS[preset] | kwargs
    return EDM2UNet(resolution, in_channels, num_classes, **kwargs)


def official_keys(state: dict) -> dict:
    """A state dict of edm2's Precond (unet.*, logvar_fourier.*, logvar_linear.*) in this module's names."""
    return {k.removeprefix("unet."): v for k, v in state.items()}
