"""EDM's non-leaking augmentation pipe, with its random numbers keyed by global-batch position.

The math is that of AugmentPipe in NVlabs/edm training/augment.py (cited as aug.py:LINE). EDM's CIFAR-10
recipe (train.py:143-146, --augment=0.12) turns on x-flip (xflip=1e8: the gate always passes, so every
image gets a fair flip coin), y-flip, isotropic scale, arbitrary rotation, anisotropic scale and fractional
translation, each gated with probability p=0.12, and gives the network the 9 resulting labels as
`augment_labels`. Integer rotation and integer translation (aug.py:174-191) are here too; the colour
transforms (aug.py:276-325), which no EDM recipe turns on, are not.

What differs is where the random numbers come from. EDM calls torch's global generator batch by batch,
so they depend on how the global batch is split over processes. Here a numpy PCG64 generator seeded with
(seed, EDM_AUGMENT, step) draws one fixed row of NDRAWS numbers per global-batch position (the layout is
below; a row is drawn whole whether or not its transforms are on), and a process keeps rows rank::world.
The one batch-wide quantity of EDM's pipe, the reflect padding before resampling (aug.py:232-244, the
largest need over the batch), is worked out from the whole global batch's draws, so every process pads
alike. A resumed run, or one on another process count, redraws and pads exactly as the first did.

The rest is EDM's float32 arithmetic, op for op: given the same draws, the images and labels agree with
the official pipe (benchmarks/checks/check_augment_equivalence.py). One deliberate exception: p=0 returns the
images untouched. EDM builds no pipe at --augment=0; its pipe run at p=0 would still pass the images
through the resampling filters and change them by float rounding.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from diffrelay.data.order import derive_seed, rank_slice

EDM_AUGMENT = 0xA6ED  # seed tag, apart from augment.LABEL_DROPOUT and augment.XFLIP

# One row of draws: 16 uniforms in [0, 1) (float32 with 24 random bits, like torch.rand), then 4 standard
# normals (float32). Which of EDM's random calls each one stands for:
#   XFLIP, YFLIP   randint(2) = floor(2u)      aug.py:163,169
#   ROT90          randint(4) = floor(4u)      aug.py:175
#   SHIFT_X/Y      rand, integer translation   aug.py:183
#   ROTATE         rand, rotation angle        aug.py:208
#   ANISO_ANGLE    rand, anisotropy axis       aug.py:215
#   *_ON           rand, the gate "u < multiplier * p" (ANISO_AXIS_ON: "u < aniso_rotate_prob")
#   SCALE, ANISO, TRANSLATE_X/Y   randn        aug.py:201,214,223
(XFLIP, XFLIP_ON, YFLIP, YFLIP_ON, ROT90, ROT90_ON, SHIFT_X, SHIFT_Y, SHIFT_ON, SCALE_ON, ROTATE, ROTATE_ON,
 ANISO_ANGLE, ANISO_ON, ANISO_AXIS_ON, TRANSLATE_ON) = range(16)
SCALE, ANISO, TRANSLATE_X, TRANSLATE_Y = range(16, 20)
UNIFORMS, NDRAWS = 16, 20

# Low-pass filter of the Symlet-6 wavelet (aug.py:35), for the 2x up- and downsampling around the resampling.
SYM6 = (0.015404109327027373, 0.0034907120842174702, -0.11799011114819057, -0.048311742585633,
        0.4910559419267466, 0.787641141030194, 0.3379294217276218, -0.07263752278646252,
        -0.021060292512300564, 0.04472490177066578, 0.0017677118642428036, -0.007800708325034148)
SYM6_PAD = len(SYM6) // 4  # aug.py:238


@dataclass(frozen=True)
class Pipe:
    """AugmentPipe's geometric settings and their defaults (aug.py:116-140): every transform off."""

    p: float = 1.0  # overall probability multiplier
    xflip: float = 0.0  # probability multipliers, one per transform
    yflip: float = 0.0
    rotate_int: float = 0.0
    translate_int: float = 0.0
    translate_int_max: float = 0.125  # of the image size
    scale: float = 0.0
    rotate_frac: float = 0.0
    aniso: float = 0.0
    translate_frac: float = 0.0
    scale_std: float = 0.2  # log2
    rotate_frac_max: float = 1.0  # 1 = a full turn either way
    aniso_std: float = 0.2  # log2
    aniso_rotate_prob: float = 0.5
    translate_frac_std: float = 0.125  # of the image size

    @property
    def label_dim(self) -> int:
        """Length of the label vector: 1 per flip, 2 for each of the other transforms that is on."""
        counts = ((self.xflip, 1), (self.yflip, 1), (self.rotate_int, 2), (self.translate_int, 2),
                  (self.scale, 1), (self.rotate_frac, 2), (self.aniso, 2), (self.translate_frac, 2))
        return sum(n for multiplier, n in counts if multiplier > 0)

    @property
    def geometric(self) -> bool:
        """Whether the resampling step runs (aug.py:232: any of the four general transforms is on)."""
        return max(self.scale, self.rotate_frac, self.aniso, self.translate_frac) > 0


# EDM's CIFAR-10 recipe: train.py:59 (--augment default 0.12) and train.py:144-145; augment_dim 9 (train.py:146).
EDM_CIFAR10 = Pipe(p=0.12, xflip=1e8, yflip=1, scale=1, rotate_frac=1, aniso=1, translate_frac=1)


@dataclass
class Draws:
    """One process's draws: `rows` (its rows of the global batch, (B, NDRAWS) float32) and `pad`, the
    reflect padding (left, right, top, bottom) worked out over the global batch, or None to work it out
    from `rows` alone (what EDM does with whatever batch it is given)."""

    rows: np.ndarray
    pad: tuple[int, int, int, int] | None = None


def global_draws(seed: int, step: int, global_batch: int) -> np.ndarray:
    """(global_batch, NDRAWS) float32; row i belongs to position i of step `step`'s global batch."""
    rng = np.random.Generator(np.random.PCG64(derive_seed(seed, EDM_AUGMENT, step)))
    uniform = rng.random((global_batch, UNIFORMS), dtype=np.float32)
    normal = rng.standard_normal((global_batch, NDRAWS - UNIFORMS), dtype=np.float32)
    return np.concatenate([uniform, normal], axis=1)


def draw(seed: int, step: int, global_batch: int, rank: int, world: int, pipe: Pipe, height: int,
         width: int) -> Draws:
    """This process's rows of step `step`'s draws, and the padding of the whole global batch (on the CPU)."""
    rows = global_draws(seed, step, global_batch)
    pad = None
    if pipe.p != 0 and pipe.geometric:
        pad = padding(transforms(torch.from_numpy(rows), pipe, height, width).matrix, height, width)
    return Draws(rank_slice(rows, rank, world), pad)


@dataclass
class Transforms:
    """What a batch of draws means: flips and rotations as ints (B,), the integer shift (B,) x and y, the
    inverse geometric matrix G_inv (B, 3, 3) (output pixel -> input pixel, centred), and the labels."""

    xflip: torch.Tensor | None
    yflip: torch.Tensor | None
    rot90: torch.Tensor | None
    shift: tuple[torch.Tensor, torch.Tensor] | None
    matrix: torch.Tensor | None
    labels: torch.Tensor


def _affine(a, b, c, d, e, f) -> torch.Tensor:
    """[[a, b, c], [d, e, f], [0, 0, 1]] per row; plain numbers are broadcast to the tensors (aug.py:43-51)."""
    ref = next(x for x in (a, b, c, d, e, f) if isinstance(x, torch.Tensor))
    items = [x if isinstance(x, torch.Tensor) else torch.full_like(ref, x) for x in (a, b, c, d, e, f, 0, 0, 1)]
    return torch.stack(items, dim=-1).reshape(*ref.shape, 3, 3)


def _constant(values, device, dtype=torch.float32) -> torch.Tensor:
    """A small tensor of plain numbers on `device`. On a GPU it goes through pinned memory: a copy from pageable
    memory would wait for the device, eight times an accumulation round of the training loop (train.augment)."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t.to(device)


def _fixed(a, b, c, d, e, f, device) -> torch.Tensor:
    """The same for plain numbers: one float32 (3, 3) matrix."""
    return _constant([[a, b, c], [d, e, f], [0, 0, 1]], device)


def _rotation(phi: torch.Tensor) -> torch.Tensor:
    """rotate2d(phi) of aug.py:83-88; EDM's rotate2d_inv(t) is rotate2d(-t) (aug.py:106)."""
    return _affine(phi.cos(), (-phi).sin(), 0, phi.sin(), phi.cos(), 0)


def transforms(rows: torch.Tensor, pipe: Pipe, height: int, width: int) -> Transforms:
    """The draw -> transform map of aug.py:162-226, in EDM's order and float32 arithmetic."""
    rows = rows.to(torch.float32)

    def u(k):
        return rows[:, k]

    zero = torch.zeros_like(u(0))
    out = Transforms(None, None, None, None, None, None)
    labels = []
    if pipe.xflip > 0:  # aug.py:162-166
        out.xflip = torch.where(u(XFLIP_ON) < pipe.xflip * pipe.p, (u(XFLIP) * 2).floor(), zero).long()
        labels.append(out.xflip)
    if pipe.yflip > 0:  # aug.py:168-172
        out.yflip = torch.where(u(YFLIP_ON) < pipe.yflip * pipe.p, (u(YFLIP) * 2).floor(), zero).long()
        labels.append(out.yflip)
    if pipe.rotate_int > 0:  # aug.py:174-180: quarter turns 0-3
        out.rot90 = torch.where(u(ROT90_ON) < pipe.rotate_int * pipe.p, (u(ROT90) * 4).floor(), zero).long()
        labels += [(out.rot90 == 1) | (out.rot90 == 2), (out.rot90 == 2) | (out.rot90 == 3)]
    if pipe.translate_int > 0:  # aug.py:182-191
        on = u(SHIFT_ON) < pipe.translate_int * pipe.p
        wx = torch.where(on, u(SHIFT_X) * 2 - 1, zero)
        wy = torch.where(on, u(SHIFT_Y) * 2 - 1, zero)
        tx = wx.mul(width * pipe.translate_int_max).round().to(torch.int64)
        ty = wy.mul(height * pipe.translate_int_max).round().to(torch.int64)
        out.shift = tx, ty
        labels += [tx.div(width * pipe.translate_int_max), ty.div(height * pipe.translate_int_max)]

    g = eye = torch.eye(3, device=rows.device)  # G_inv, built up by right-multiplication (aug.py:197-226)
    if pipe.scale > 0:  # aug.py:200-205: s = 2^(scale_std w), G_inv @= scale(1/s)
        w = torch.where(u(SCALE_ON) < pipe.scale * pipe.p, u(SCALE), zero)
        s = w.mul(pipe.scale_std).exp2()
        g = g @ _affine(1 / s, 0, 0, 0, 1 / s, 0)
        labels.append(w)
    if pipe.rotate_frac > 0:  # aug.py:207-211: angle w uniform in +-pi*max, G_inv @= rotate2d_inv(-w)
        w = (u(ROTATE) * 2 - 1) * (np.pi * pipe.rotate_frac_max)
        w = torch.where(u(ROTATE_ON) < pipe.rotate_frac * pipe.p, w, zero)
        g = g @ _rotation(w)  # rotate2d_inv(-w) = rotate2d(w)
        labels += [w.cos() - 1, w.sin()]
    if pipe.aniso > 0:  # aug.py:213-220: scale s along axis r and 1/s across it
        w = torch.where(u(ANISO_ON) < pipe.aniso * pipe.p, u(ANISO), zero)
        r = torch.where(u(ANISO_AXIS_ON) < pipe.aniso_rotate_prob, (u(ANISO_ANGLE) * 2 - 1) * np.pi, zero)
        s = w.mul(pipe.aniso_std).exp2()
        t = 1 / s
        g = g @ _rotation(-r) @ _affine(1 / s, 0, 0, 0, 1 / t, 0) @ _rotation(r)  # scale2d_inv(s, 1 / s)
        labels += [w * r.cos(), w * r.sin()]
    if pipe.translate_frac > 0:  # aug.py:222-226: shift by (w_x W, w_y H) * std, G_inv @= translate(-shift)
        on = u(TRANSLATE_ON) < pipe.translate_frac * pipe.p
        wx, wy = torch.where(on, u(TRANSLATE_X), zero), torch.where(on, u(TRANSLATE_Y), zero)
        g = g @ _affine(1, 0, -wx.mul(width * pipe.translate_frac_std), 0, 1,
                        -wy.mul(height * pipe.translate_frac_std))
        labels += [wx, wy]
    out.matrix = None if g is eye else g
    out.labels = torch.stack([x.to(torch.float32) for x in labels], 1) if labels else rows.new_zeros(len(rows), 0)
    return out


def padding(matrix: torch.Tensor, height: int, width: int) -> tuple[int, int, int, int]:
    """Reflect padding (left, right, top, bottom) that holds every row's transformed image corners plus
    twice the filter's reach, at most one image size less a pixel (aug.py:233-244)."""
    cx, cy = (width - 1) / 2, (height - 1) / 2
    corners = torch.tensor([[-cx, -cy, 1], [cx, -cy, 1], [cx, cy, 1], [-cx, cy, 1]], dtype=torch.float32,
                           device=matrix.device)
    xy = (matrix @ corners.t())[:, :2, :].permute(1, 0, 2).flatten(1)  # (x or y, row and corner)
    need = torch.cat([-xy, xy]).max(dim=1).values  # furthest left, up, right, down from the centre
    const = lambda v: torch.tensor(v, dtype=torch.float32, device=matrix.device)  # noqa: E731
    need = need + const([SYM6_PAD * 2 - cx, SYM6_PAD * 2 - cy] * 2)
    need = need.max(const([0, 0] * 2)).min(const([width - 1, height - 1] * 2))
    left, top, right, bottom = need.ceil().to(torch.int32).tolist()
    return left, right, top, bottom


def _spread(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x with a zero between neighbours along dim (n -> 2n - 1 samples), aug.py:253,255."""
    shape = list(x.shape)
    shape[dim] = 2 * shape[dim] - 1
    out = x.new_zeros(shape)
    index = [slice(None)] * x.dim()
    index[dim] = slice(None, None, 2)
    out[tuple(index)] = x
    return out


# Whether resample() convolves on a fixed-size canvas (below). None: on CUDA with cuDNN's benchmark mode only; the CPU
# autotunes nothing and would pay for the larger convolutions (about 2x a pipe call). The bits are the same either way.
FIXED_SHAPES: bool | None = None


def _canvas(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """x in the top-left corner of a zero (B, C, height, width) tensor."""
    out = x.new_zeros(*x.shape[:2], height, width)
    out[:, :, :x.shape[2], :x.shape[3]] = x
    return out


def resample(images: torch.Tensor, matrix: torch.Tensor, pad: tuple[int, int, int, int]) -> torch.Tensor:
    """Apply the inverse matrices (B, 3, 3) to (B, C, H, W) images: reflect-pad, upsample 2x with the
    sym6 filter, bilinear resampling, filter and downsample 2x, crop (aug.py:246-270)."""
    n, c, h, w = images.shape
    left, right, top, bottom = pad
    x = F.pad(images, [left, right, top, bottom], mode="reflect")
    g = _fixed(1, 0, (left - right) / 2, 0, 1, (top - bottom) / 2, images.device) @ matrix  # aug.py:248
    taps = _constant(SYM6, images.device, images.dtype)
    kernel = taps.flip(0).repeat(c, 1, 1, 1)  # (C, 1, 1, 12): the filter reversed, a true convolution
    across = kernel.transpose(2, 3).contiguous()  # (C, 1, 12, 1)
    half = (len(SYM6) + 1) // 2
    # The pad changes every step (aug.py:233-244 takes the batch's largest need), so convolving the padded
    # image itself would give cuDNN's benchmark mode a new shape to autotune almost every step. The upsampling
    # runs instead on the padded image in the corner of a zero canvas of the largest padded size (padding()
    # caps each side at a size less a pixel): the zeros past its edges are the zeros that conv2d's own
    # padding would read, so the part kept holds the same sums. The convolutions after grid_sample (not a cuDNN
    # op with align_corners=False) work on the fixed output size already.
    ph, pw = x.shape[2:]
    if FIXED_SHAPES if FIXED_SHAPES is not None else x.is_cuda and torch.backends.cudnn.benchmark:
        x = _canvas(x, h + 2 * (h - 1), w + 2 * (w - 1))
    x = F.conv2d(_spread(x, 3), kernel, groups=c, padding=[0, half])  # aug.py:251-256
    x = F.conv2d(_spread(x, 2), across, groups=c, padding=[half, 0])[:, :, :ph * 2, :pw * 2]
    g = _fixed(2, 0, 0, 0, 2, 0, images.device) @ g @ _fixed(1 / 2, 0, 0, 0, 1 / 2, 0, images.device)  # :257-258
    g = _fixed(1, 0, -0.5, 0, 1, -0.5, images.device) @ g @ _fixed(1, 0, 0.5, 0, 1, 0.5, images.device)
    out_h, out_w = (h + SYM6_PAD * 2) * 2, (w + SYM6_PAD * 2) * 2  # aug.py:261-264, in [-1, 1] coordinates
    sx, sy = 2 / x.shape[3], 2 / x.shape[2]
    g = (_fixed(sx, 0, 0, 0, sy, 0, images.device) @ g
         @ _fixed(1 / (2 / out_w), 0, 0, 0, 1 / (2 / out_h), 0, images.device))
    grid = F.affine_grid(g[:, :2, :], [n, c, out_h, out_w], align_corners=False)
    x = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    kernel = taps.repeat(c, 1, 1, 1)  # aug.py:267-270: filter, keep every other sample, crop the margin
    across = kernel.transpose(2, 3).contiguous()
    half = (len(SYM6) - 1) // 2
    x = F.conv2d(x, kernel, groups=c, stride=[1, 2], padding=[0, half])[:, :, :, SYM6_PAD:-SYM6_PAD]
    return F.conv2d(x, across, groups=c, stride=[2, 1], padding=[half, 0])[:, :, SYM6_PAD:-SYM6_PAD]


def _shift(images: torch.Tensor, tx: torch.Tensor, ty: torch.Tensor) -> torch.Tensor:
    """Move each image by (tx, ty) whole pixels, filling with its mirror image (aug.py:187-190)."""
    n, c, h, w = images.shape
    x = torch.arange(w, device=images.device) - tx[:, None]  # the source column of each output column
    y = torch.arange(h, device=images.device) + ty[:, None]  # EDM's sign: row y reads row y + ty
    x = w - 1 - (w - 1 - x % (w * 2 - 2)).abs()
    y = h - 1 - (h - 1 - y % (h * 2 - 2)).abs()
    images = images.gather(3, x[:, None, None, :].expand(n, c, h, w))
    return images.gather(2, y[:, None, :, None].expand(n, c, h, w))


def apply(images: torch.Tensor, draws: Draws | np.ndarray | torch.Tensor,
          pipe: Pipe = EDM_CIFAR10) -> tuple[torch.Tensor, torch.Tensor]:
    """(augmented images, labels (B, pipe.label_dim) float32) for float32 images (B, C, H, W) and B rows of
    draws. A bare array of rows is padded for itself, as EDM pads whatever batch it gets."""
    if not isinstance(draws, Draws):
        draws = Draws(draws)
    rows = torch.as_tensor(draws.rows).to(images.device)
    n, c, h, w = images.shape
    if images.dtype != torch.float32:
        raise TypeError(f"edm_augment works on float32 images, not {images.dtype}")
    if rows.shape != (n, NDRAWS):
        raise ValueError(f"{n} images need ({n}, {NDRAWS}) draws, not {tuple(rows.shape)}")
    if pipe.p == 0 or n == 0:
        return images, images.new_zeros(n, pipe.label_dim)
    if pipe.rotate_int > 0 and h != w:
        raise ValueError("integer rotation needs square images, as in EDM")
    t = transforms(rows, pipe, h, w)
    if t.xflip is not None:  # aug.py:165
        images = torch.where(t.xflip.view(n, 1, 1, 1) == 1, images.flip(3), images)
    if t.yflip is not None:  # aug.py:171
        images = torch.where(t.yflip.view(n, 1, 1, 1) == 1, images.flip(2), images)
    if t.rot90 is not None:  # aug.py:177-179: k quarter turns as flips and a transpose
        k = t.rot90.view(n, 1, 1, 1)
        images = torch.where((k == 1) | (k == 2), images.flip(3), images)
        images = torch.where((k == 2) | (k == 3), images.flip(2), images)
        images = torch.where((k == 1) | (k == 3), images.transpose(2, 3), images)
    if t.shift is not None:
        images = _shift(images, *t.shift)
    if t.matrix is not None:
        pad = draws.pad if draws.pad is not None else padding(t.matrix, h, w)
        images = resample(images, t.matrix, pad)
    return images, t.labels
