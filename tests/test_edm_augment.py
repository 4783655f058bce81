"""EDM's augmentation pipe with draws keyed by global-batch position (diffrelay.data.edm_augment).

The official pipe itself is compared in benchmarks/checks/check_augment_equivalence.py (it needs an EDM checkout); here
the formulas are restated independently where that is practical, and the split/resume contract is pinned.
"""

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from diffrelay.data import augment, edm_augment as ea

RECIPE_P1 = replace(ea.EDM_CIFAR10, p=1.0)
ROOT = Path(__file__).resolve().parents[1]


def images(n=16, h=32, w=32, seed=0):
    return torch.rand(n, 3, h, w, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def row(**columns) -> np.ndarray:
    """One row of draws: uniforms 0.999 (every gate closed unless multiplier * p >= 0.999), normals 0, but for
    the columns given."""
    r = np.full((1, ea.NDRAWS), 0.999, np.float32)
    r[0, ea.UNIFORMS:] = 0
    for name, value in columns.items():
        r[0, getattr(ea, name)] = value
    return r


def ramp(h=32, w=32):
    """f(x, y) = x + 2y in centred pixel coordinates, and the coordinates (float64)."""
    y, x = torch.meshgrid(torch.arange(h) - (h - 1) / 2, torch.arange(w) - (w - 1) / 2, indexing="ij")
    x, y = x.double(), y.double()
    return (x + 2 * y).float().expand(1, 3, h, w).contiguous(), x, y


def test_recipe_matches_edm_train_py():
    # train.py:144-146: p=--augment (0.12), xflip=1e8, yflip=1, scale=1, rotate_frac=1, aniso=1, translate_frac=1
    r = ea.EDM_CIFAR10
    assert (r.p, r.xflip, r.yflip, r.scale, r.rotate_frac, r.aniso, r.translate_frac) == (0.12, 1e8, 1, 1, 1, 1, 1)
    assert (r.rotate_int, r.translate_int) == (0, 0)
    assert (r.scale_std, r.rotate_frac_max, r.aniso_std, r.aniso_rotate_prob, r.translate_frac_std) == (
        0.2, 1, 0.2, 0.5, 0.125)
    assert r.label_dim == 9  # network_kwargs.augment_dim
    assert ea.Pipe().label_dim == 0 and ea.Pipe(rotate_int=1, translate_int=1).label_dim == 4


def test_sym6_taps_are_an_orthonormal_low_pass():
    h = np.array(ea.SYM6)
    assert len(h) == 12 and ea.SYM6_PAD == 3
    assert h.sum() == pytest.approx(math.sqrt(2), abs=1e-12)
    assert (h ** 2).sum() == pytest.approx(1, abs=1e-11)
    for m in range(1, 6):  # orthogonal to its own even shifts
        assert abs(np.dot(h[:-2 * m], h[2 * m:])) < 1e-11
    assert abs(np.dot(h, (-1.0) ** np.arange(12))) < 1e-10  # a zero at the Nyquist frequency


def test_draw_layout_and_distribution():
    d = ea.global_draws(3, 5, 20000)
    assert d.shape == (20000, ea.NDRAWS) and d.dtype == np.float32
    u, z = d[:, :ea.UNIFORMS], d[:, ea.UNIFORMS:]
    assert u.min() >= 0 and u.max() < 1 and np.allclose(u.mean(0), 0.5, atol=0.01)
    assert np.allclose(z.mean(0), 0, atol=0.03) and np.allclose(z.std(0), 1, atol=0.03)
    assert len({ea.EDM_AUGMENT, augment.LABEL_DROPOUT, augment.XFLIP}) == 3
    labels = ea.apply(torch.zeros(20000, 1, 1, 1), d, ea.Pipe(p=0.12, xflip=1e8, yflip=1))[1]
    assert labels[:, 0].mean() == pytest.approx(0.5, abs=0.02)  # xflip=1e8: every row draws a fair flip
    assert labels[:, 1].mean() == pytest.approx(0.12 * 0.5, abs=0.01)


def test_same_seed_and_step_give_the_same_draws_and_images():
    x = images()
    a = ea.draw(1, 7, 16, 0, 1, RECIPE_P1, 32, 32)
    b = ea.draw(1, 7, 16, 0, 1, RECIPE_P1, 32, 32)
    assert np.array_equal(a.rows, b.rows) and a.pad == b.pad
    ya, la = ea.apply(x, a, RECIPE_P1)
    yb, lb = ea.apply(x, b, RECIPE_P1)
    assert torch.equal(ya, yb) and torch.equal(la, lb)
    assert not np.array_equal(a.rows, ea.draw(1, 8, 16, 0, 1, RECIPE_P1, 32, 32).rows)  # a new draw each step
    assert not np.array_equal(a.rows, ea.draw(2, 7, 16, 0, 1, RECIPE_P1, 32, 32).rows)  # and each seed


def test_rows_and_padding_do_not_depend_on_the_process_count():
    for step in range(4):
        whole = ea.draw(0, step, 16, 0, 1, RECIPE_P1, 32, 32)
        for world in (2, 4):
            parts = [ea.draw(0, step, 16, r, world, RECIPE_P1, 32, 32) for r in range(world)]
            for r, part in enumerate(parts):
                assert np.array_equal(part.rows, whole.rows[r::world])
                assert part.pad == whole.pad


@pytest.mark.parametrize("pipe", [ea.EDM_CIFAR10, RECIPE_P1], ids=["recipe", "recipe_p1"])
def test_split_batches_give_the_same_images_bit_for_bit(pipe):
    x = images()
    pads_differ = False
    for step in range(4):
        ys, ls = ea.apply(x, ea.draw(0, step, 16, 0, 1, pipe, 32, 32), pipe)
        for r in range(2):
            part = ea.draw(0, step, 16, r, 2, pipe, 32, 32)
            y, labels = ea.apply(x[r::2], part, pipe)
            assert torch.equal(y, ys[r::2]) and torch.equal(labels, ls[r::2])
            own = ea.padding(ea.transforms(torch.from_numpy(part.rows), pipe, 32, 32).matrix, 32, 32)
            pads_differ |= own != part.pad
    if pipe is RECIPE_P1:  # EDM would pad each half for itself: the global padding is what keeps them equal
        assert pads_differ


def test_p0_leaves_images_unchanged_and_labels_zero():
    x = images()
    pipe = replace(ea.EDM_CIFAR10, p=0.0)
    d = ea.draw(0, 0, 16, 0, 1, pipe, 32, 32)
    y, labels = ea.apply(x, d, pipe)
    assert torch.equal(y, x) and labels.shape == (16, 9) and not labels.any()
    y, labels = ea.apply(x, ea.global_draws(0, 0, 16), ea.Pipe(p=0.12))  # nothing on: no labels
    assert torch.equal(y, x) and labels.shape == (16, 0)


def test_closed_gates_change_images_only_by_float_rounding():
    x = images(2)
    rows = np.concatenate([row(XFLIP=0.0), row(XFLIP=0.0)])  # gates 0.999 >= 0.12 closed; x-flip coin 0
    y, labels = ea.apply(x, rows, ea.EDM_CIFAR10)  # EDM resamples every row, untouched ones too
    assert not labels.any()
    assert (y - x).abs().max() < 1e-5


def test_a_pure_xflip_draw_flips():
    x = images(1)
    pipe = ea.Pipe(xflip=1)
    y, labels = ea.apply(x, row(XFLIP=0.75, XFLIP_ON=0.0), pipe)  # randint(2) = floor(2 * 0.75) = 1
    assert torch.equal(y, x.flip(3)) and labels.tolist() == [[1.0]]
    y, labels = ea.apply(x, row(XFLIP=0.25, XFLIP_ON=0.0), pipe)  # the coin says 0
    assert torch.equal(y, x) and labels.tolist() == [[0.0]]
    y, labels = ea.apply(x, row(XFLIP=0.75, XFLIP_ON=0.6), ea.Pipe(p=0.5, xflip=1))  # gate 0.6 >= 0.5: closed
    assert torch.equal(y, x) and labels.tolist() == [[0.0]]
    y, labels = ea.apply(x, row(YFLIP=0.75, YFLIP_ON=0.0), ea.Pipe(yflip=1))
    assert torch.equal(y, x.flip(2)) and labels.tolist() == [[1.0]]
    y = ea.apply(x, row(XFLIP=0.75, XFLIP_ON=0.9), ea.EDM_CIFAR10)[0]  # xflip=1e8: the gate never closes
    assert (y - x.flip(3)).abs().max() < 1e-5


def test_integer_rotation_and_translation():
    x = images(1)
    for u, k in ((0.3, 1), (0.6, 2), (0.9, 3)):  # floor(4u) quarter turns, as torch.rot90 counts them
        y, labels = ea.apply(x, row(ROT90=u, ROT90_ON=0.0), ea.Pipe(rotate_int=1))
        assert torch.equal(y, torch.rot90(x, k, dims=(2, 3)))
        assert labels.tolist() == [[float(k in (1, 2)), float(k in (2, 3))]]
    # w = 2u - 1 = 0.5 of translate_int_max (0.125) of 32 pixels: 2 pixels, the rest mirrored in
    y, labels = ea.apply(x, row(SHIFT_X=0.75, SHIFT_Y=0.5, SHIFT_ON=0.0), ea.Pipe(translate_int=1))
    assert torch.equal(y, F.pad(x, [2, 0, 0, 0], mode="reflect")[..., :32]) and labels.tolist() == [[0.5, 0.0]]
    y, labels = ea.apply(x, row(SHIFT_X=0.5, SHIFT_Y=0.75, SHIFT_ON=0.0), ea.Pipe(translate_int=1))
    assert torch.equal(y, F.pad(x, [0, 0, 0, 2], mode="reflect")[..., 2:, :])  # rows move up (EDM's y + ty)
    assert labels.tolist() == [[0.0, 0.5]]


def test_geometric_transforms_and_labels_restated():
    """A linear ramp goes through the recipe's four general transforms with chosen draws; away from the
    borders the output is the ramp at G_inv q, G_inv composed here in float64 from the formulas of
    aug.py:200-226, and the labels are their documented values."""
    zs, angle, za, axis, zx, zy = 0.5, 0.3, 0.8, 0.4, 0.1, -0.2
    r = row(XFLIP=0.2, XFLIP_ON=0.5, SCALE=zs, SCALE_ON=0.0, ROTATE=(angle / math.pi + 1) / 2, ROTATE_ON=0.0,
            ANISO=za, ANISO_ANGLE=(axis / math.pi + 1) / 2, ANISO_ON=0.0, ANISO_AXIS_ON=0.0, TRANSLATE_X=zx,
            TRANSLATE_Y=zy, TRANSLATE_ON=0.0)
    x, qx, qy = ramp()
    y, labels = ea.apply(x, r, ea.EDM_CIFAR10)

    def rot(a):
        return np.array([[math.cos(a), -math.sin(a), 0], [math.sin(a), math.cos(a), 0], [0, 0, 1]])

    s, sa = 2 ** (0.2 * zs), 2 ** (0.2 * za)  # scale_std = aniso_std = 0.2 (log2)
    g = (np.diag([1 / s, 1 / s, 1]) @ rot(angle) @ rot(-axis) @ np.diag([1 / sa, sa, 1]) @ rot(axis)
         @ np.array([[1, 0, -zx * 4], [0, 1, -zy * 4], [0, 0, 1]]))  # translate_frac_std 0.125 of 32 pixels
    px = g[0, 0] * qx + g[0, 1] * qy + g[0, 2]
    py = g[1, 0] * qx + g[1, 1] * qy + g[1, 2]
    inner = slice(8, 24)
    assert (y[0, :, inner, inner].double() - (px + 2 * py)[inner, inner]).abs().max() < 0.03
    # xflip (coin 0), yflip (gate closed), scale w, rotation (cos - 1, sin), aniso w (cos r, sin r), translate w
    want = [0, 0, zs, math.cos(angle) - 1, math.sin(angle), za * math.cos(axis), za * math.sin(axis), zx, zy]
    assert labels.shape == (1, 9)
    assert np.allclose(labels[0].numpy(), want, atol=1e-6)


@pytest.mark.parametrize("case", ["scale", "rotate", "aniso", "translate"])
def test_each_geometric_transform_moves_the_right_way(case):
    x, qx, qy = ramp()
    if case == "scale":  # w = 5: s = 2^(0.2 * 5) = 2, a zoom in: output(q) = input(q / 2)
        y, labels = ea.apply(x, row(SCALE=5.0, SCALE_ON=0.0), ea.Pipe(scale=1))
        px, py, want = qx / 2, qy / 2, [5.0]
    elif case == "rotate":  # u = 0.75: angle (2u - 1) pi = pi / 2; output(q) = input(R(pi / 2) q)
        y, labels = ea.apply(x, row(ROTATE=0.75, ROTATE_ON=0.0), ea.Pipe(rotate_frac=1))
        px, py, want = -qy, qx, [-1.0, 1.0]
    elif case == "aniso":  # axis gate closed (r = 0), w = 5: x stretched by 2, y squeezed by 2
        y, labels = ea.apply(x, row(ANISO=5.0, ANISO_ON=0.0), ea.Pipe(aniso=1))
        px, py, want = qx / 2, qy * 2, [5.0, 0.0]
    else:  # w = (0.5, -0.25) of 0.125 of 32 pixels: shifted by (2, -1) pixels
        r = row(TRANSLATE_X=0.5, TRANSLATE_Y=-0.25, TRANSLATE_ON=0.0)
        y, labels = ea.apply(x, r, ea.Pipe(translate_frac=1))
        px, py, want = qx - 2, qy + 1, [0.5, -0.25]
    inner = slice(12, 20)
    assert (y[0, :, inner, inner].double() - (px + 2 * py)[inner, inner]).abs().max() < 0.1
    assert np.allclose(labels[0].numpy(), want, atol=1e-6)


def test_bad_inputs():
    x = images(2)
    with pytest.raises(ValueError, match="draws"):
        ea.apply(x, ea.global_draws(0, 0, 3), RECIPE_P1)
    with pytest.raises(TypeError, match="float32"):
        ea.apply(x.double(), ea.global_draws(0, 0, 2), RECIPE_P1)
    with pytest.raises(ValueError, match="square"):
        ea.apply(images(2, 16, 24), ea.global_draws(0, 0, 2), ea.Pipe(rotate_int=1))


class ConvShapes(TorchDispatchMode):
    """The distinct (input, weight) shapes of every convolution run under it (cuDNN autotunes each new one)."""

    def __init__(self):
        super().__init__()
        self.calls, self.shapes = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.convolution, torch.ops.aten.cudnn_convolution,
                                   torch.ops.aten.mkldnn_convolution):
            self.calls += 1
            self.shapes.add((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


def test_convolution_shapes_do_not_follow_the_per_step_padding(monkeypatch):
    monkeypatch.setattr(ea, "FIXED_SHAPES", True)  # as on CUDA with cudnn.benchmark (the default there)
    # As training draws them (data/loader.py BatchMaker._augments) with the CIFAR-10 recipe's settings: each
    # step pads for the largest need of its global batch, a new size almost every step. Only the first rows
    # of rank 0's share are run: the batch size is fixed, the padding is the global batch's.
    cfg = yaml.safe_load((ROOT / "config" / "examples" / "edm-cifar10-ddpmpp-cond.yaml").read_text())
    train, res = cfg["train"], cfg["data"]["resolution"]
    pipe = replace(ea.EDM_CIFAR10, p=train["augment"])
    world = train["nproc_per_node"] * train["nnodes"]
    x = images(4, res, res)
    pads = set()
    with ConvShapes() as seen:
        for step in range(50):
            d = ea.draw(0, step, train["batch_size"], 0, world, pipe, res, res)
            pads.add(d.pad)
            ea.apply(x, ea.Draws(d.rows[:4], d.pad), pipe)
    assert len(pads) > 40  # the per-step padding the shapes must not follow
    assert seen.calls == 4 * 50
    assert len(seen.shapes) <= 4, sorted(seen.shapes)


def resample_before(images, matrix, pad):
    """resample() as it was before the zero canvas (frozen copy): the upsampling convolved the padded image
    itself, whose shape followed the padding."""
    n, c, h, w = images.shape
    left, right, top, bottom = pad
    x = F.pad(images, [left, right, top, bottom], mode="reflect")
    g = ea._fixed(1, 0, (left - right) / 2, 0, 1, (top - bottom) / 2, images.device) @ matrix
    taps = ea._constant(ea.SYM6, images.device, images.dtype)
    kernel = taps.flip(0).repeat(c, 1, 1, 1)
    across = kernel.transpose(2, 3).contiguous()
    half = (len(ea.SYM6) + 1) // 2
    x = F.conv2d(ea._spread(x, 3), kernel, groups=c, padding=[0, half])
    x = F.conv2d(ea._spread(x, 2), across, groups=c, padding=[half, 0])
    g = ea._fixed(2, 0, 0, 0, 2, 0, images.device) @ g @ ea._fixed(1 / 2, 0, 0, 0, 1 / 2, 0, images.device)
    g = ea._fixed(1, 0, -0.5, 0, 1, -0.5, images.device) @ g @ ea._fixed(1, 0, 0.5, 0, 1, 0.5, images.device)
    out_h, out_w = (h + ea.SYM6_PAD * 2) * 2, (w + ea.SYM6_PAD * 2) * 2
    sx, sy = 2 / x.shape[3], 2 / x.shape[2]
    g = (ea._fixed(sx, 0, 0, 0, sy, 0, images.device) @ g
         @ ea._fixed(1 / (2 / out_w), 0, 0, 0, 1 / (2 / out_h), 0, images.device))
    grid = F.affine_grid(g[:, :2, :], [n, c, out_h, out_w], align_corners=False)
    x = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    kernel = taps.repeat(c, 1, 1, 1)
    across = kernel.transpose(2, 3).contiguous()
    half = (len(ea.SYM6) - 1) // 2
    x = F.conv2d(x, kernel, groups=c, stride=[1, 2], padding=[0, half])[:, :, :, ea.SYM6_PAD:-ea.SYM6_PAD]
    return F.conv2d(x, across, groups=c, stride=[2, 1], padding=[half, 0])[:, :, ea.SYM6_PAD:-ea.SYM6_PAD]


@pytest.mark.parametrize("h,w", [(32, 32), (24, 40)])
def test_fixed_shapes_give_the_same_images_bit_for_bit(h, w, monkeypatch):
    monkeypatch.setattr(ea, "FIXED_SHAPES", True)
    x = images(4, h, w)
    all_p1 = ea.Pipe(scale=1, rotate_frac=1, aniso=1, translate_frac=1)
    for pipe in (ea.EDM_CIFAR10, RECIPE_P1, all_p1):
        for step in range(4):
            d = ea.draw(0, step, 16, 0, 4, pipe, h, w)
            matrix = ea.transforms(torch.from_numpy(d.rows), pipe, h, w).matrix
            pads = (d.pad, ea.padding(matrix, h, w), (0, 0, 0, 0), (w - 1, w - 1, h - 1, h - 1), (w - 1, 0, 0, h - 1))
            for pad in pads:  # the global batch's, its own, none, the cap, lopsided
                want, got = resample_before(x, matrix, pad), ea.resample(x, matrix, pad)
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (pipe, step, pad)
