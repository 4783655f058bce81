"""EDM's networks (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models"):
DDPM++ and NCSN++ (EDM's SongUNet) and ADM (EDM's DhariwalUNet), written for diffrelay from the formulas of
NVlabs/edm training/networks.py (layers, weight init, UNet block, embeddings, both UNets) and train.py (presets).

Checked number for number against that file (benchmarks/checks/check_edm_equivalence.py): on the same weights both give
bitwise the same output in eval mode, in train mode with dropout (same seed), in float32 and float64, and the
parameter counts of the full presets are equal. Parameter and buffer names are EDM's own (`map_noise.freqs`,
`enc.32x32_block0.conv0.weight`, `dec.32x32_aux_conv.bias`, ...): they are the checkpoint format, so the `model`
part of an EDMPrecond loads strictly as it is; `official_keys` only strips the `model.` prefix. The resample
filters and NCSN++'s random Fourier frequencies are persistent buffers there and here.

F(x, c_noise, labels) is the network inside EDMPrecond: diffrelay's Denoiser applies c_in, c_out, c_skip and
c_noise = ln(sigma)/4. Labels are integers; K (= num_classes) is "no class", EDM's label dropout's all-zero one-hot
row (diffrelay drops labels in its data pipeline). `augment_labels` (B, augment_dim): EDM's augmentation
parameters (train.augment); None skips them when sampling, as EDM does (zeros in training without augment).

Presets follow EDM's README commands: CIFAR-10 (--arch=ddpmpp / ncsnpp with train.py's defaults: dropout 0.13,
augment 0.12 so augment_dim 9) and ImageNet-64 (--arch=adm --dropout=0.10 --augment=0, so no augment embedding).
Every preset value may be overridden by a keyword.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from diffrelay.nets import memory, precision

_SONG = {"model_channels": 128, "channel_mult": (2, 2, 2), "channel_mult_emb": 4, "num_blocks": 4,
         "attn_resolutions": (16,), "dropout": 0.13, "augment_dim": 9}
PRESETS = {
    "ddpmpp": _SONG | {"embedding_type": "positional", "channel_mult_noise": 1, "encoder_type": "standard",
                       "decoder_type": "standard", "resample_filter": (1, 1)},
    "ncsnpp": _SONG | {"embedding_type": "fourier", "channel_mult_noise": 2, "encoder_type": "residual",
                       "decoder_type": "standard", "resample_filter": (1, 3, 3, 1)},
    "adm": {"model_channels": 192, "channel_mult": (1, 2, 3, 4), "channel_mult_emb": 4, "num_blocks": 3,
            "attn_resolutions": (32, 16, 8), "dropout": 0.10, "augment_dim": 0},
}
# Keywords each builder takes besides the contract's three (nets.registry checks model.kwargs against them).
KWARGS = {name: tuple(preset) for name, preset in PRESETS.items()}


def edm_init(shape, mode: str, fan_in: int, fan_out: int) -> torch.Tensor:
    """EDM's init modes (networks.py weight_init): U(-b, b) with b = sqrt(6 / (fan_in + fan_out)) (xavier) or
    sqrt(3 / fan_in) (kaiming); normal with std sqrt(2 / (fan_in + fan_out)) or sqrt(1 / fan_in)."""
    squares = {"xavier_uniform": 6 / (fan_in + fan_out), "xavier_normal": 2 / (fan_in + fan_out),
               "kaiming_uniform": 3 / fan_in, "kaiming_normal": 1 / fan_in}
    if mode not in squares:
        raise ValueError(f"init mode {mode!r}: one of {', '.join(squares)}")
    return math.sqrt(squares[mode]) * (torch.rand(shape) * 2 - 1 if mode.endswith("uniform") else torch.randn(shape))


class Linear(nn.Module):
    """y = x W^T + b; weight and bias drawn by `mode` with the layer's fans, scaled by `gain` and `bias_gain`."""

    def __init__(self, cin: int, cout: int, bias: bool = True, mode: str = "kaiming_normal", gain: float = 1.0,
                 bias_gain: float = 0.0):
        super().__init__()
        self.in_features = cin
        self.weight = nn.Parameter(edm_init((cout, cin), mode, cin, cout) * gain)
        self.bias = nn.Parameter(edm_init((cout,), mode, cin, cout) * bias_gain) if bias else None

    def forward(self, x):
        # A product then a separate add (not addmm): EDM rounds the product before adding the bias.
        y = x @ self.weight.to(x.dtype).t()
        return y if self.bias is None else y + self.bias.to(x.dtype)


class Conv(nn.Module):
    """A square convolution (kernel 0: none, only the resampling) with optional 2x up/down resampling by the FIR
    filter outer(f, f) / sum(f)^2 (sum 1). Unfused: resample first, then convolve. `fused` (NCSN++'s residual
    encoder path) convolves at full resolution with padding widened by the filter's, then blur-downsamples."""

    def __init__(self, cin: int, cout: int, kernel: int, bias: bool = True, up: bool = False, down: bool = False,
                 resample_filter=(1, 1), fused: bool = False, mode: str = "kaiming_normal", gain: float = 1.0,
                 bias_gain: float = 0.0):
        super().__init__()
        if up and down or fused and not (down and kernel):
            raise ValueError("a Conv resamples up or down, not both; fused needs down and a kernel")
        self.in_channels, self.out_channels, self.up, self.down, self.fused = cin, cout, up, down, fused
        fans = mode, cin * kernel * kernel, cout * kernel * kernel
        self.weight = nn.Parameter(edm_init((cout, cin, kernel, kernel), *fans) * gain) if kernel else None
        self.bias = nn.Parameter(edm_init((cout,), *fans) * bias_gain) if kernel and bias else None
        f = torch.as_tensor(resample_filter, dtype=torch.float32)
        self.register_buffer("resample_filter", (torch.outer(f, f) / f.sum().square())[None, None]
                             if up or down else None)

    def forward(self, x):
        w = self.weight.to(x.dtype) if self.weight is not None else None
        f = self.resample_filter.to(x.dtype) if self.resample_filter is not None else None
        w_pad = w.shape[-1] // 2 if w is not None else 0
        f_pad = (f.shape[-1] - 1) // 2 if f is not None else 0
        if self.fused:
            x = F.conv2d(x, w, padding=w_pad + f_pad)
            x = F.conv2d(x, f.tile(self.out_channels, 1, 1, 1), groups=self.out_channels, stride=2)
        else:
            if self.up:  # 4x the filter: a transposed stride-2 conv spreads each pixel over 4 outputs
                x = F.conv_transpose2d(x, (f * 4).tile(self.in_channels, 1, 1, 1), groups=self.in_channels,
                                       stride=2, padding=f_pad)
            if self.down:
                x = F.conv2d(x, f.tile(self.in_channels, 1, 1, 1), groups=self.in_channels, stride=2, padding=f_pad)
            if w is not None:
                x = F.conv2d(x, w, padding=w_pad)
        return x if self.bias is None else x + self.bias.to(x.dtype).reshape(1, -1, 1, 1)


def group_norm(channels: int, eps: float = 1e-5) -> nn.GroupNorm:
    # EDM: at most 32 groups and at least 4 channels a group (parameters weight and bias, as nn.GroupNorm's).
    return nn.GroupNorm(min(32, channels // 4), channels, eps=eps)


class Block(nn.Module):
    """EDM's UNetBlock, the union of DDPM++, NCSN++ and ADM blocks: GN-SiLU-conv, the embedding added (or, with
    adaptive_scale, as scale and shift after the second GN), SiLU, dropout, conv, plus the skip path (a 1x1 conv
    when channels change or resample_proj, the bare resampling otherwise), times skip_scale; then optional
    self-attention (logits and softmax in float32, under autocast too) added the same way."""

    def __init__(self, cin: int, cout: int, *, emb: int, init: dict, init_zero: dict, init_attn=None, up=False,
                 down=False, attention=False, num_heads=None, channels_per_head=64, dropout=0.0, skip_scale=1.0,
                 eps=1e-5, resample_filter=(1, 1), resample_proj=False, adaptive_scale=True):
        super().__init__()
        self.in_channels, self.out_channels = cin, cout
        # ADM: one head per 64 channels, so a block under 64 channels has no attention at all (as in EDM).
        self.num_heads = (num_heads or cout // channels_per_head) if attention else 0
        if self.num_heads and cout % self.num_heads:
            raise ValueError(f"{cout} channels do not split into {self.num_heads} attention heads")
        self.dropout, self.skip_scale, self.adaptive_scale = dropout, skip_scale, adaptive_scale
        self.norm0 = group_norm(cin, eps)
        self.conv0 = Conv(cin, cout, 3, up=up, down=down, resample_filter=resample_filter, **init)
        self.affine = Linear(emb, cout * (2 if adaptive_scale else 1), **init)
        self.norm1 = group_norm(cout, eps)
        self.conv1 = Conv(cout, cout, 3, **init_zero)
        kernel = 1 if resample_proj or cout != cin else 0  # 0: the skip path only resamples
        self.skip = Conv(cin, cout, kernel, up=up, down=down, resample_filter=resample_filter, **init) \
            if cout != cin or up or down else None
        if self.num_heads:
            self.norm2 = group_norm(cout, eps)
            self.qkv = Conv(cout, cout * 3, 1, **(init_attn if init_attn is not None else init))
            self.proj = Conv(cout, cout, 1, **init_zero)

    def forward(self, x, emb):
        h = self.conv0(F.silu(self.norm0(x)))
        params = self.affine(emb)[:, :, None, None].to(h.dtype)
        if self.adaptive_scale:
            scale, shift = params.chunk(2, dim=1)
            h = F.silu(torch.addcmul(shift, self.norm1(h), scale + 1))
        else:
            h = F.silu(self.norm1(h + params))
        h = self.conv1(F.dropout(h, p=self.dropout, training=self.training))
        h = (h + (self.skip(x) if self.skip is not None else x)) * self.skip_scale
        if self.num_heads:
            b, c = h.shape[:2]
            # qkv channels are laid out head by head, then channel, then (q, k, v): EDM's weight format.
            q, k, v = self.qkv(self.norm2(h)).reshape(b * self.num_heads, c // self.num_heads, 3, -1).unbind(2)
            with precision.autocast_off(h.device):  # float32 logits, softmax under autocast too (EDM's AttentionOp)
                w = torch.einsum("ncq,nck->nqk", q.float(), (k / math.sqrt(k.shape[1])).float()).softmax(2).to(q.dtype)
            a = torch.einsum("nqk,nck->ncq", w, v)
            h = (self.proj(a.reshape(h.shape)) + h) * self.skip_scale
        return h


class NoiseEmbedding(nn.Module):
    """Sinusoidal features of c_noise: positional (DDPM++, ADM) with frequencies (1/max_positions)^(i/(n/2 - e)),
    e = 1 with endpoint (the last frequency is exactly 1/max_positions), or fourier (NCSN++) with random
    frequencies N(0, scale^2) times 2 pi, kept as a persistent buffer. cos half first, sin half first for
    SongUNet (it swaps the halves, so its first layer's columns expect sin first)."""

    def __init__(self, channels: int, kind: str = "positional", endpoint: bool = False, max_positions: int = 10000,
                 scale: float = 16, sin_first: bool = False):
        super().__init__()
        if kind not in ("positional", "fourier"):
            raise ValueError(f"embedding_type={kind!r}: positional (DDPM++) or fourier (NCSN++)")
        self.kind, self.channels, self.endpoint, self.max_positions, self.sin_first = \
            kind, channels, endpoint, max_positions, sin_first
        if kind == "fourier":
            self.register_buffer("freqs", torch.randn(channels // 2) * scale)

    def forward(self, c):
        if self.kind == "fourier":
            freqs = 2 * math.pi * self.freqs
        else:  # frequencies in float32 whatever c's dtype, as EDM computes them
            half = self.channels // 2
            freqs = torch.arange(half, dtype=torch.float32, device=c.device) / (half - (1 if self.endpoint else 0))
            freqs = (1 / self.max_positions) ** freqs
        x = torch.outer(c, freqs.to(c.dtype))
        return torch.cat([x.sin(), x.cos()] if self.sin_first else [x.cos(), x.sin()], dim=1)


class _EDMNet(nn.Module):
    """What both UNets share: the contract's labels as EDM's one-hot, the block loop with checkpointing."""

    def setup(self, resolution: int, num_classes: int, channel_mult) -> None:
        if not channel_mult or resolution % (1 << (len(channel_mult) - 1)):
            raise ValueError(f"resolution {resolution} must halve evenly {len(channel_mult) - 1} times "
                             f"(channel_mult={list(channel_mult)})")
        self.num_classes, self.checkpointing = num_classes, False  # memory.call: train.activation_checkpointing

    def one_hot(self, labels, like):
        """(B,) integer labels -> (B, K) one-hot in `like`'s dtype; label K (the null class) and None -> zeros.
        A floating (B, K) tensor is taken as EDM's class_labels already."""
        k = self.num_classes
        if labels is None:
            return torch.zeros(like.shape[0], k, dtype=like.dtype, device=like.device)
        if labels.is_floating_point():
            return labels.to(like.dtype).reshape(-1, k)
        return (labels.reshape(-1, 1) == torch.arange(k, device=labels.device)).to(like.dtype)

    def run(self, block, x, emb):
        return memory.call(self.checkpointing, block, x, emb)


def _augment(labels, emb, dim: int):  # training without labels: zeros, so DDP sees the bias-free map used
    return emb.new_zeros(emb.shape[0], dim) if labels is None else labels.to(emb.dtype)


class SongUNet(_EDMNet):
    """DDPM++ / NCSN++ (Song et al. 2021, as EDM reimplements them). Modules follow EDM's checkpoint names:
    map_noise, map_label, map_augment, map_layer0/1; enc/dec entries '{res}x{res}_conv|_down|_up|_in0|_in1|
    _block{i}' and the auxiliary '_aux_down|_aux_skip|_aux_residual|_aux_up|_aux_norm|_aux_conv'."""

    def __init__(self, resolution: int, in_channels: int, num_classes: int = 0, augment_dim: int = 0,
                 model_channels: int = 128, channel_mult=(1, 2, 2, 2), channel_mult_emb: int = 4, num_blocks: int = 4,
                 attn_resolutions=(16,), dropout: float = 0.10, embedding_type: str = "positional",
                 channel_mult_noise: int = 1, encoder_type: str = "standard", decoder_type: str = "standard",
                 resample_filter=(1, 1)):
        super().__init__()
        self.setup(resolution, num_classes, channel_mult)
        if encoder_type not in ("standard", "skip", "residual") or decoder_type not in ("standard", "skip"):
            raise ValueError(f"encoder_type={encoder_type!r} (standard, skip or residual), "
                             f"decoder_type={decoder_type!r} (standard or skip)")
        emb, noise = model_channels * channel_mult_emb, model_channels * channel_mult_noise
        fir = tuple(resample_filter)
        init = {"mode": "xavier_uniform"}
        init_zero = {"mode": "xavier_uniform", "gain": 1e-5}  # near zero, not zero: every layer still learns
        blk = dict(emb=emb, num_heads=1, dropout=dropout, skip_scale=math.sqrt(0.5), eps=1e-6, resample_filter=fir,
                   resample_proj=True, adaptive_scale=False, init=init, init_zero=init_zero,
                   init_attn={"mode": "xavier_uniform", "gain": math.sqrt(0.2)})

        self.map_noise = NoiseEmbedding(noise, embedding_type, endpoint=True, sin_first=True)
        self.map_label = Linear(num_classes, noise, **init) if num_classes else None
        self.map_augment = Linear(augment_dim, noise, bias=False, **init) if augment_dim else None
        self.map_layer0 = Linear(noise, emb, **init)
        self.map_layer1 = Linear(emb, emb, **init)

        self.enc = nn.ModuleDict()
        cout = caux = in_channels  # caux: channels of the auxiliary image path (skip and residual encoders)
        for level, mult in enumerate(channel_mult):
            res = resolution >> level
            if level == 0:
                self.enc[f"{res}x{res}_conv"] = Conv(cout, model_channels, 3, **init)
                cout = model_channels
            else:
                self.enc[f"{res}x{res}_down"] = Block(cout, cout, down=True, **blk)
                if encoder_type == "skip":
                    self.enc[f"{res}x{res}_aux_down"] = Conv(caux, caux, 0, down=True, resample_filter=fir)
                    self.enc[f"{res}x{res}_aux_skip"] = Conv(caux, cout, 1, **init)
                if encoder_type == "residual":
                    self.enc[f"{res}x{res}_aux_residual"] = Conv(caux, cout, 3, down=True, resample_filter=fir,
                                                                 fused=True, **init)
                    caux = cout
            for i in range(num_blocks):
                self.enc[f"{res}x{res}_block{i}"] = Block(cout, model_channels * mult,
                                                          attention=res in attn_resolutions, **blk)
                cout = model_channels * mult
        skips = [m.out_channels for name, m in self.enc.items() if "_aux_" not in name]

        self.dec = nn.ModuleDict()
        last = len(channel_mult) - 1
        for level, mult in reversed(list(enumerate(channel_mult))):
            res = resolution >> level
            if level == last:
                self.dec[f"{res}x{res}_in0"] = Block(cout, cout, attention=True, **blk)
                self.dec[f"{res}x{res}_in1"] = Block(cout, cout, **blk)
            else:
                self.dec[f"{res}x{res}_up"] = Block(cout, cout, up=True, **blk)
            for i in range(num_blocks + 1):  # attention only after the level's last block
                self.dec[f"{res}x{res}_block{i}"] = Block(cout + skips.pop(), model_channels * mult,
                                                          attention=i == num_blocks and res in attn_resolutions, **blk)
                cout = model_channels * mult
            if decoder_type == "skip" or level == 0:  # the output head (every level for the skip decoder)
                if decoder_type == "skip" and level < last:
                    self.dec[f"{res}x{res}_aux_up"] = Conv(in_channels, in_channels, 0, up=True, resample_filter=fir)
                self.dec[f"{res}x{res}_aux_norm"] = group_norm(cout, eps=1e-6)
                self.dec[f"{res}x{res}_aux_conv"] = Conv(cout, in_channels, 3, **init_zero)

    def forward(self, x, c_noise, labels=None, augment_labels=None):
        emb = self.map_noise(c_noise)
        if self.map_label is not None:  # one-hot times sqrt(K): unit mean square, like the other inputs
            emb = emb + self.map_label(self.one_hot(labels, emb) * math.sqrt(self.num_classes))
        if self.map_augment is not None and (augment_labels is not None or self.training):
            emb = emb + self.map_augment(_augment(augment_labels, emb, self.map_augment.weight.shape[1]))
        emb = F.silu(self.map_layer1(F.silu(self.map_layer0(emb))))

        skips, aux = [], x
        for name, m in self.enc.items():
            role = name.partition("_")[2]
            if role == "aux_down":
                aux = m(aux)
            elif role == "aux_skip":
                x = skips[-1] = x + m(aux)
            elif role == "aux_residual":  # the image path runs beside the blocks, averaged in at each level
                x = skips[-1] = aux = (x + m(aux)) / math.sqrt(2)
            else:
                x = m(x) if role == "conv" else self.run(m, x, emb)
                skips.append(x)

        out = tmp = None
        for name, m in self.dec.items():
            role = name.partition("_")[2]
            if role == "aux_up":
                out = m(out)
            elif role == "aux_norm":
                tmp = m(x)
            elif role == "aux_conv":
                tmp = m(F.silu(tmp))
                out = tmp if out is None else tmp + out
            else:
                if role.startswith("block"):
                    x = torch.cat([x, skips.pop()], dim=1)
                x = self.run(m, x, emb)
        return out


class DhariwalUNet(_EDMNet):
    """ADM (Dhariwal & Nichol 2021, as EDM reimplements it). Modules follow EDM's checkpoint names: map_noise,
    map_augment, map_layer0/1, map_label; enc/dec entries '{res}x{res}_conv|_down|_up|_in0|_in1|_block{i}';
    out_norm, out_conv."""

    def __init__(self, resolution: int, in_channels: int, num_classes: int = 0, augment_dim: int = 0,
                 model_channels: int = 192, channel_mult=(1, 2, 3, 4), channel_mult_emb: int = 4, num_blocks: int = 3,
                 attn_resolutions=(32, 16, 8), dropout: float = 0.10):
        super().__init__()
        self.setup(resolution, num_classes, channel_mult)
        emb = model_channels * channel_mult_emb
        init = {"mode": "kaiming_uniform", "gain": math.sqrt(1 / 3), "bias_gain": math.sqrt(1 / 3)}
        init_zero = {"mode": "kaiming_uniform", "gain": 0.0, "bias_gain": 0.0}
        blk = dict(emb=emb, channels_per_head=64, dropout=dropout, init=init, init_zero=init_zero)

        self.map_noise = NoiseEmbedding(model_channels)
        self.map_augment = Linear(augment_dim, model_channels, bias=False, **init_zero) if augment_dim else None
        self.map_layer0 = Linear(model_channels, emb, **init)
        self.map_layer1 = Linear(emb, emb, **init)
        # kaiming_normal times sqrt(K): each class's embedding column is N(0, 1)
        self.map_label = Linear(num_classes, emb, bias=False, mode="kaiming_normal",
                                gain=math.sqrt(num_classes)) if num_classes else None

        self.enc = nn.ModuleDict()
        cout = in_channels
        for level, mult in enumerate(channel_mult):
            res = resolution >> level
            if level == 0:
                self.enc[f"{res}x{res}_conv"] = Conv(cout, model_channels * mult, 3, **init)
                cout = model_channels * mult
            else:
                self.enc[f"{res}x{res}_down"] = Block(cout, cout, down=True, **blk)
            for i in range(num_blocks):
                self.enc[f"{res}x{res}_block{i}"] = Block(cout, model_channels * mult,
                                                          attention=res in attn_resolutions, **blk)
                cout = model_channels * mult
        skips = [m.out_channels for m in self.enc.values()]

        self.dec = nn.ModuleDict()
        for level, mult in reversed(list(enumerate(channel_mult))):
            res = resolution >> level
            if level == len(channel_mult) - 1:
                self.dec[f"{res}x{res}_in0"] = Block(cout, cout, attention=True, **blk)
                self.dec[f"{res}x{res}_in1"] = Block(cout, cout, **blk)
            else:
                self.dec[f"{res}x{res}_up"] = Block(cout, cout, up=True, **blk)
            for i in range(num_blocks + 1):
                self.dec[f"{res}x{res}_block{i}"] = Block(cout + skips.pop(), model_channels * mult,
                                                          attention=res in attn_resolutions, **blk)
                cout = model_channels * mult
        self.out_norm = group_norm(cout)
        self.out_conv = Conv(cout, in_channels, 3, **init_zero)

    def forward(self, x, c_noise, labels=None, augment_labels=None):
        emb = self.map_noise(c_noise)
        if self.map_augment is not None and (augment_labels is not None or self.training):
            emb = emb + self.map_augment(_augment(augment_labels, emb, self.map_augment.weight.shape[1]))
        emb = self.map_layer1(F.silu(self.map_layer0(emb)))
        if self.map_label is not None:
            emb = emb + self.map_label(self.one_hot(labels, emb))
        emb = F.silu(emb)

        skips = []
        for name, m in self.enc.items():
            x = m(x) if name.endswith("_conv") else self.run(m, x, emb)
            skips.append(x)
        for name, m in self.dec.items():
            if "_block" in name:
                x = torch.cat([x, skips.pop()], dim=1)
            x = self.run(m, x, emb)
        return self.out_conv(F.silu(self.out_norm(x)))


def _build(arch: str, cls, resolution: int, in_channels: int, num_classes: int, kwargs: dict):
    return cls(resolution, in_channels, num_classes, **(PRESETS[arch] | kwargs))


def build_ddpmpp(resolution: int, in_channels: int, num_classes: int, **kwargs) -> SongUNet:
    """EDM's --arch=ddpmpp at its CIFAR-10 settings (PRESETS["ddpmpp"]); kwargs override any of them."""
    return _build("ddpmpp", SongUNet, resolution, in_channels, num_classes, kwargs)


def build_ncsnpp(resolution: int, in_channels: int, num_classes: int, **kwargs) -> SongUNet:
    """EDM's --arch=ncsnpp at its CIFAR-10 settings (PRESETS["ncsnpp"]); kwargs override any of them."""
    return _build("ncsnpp", SongUNet, resolution, in_channels, num_classes, kwargs)


def build_adm(resolution: int, in_channels: int, num_classes: int, **kwargs) -> DhariwalUNet:
    """EDM's --arch=adm at its ImageNet-64 settings (PRESETS["adm"]); kwargs override any of them."""
    return _build("adm", DhariwalUNet, resolution, in_channels, num_classes, kwargs)


def official_keys(state: dict) -> dict:
    """A state dict of EDM's SongUNet / DhariwalUNet, or of the EDMPrecond around one (`model.` prefix), in this
    module's names, which are EDM's own: the prefix is the only change."""
    return {k.removeprefix("model."): v for k, v in state.items()}
