"""edm2's magnitude-preserving UNet (nets/edm2.py), its formulas restated here independently of NVlabs/edm2's code
(benchmarks/checks/check_edm2_equivalence.py compares with that code itself, which CI cannot fetch)."""

import inspect
import math

import pytest
import torch

from diffrelay.nets import edm2, memory

TINY = dict(model_channels=16, channel_mult=[1, 2], num_blocks=1, attn_resolutions=[8], channels_per_head=8)
# Measured with edm2's own Precond (UNet + the 128 weights of its logvar head) at 64x64x4, 1000 classes, and
# matching its paper's table (125M, 280M, 498M, 777M, 1119M, 1523M).
COUNTS = {"xs": 124_713_253, "s": 280_212_837, "m": 497_807_781, "l": 777_498_085, "xl": 1_119_283_749,
          "xxl": 1_523_164_773}


def tiny(resolution=16, channels=4, classes=10, **kw):
    torch.manual_seed(0)
    net = edm2.build(resolution, channels, classes, **(TINY | kw))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in net.parameters():  # the gains start at zero, which would zero the output and most gradients
            p.add_(torch.randn(p.shape, generator=g))
    return net


def batch(net_resolution=16, channels=4, n=4, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, channels, net_resolution, net_resolution, generator=g), torch.randn(n, generator=g)


def test_preset_parameter_counts_are_edm2s():
    for preset, count in COUNTS.items():
        with torch.device("meta"):
            net = edm2.build(64, 4, 1000, preset=preset)
        assert sum(p.numel() for p in net.parameters()) == count, preset
    assert [edm2.PRESETS[p]["model_channels"] for p in COUNTS] == [128, 192, 256, 320, 384, 448]


def test_magnitude_preserving_operations():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 500_000, generator=g), torch.randn(2, 300_000, generator=g)
    rms = lambda x: x.square().mean().sqrt().item()  # noqa: E731
    assert rms(edm2.mp_silu(a)) == pytest.approx(1, abs=0.01)
    for t in (0.3, 0.5):
        s = edm2.mp_sum(a, a.flip(1), t)
        assert torch.allclose(s, ((1 - t) * a + t * a.flip(1)) / math.sqrt((1 - t) ** 2 + t ** 2), atol=1e-6)
        assert rms(s) == pytest.approx(1, abs=0.01)
        c = edm2.mp_cat(a[:, :, None], b[:, :, None], dim=1, t=t)  # 500k and 300k channels
        assert c.shape == (2, 800_000, 1) and rms(c) == pytest.approx(1, abs=0.01)
        # each input's share of the energy is (1-t)^2 : t^2, whatever its channel count
        ea, eb = c[:, :500_000].square().sum().item(), c[:, 500_000:].square().sum().item()
        assert ea / eb == pytest.approx((1 - t) ** 2 / t**2, rel=0.01)


def test_normalize_gives_each_output_channel_norm_sqrt_fan_in():
    w = torch.randn(8, 5, 3, 3) * torch.tensor([0.01, 0.1, 1, 3, 10, 30, 100, 1000])[:, None, None, None]
    n = edm2.normalize(w)
    fan_in = 5 * 9
    rms = w.flatten(1).square().mean(1).sqrt()
    # x / (eps + rms(x)): norm sqrt(fan_in) up to the eps of 1e-4
    want = math.sqrt(fan_in) * rms / (1e-4 + rms)
    assert torch.allclose(n.flatten(1).norm(dim=1), want, rtol=1e-5)
    assert torch.allclose(n.flatten(1).norm(dim=1), torch.full((8,), math.sqrt(fan_in)), rtol=2e-2)


def test_forced_weight_normalisation_in_train_mode_only():
    conv = edm2.MPConv(6, 4, (3, 3))
    with torch.no_grad():
        conv.weight.mul_(7)
    before = conv.weight.detach().clone()
    x = torch.randn(2, 6, 5, 5)
    conv.eval()
    out = conv(x)
    assert torch.equal(conv.weight, before)  # eval never writes the weight
    # w / |w| per output channel, times 1/sqrt(fan_in): unit-magnitude in, unit-magnitude out
    w = before / (1e-4 + before.flatten(1).square().mean(1).sqrt())[:, None, None, None] / math.sqrt(54)
    assert torch.allclose(out, torch.nn.functional.conv2d(x, w, padding=1), atol=1e-5)
    conv.train()
    conv(x)
    assert torch.allclose(conv.weight.flatten(1).norm(dim=1), torch.full((4,), math.sqrt(54)), rtol=1e-3)
    assert torch.allclose(conv.weight, w * math.sqrt(54), atol=1e-6)


def test_logvar_is_fourier_features_then_a_normalised_linear():
    net = tiny().train()  # the stored weight is normalised first, then normalised again to compute with
    c = torch.linspace(-2, 2, 5)
    lv = net.logvar(c)
    assert lv.shape == (5, 1, 1, 1)
    f = math.sqrt(2) * torch.cos(c[:, None] * net.logvar_fourier.freqs + net.logvar_fourier.phases)
    w = net.logvar_linear.weight
    w = w / (1e-4 + w.square().mean().sqrt()) / math.sqrt(128)
    assert torch.allclose(lv.flatten(), (f @ w.t()).flatten(), atol=1e-5)
    assert {"logvar_fourier.freqs", "logvar_fourier.phases", "logvar_linear.weight"} <= set(net.state_dict())


def test_null_label_is_the_zero_one_hot():
    net = tiny().eval()
    x, c = batch()
    with torch.no_grad():
        null, none, zero = net(x, c, torch.full((4,), 10)), net(x, c, None), net(x, c, torch.zeros(4, dtype=int))
        net.emb_label.weight.normal_()  # the class embedding cannot reach a zero one-hot vector
        assert torch.equal(net(x, c, torch.full((4,), 10)), null)
        assert not torch.allclose(net(x, c, torch.zeros(4, dtype=int)), zero)
    assert torch.equal(null, none)


@pytest.mark.parametrize("resolution,channels,mult", [(8, 4, [1, 2]), (16, 3, [1, 2, 2]), (32, 1, [1, 1, 2, 2])])
def test_output_is_shaped_like_the_input(resolution, channels, mult):
    net = tiny(resolution, channels, 0, channel_mult=mult).eval()
    x, c = batch(resolution, channels, n=2)
    with torch.no_grad():
        assert net(x, c, None).shape == x.shape


def test_layout_follows_edm2():
    net = edm2.build(16, 4, 10, **TINY)
    assert list(net.enc) == ["16x16_conv", "16x16_block0", "8x8_down", "8x8_block0"]
    assert list(net.dec) == ["8x8_in0", "8x8_in1", "8x8_block0", "8x8_block1", "16x16_up", "16x16_block0",
                             "16x16_block1"]
    heads = {name: b.num_heads for name, b in net.dec.items()} | {n: b.num_heads for n, b in net.enc.items()
                                                                  if n != "16x16_conv"}
    # attention where the resolution is listed, and always in the first bottom block; 32 channels / 8 a head
    assert heads == {"16x16_block0": 0, "8x8_down": 0, "8x8_block0": 4, "8x8_in0": 4, "8x8_in1": 0,
                     "8x8_block1": 4, "16x16_up": 0, "16x16_block1": 0}
    assert net.enc["16x16_conv"].weight.shape == (16, 5, 3, 3)  # the image and a ones channel
    assert net.dec["16x16_block0"].conv_skip.weight.shape == (16, 32 + 16, 1, 1)
    with torch.no_grad():  # the output gain starts at zero: F = 0 at initialisation
        assert torch.equal(net(*batch(), torch.arange(4)), torch.zeros(4, 4, 16, 16))


def test_builder_refuses_unknown_presets_and_keywords():
    with pytest.raises(ValueError, match="preset"):
        edm2.build(16, 4, 0, preset="xxxl")
    with pytest.raises(TypeError):
        edm2.build(16, 4, 0, channels=32)
    with pytest.raises(ValueError, match="resolution"):
        edm2.build(10, 4, 0, channel_mult=[1, 2, 2])  # 10 -> 5 -> 2.5
    net = edm2.build(16, 4, 0, preset="m", model_channels=8, channel_mult=[1])
    assert net.enc["16x16_block0"].dropout == 0.1 and net.enc["16x16_block0"].conv_res0.weight.shape[0] == 8
    own = [p for p in inspect.signature(edm2.EDM2UNet).parameters if p not in ("resolution", "in_channels",
                                                                                "num_classes")]
    assert sorted(edm2.KWARGS) == sorted(["preset", *own])


def test_official_keys_strip_the_unet_prefix():
    net = edm2.build(8, 4, 3, **TINY)
    theirs = {("" if k.startswith("logvar_") else "unet.") + k: v for k, v in net.state_dict().items()}
    assert "unet.emb_fourier.freqs" in theirs and "unet.enc.8x8_conv.weight" in theirs
    net.load_state_dict(edm2.official_keys(theirs), strict=True)


def run(net, x, c, labels, seed=3):
    torch.manual_seed(seed)  # the dropout masks
    out = net(x, c, labels)
    (out.square().sum() + net.logvar(c).square().sum()).backward()
    return out.detach()


def test_training_step_changes_weights_in_forward_and_backpropagates():
    net = tiny(dropout=0.2).train()
    x, c = batch()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    out = run(net, x, c, torch.tensor([0, 1, 10, 9]))
    assert out.shape == x.shape and torch.isfinite(out).all()
    for name, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
        if p.ndim >= 2:  # every MPConv weight was normalised by the forward pass
            assert not torch.equal(p, before[name]), name
            assert torch.allclose(p, edm2.normalize(before[name]), atol=1e-6), name
        else:
            assert torch.equal(p, before[name]), name
    torch.manual_seed(3)
    with torch.no_grad():
        assert not torch.equal(net(x, c, torch.tensor([0, 1, 10, 9])), out)  # other dropout, other weights


def test_checkpointing_recomputes_the_same_bits():
    """Normalising twice is not bitwise idempotent, so the recomputation must not normalise again."""
    x, c = batch()
    labels = torch.tensor([0, 1, 10, 9])
    plain, ckpt = tiny(dropout=0.2).train(), tiny(dropout=0.2).train()
    assert memory.enable(ckpt) > 0
    for _ in range(2):  # the second step starts from normalised weights
        assert torch.equal(run(plain, x, c, labels), run(ckpt, x, c, labels))
        for (name, a), b in zip(plain.named_parameters(), ckpt.parameters()):
            assert torch.equal(a, b) and torch.equal(a.grad, b.grad), name
            a.grad = b.grad = None
