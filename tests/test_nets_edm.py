"""EDM's networks (diffrelay.nets.edm): the formulas restated, without EDM's code (CI has none of it).

benchmarks/checks/check_edm_equivalence.py compares them with NVlabs/edm's training/networks.py on the same weights;
these tests pin what that check found and what the contract adds (the null class, optional augment labels).
"""

import math

import pytest
import torch

from diffrelay.nets import edm, memory

BUILDERS = {"ddpmpp": edm.build_ddpmpp, "ncsnpp": edm.build_ncsnpp, "adm": edm.build_adm}
TINY_SONG = dict(model_channels=16, channel_mult=[1, 2], num_blocks=1, attn_resolutions=[8])
# ADM gives a block one attention head per 64 channels: below 64 it has none, so tiny ADMs use 64.
TINY_ADM = dict(model_channels=64, channel_mult=[1, 2], num_blocks=1, attn_resolutions=[4])
TINY = {"ddpmpp": TINY_SONG, "ncsnpp": TINY_SONG, "adm": TINY_ADM}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Networks this small gain nothing from a second thread, which only spins (seconds on a loaded machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny(arch, classes=10, resolution=8, channels=3, **kw):
    torch.manual_seed(0)
    return BUILDERS[arch](resolution, channels, classes, **(TINY[arch] | kw))


def perturb(net, seed=1):
    """Move every parameter by seeded noise, so zero-initialised layers (ADM's output, its augment map) matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return net


def inputs(n=4, resolution=8, channels=3):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(n, channels, resolution, resolution, generator=g)
    sigma = torch.tensor([0.002, 0.3, 2.0, 80.0])[:n]
    return x, sigma.log() / 4  # EDM's c_noise


def count(net):
    return sum(p.numel() for p in net.parameters())


# --- sizes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch, dropout, augment_dim, fir", [("ddpmpp", 0.13, 9, (1, 1)), ("ncsnpp", 0.13, 9, (1, 3, 3, 1)),
                                                         ("adm", 0.10, 0, (1, 1))])
def test_presets_are_edms_training_commands(arch, dropout, augment_dim, fir):
    """EDM's README: CIFAR-10 runs take train.py's defaults (--dropout 0.13, --augment 0.12, so augment_dim 9);
    ImageNet-64 ADM passes --dropout=0.10 --augment=0 (no augment map)."""
    with torch.device("meta"):
        net = BUILDERS[arch](32, 3, 10)
    assert net.enc["16x16_down"].dropout == dropout
    assert (net.map_augment.weight.shape[1] if net.map_augment is not None else 0) == augment_dim
    assert net.enc["16x16_down"].conv0.resample_filter.shape[-1] == len(fir)


@pytest.mark.parametrize("arch, resolution, classes, augment_dim, official", [
    ("ddpmpp", 32, 0, 9, 55_733_891),    # EDM's CIFAR-10 DDPM++, unconditional (the paper: 55.73 M)
    ("ddpmpp", 32, 10, 9, 55_735_299),   # ... class-conditional
    ("ncsnpp", 32, 0, 9, 56_397_827),
    ("ncsnpp", 32, 10, 9, 56_400_643),
    ("adm", 64, 1000, 0, 295_899_267),   # EDM's ImageNet-64 ADM (the paper: 295.9 M)
])
def test_presets_have_the_official_parameter_counts(arch, resolution, classes, augment_dim, official):
    """Counted by EDM's own networks (benchmarks/checks/check_edm_equivalence.py), on the meta device here."""
    with torch.device("meta"):
        assert count(BUILDERS[arch](resolution, 3, classes, augment_dim=augment_dim)) == official


def test_label_and_augment_maps_add_what_their_shapes_say():
    """SongUNet: the label map is a K x (model_channels * channel_mult_noise) linear with bias, the augment map
    9 x that without; ADM's augment map is 9 x model_channels without bias, its label map K x 4*model_channels."""
    with torch.device("meta"):
        n = {(a, k, d): count(BUILDERS[a](32 if a != "adm" else 64, 3, k, augment_dim=d))
             for a, k, d in [("ddpmpp", 0, 0), ("ddpmpp", 10, 0), ("ddpmpp", 0, 9), ("ncsnpp", 0, 0),
                             ("ncsnpp", 0, 9), ("adm", 0, 0), ("adm", 0, 9), ("adm", 1000, 0)]}
    assert n["ddpmpp", 10, 0] - n["ddpmpp", 0, 0] == 10 * 128 + 128
    assert n["ddpmpp", 0, 9] - n["ddpmpp", 0, 0] == 9 * 128
    assert n["ncsnpp", 0, 9] - n["ncsnpp", 0, 0] == 9 * 256  # channel_mult_noise 2
    assert n["adm", 0, 9] - n["adm", 0, 0] == 9 * 192
    assert n["adm", 1000, 0] - n["adm", 0, 0] == 1000 * 768


@pytest.mark.parametrize("arch", ["ddpmpp", "ncsnpp", "adm"])
@pytest.mark.parametrize("resolution, channels", [(8, 3), (16, 1), (32, 4)])
def test_output_is_shaped_like_the_input(arch, resolution, channels):
    net = tiny(arch, resolution=resolution, channels=channels).eval()
    x, c_noise = inputs(2, resolution, channels)
    with torch.no_grad():
        assert net(x, c_noise, torch.tensor([0, 10])).shape == x.shape


@pytest.mark.parametrize("arch", ["ddpmpp", "ncsnpp", "adm"])
def test_full_presets_run_on_the_meta_device(arch):
    """nets.registry checks built-in networks with one meta-device pass, labels 0 and the null class K."""
    resolution = 64 if arch == "adm" else 32
    with torch.device("meta"):
        net = BUILDERS[arch](resolution, 3, 1000)
        x = torch.zeros(2, 3, resolution, resolution)
        assert net(x, torch.zeros(2), torch.tensor([0, 1000])).shape == x.shape


# --- the contract: null class, augment labels ----------------------------------------------------

@pytest.mark.parametrize("arch", ["ddpmpp", "ncsnpp", "adm"])
def test_null_class_is_the_zero_one_hot_and_the_unconditional_network(arch):
    """Label K = the all-zero one-hot row: the label map then adds only its bias (SongUNet) or nothing (ADM),
    so with that bias at zero the output is the unconditional network's on the same other weights."""
    cond = perturb(tiny(arch, classes=10)).eval()
    if cond.map_label.bias is not None:
        with torch.no_grad():
            cond.map_label.bias.zero_()
    plain = tiny(arch, classes=0).eval()
    plain.load_state_dict({k: v for k, v in cond.state_dict().items() if not k.startswith("map_label.")})
    x, c_noise = inputs()
    with torch.no_grad():
        null = cond(x, c_noise, torch.full((4,), 10))
        assert torch.equal(null, cond(x, c_noise, torch.zeros(4, 10)))  # EDM's class_labels form
        assert torch.equal(null, plain(x, c_noise, None))
        assert not torch.allclose(null, cond(x, c_noise, torch.zeros(4, dtype=torch.long)))


@pytest.mark.parametrize("arch, scale", [("ddpmpp", math.sqrt(10)), ("ncsnpp", math.sqrt(10)), ("adm", 1.0)])
def test_label_map_sees_the_one_hot_scaled_as_edm_scales_it(arch, scale):
    """SongUNet feeds one-hot x sqrt(K) to its label map (unit mean square); ADM the plain one-hot."""
    net, seen = tiny(arch).eval(), []
    net.map_label.register_forward_hook(lambda module, args, out: seen.append(args[0]))
    with torch.no_grad():
        net(*inputs(3), torch.tensor([2, 10, 9]))
    want = torch.zeros(3, 10)
    want[0, 2], want[2, 9] = scale, scale
    assert torch.equal(seen[0], want)


@pytest.mark.parametrize("arch", ["ddpmpp", "ncsnpp", "adm"])
def test_augment_labels_none_is_zeros_for_the_bias_free_augment_map(arch):
    net = perturb(tiny(arch, augment_dim=9)).eval()
    assert net.map_augment.bias is None
    x, c_noise = inputs()
    labels = torch.tensor([0, 3, 10, 5])
    with torch.no_grad():
        skipped = net(x, c_noise, labels)
        assert torch.equal(skipped, net(x, c_noise, labels, augment_labels=torch.zeros(4, 9)))
        assert not torch.allclose(skipped, net(x, c_noise, labels, augment_labels=torch.randn(4, 9)))


def test_dropout_follows_train_and_eval():
    net = perturb(tiny("ddpmpp", dropout=0.3))
    x, c_noise = inputs()
    labels = torch.tensor([0, 1, 2, 10])
    with torch.no_grad():
        net.train()
        torch.manual_seed(4)
        a = net(x, c_noise, labels)
        torch.manual_seed(4)
        assert torch.equal(a, net(x, c_noise, labels))
        assert not torch.allclose(a, net(x, c_noise, labels))  # another draw
        net.eval()
        assert torch.equal(net(x, c_noise, labels), net(x, c_noise, labels))


# --- layers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode, bound, std", [
    ("xavier_uniform", math.sqrt(6 / (300 + 500)), None), ("kaiming_uniform", math.sqrt(3 / 300), None),
    ("xavier_normal", None, math.sqrt(2 / (300 + 500))), ("kaiming_normal", None, math.sqrt(1 / 300))])
def test_weight_init_modes_have_their_bounds_and_stds(mode, bound, std):
    torch.manual_seed(0)
    lin = edm.Linear(300, 500, mode=mode, gain=2.0, bias_gain=0.5)
    w, b = lin.weight.detach(), lin.bias.detach()
    if bound is not None:  # uniform on [-bound, bound] times the gain
        assert w.abs().max() <= 2 * bound and w.abs().max() > 0.99 * 2 * bound
        assert b.abs().max() <= 0.5 * bound
        assert abs(float(w.std()) - 2 * bound / math.sqrt(3)) < 0.02 * 2 * bound / math.sqrt(3)
    else:
        assert abs(float(w.std()) - 2 * std) < 0.02 * 2 * std
    assert torch.equal(edm.Linear(300, 500, mode=mode).bias.detach(), torch.zeros(500))  # bias_gain 0
    conv = edm.Conv(8, 16, 3, mode="xavier_uniform")  # fans count the kernel: 8*9 in, 16*9 out
    assert conv.weight.abs().max() <= math.sqrt(6 / (8 * 9 + 16 * 9))
    with pytest.raises(ValueError):
        edm.edm_init((2, 2), "he_normal", 2, 2)


def test_presets_initialise_as_edm_does():
    torch.manual_seed(0)
    song = edm.build_ddpmpp(16, 3, 10, model_channels=32, channel_mult=[1, 2], num_blocks=1, attn_resolutions=[8])
    block = song.enc["8x8_block0"]
    xavier = math.sqrt(6 / (64 * 9 + 64 * 9))
    assert 0 < block.conv1.weight.abs().max() <= 1e-5 * xavier  # near zero, not zero
    assert block.qkv.weight.abs().max() <= math.sqrt(0.2) * math.sqrt(6 / (64 + 192))
    assert not song.map_layer0.bias.any()
    adm = edm.build_adm(8, 3, 100, augment_dim=9, **TINY_ADM)
    assert not adm.out_conv.weight.any() and not adm.out_conv.bias.any() and not adm.map_augment.weight.any()
    assert abs(float(adm.map_label.weight.detach().std()) - 1) < 0.03  # kaiming_normal times sqrt(K)
    assert adm.map_label.bias is None and adm.map_augment.bias is None


def test_attention_heads_follow_each_architecture():
    adm = edm.build_adm(8, 3, 0, **(TINY_ADM | dict(attn_resolutions=[8, 4], model_channels=32)))
    assert not hasattr(adm.enc["8x8_block0"], "qkv")  # 32 channels: 32 // 64 = 0 heads, no attention
    assert adm.enc["4x4_block0"].num_heads == 1 and adm.dec["4x4_in0"].qkv.weight.shape == (192, 64, 1, 1)
    song = tiny("ddpmpp", model_channels=64, attn_resolutions=[8])
    assert song.enc["8x8_block0"].num_heads == 1 and song.dec["4x4_in0"].num_heads == 1  # always one head
    assert not hasattr(song.dec["8x8_block0"], "qkv") and hasattr(song.dec["8x8_block1"], "qkv")  # level's last


@pytest.mark.parametrize("taps", [(1, 1), (1, 3, 3, 1)])
def test_resample_filter_is_the_normalised_outer_product(taps):
    f = edm.Conv(4, 4, 0, down=True, resample_filter=taps).resample_filter
    t = torch.tensor(taps, dtype=torch.float32)
    assert f.shape == (1, 1, len(taps), len(taps))
    assert float(f.sum()) == 1.0
    assert torch.equal(f[0, 0], t[:, None] * t[None, :] / 64 if len(taps) == 4 else torch.full((2, 2), 0.25))
    assert edm.Conv(4, 4, 3).resample_filter is None  # no resampling, no buffer (as in EDM's state dicts)


@pytest.mark.parametrize("taps", [(1, 1), (1, 3, 3, 1)])
def test_resampling_keeps_a_constant_image(taps):
    """Down and up by the FIR filter keep a constant; [1,3,3,1] reaches one pixel past the edge, where the zero
    padding darkens the border ring, so only the interior is constant there."""
    x = torch.full((1, 2, 8, 8), 1.5)
    down = edm.Conv(2, 2, 0, down=True, resample_filter=taps)(x)
    up = edm.Conv(2, 2, 0, up=True, resample_filter=taps)(x)
    assert down.shape == (1, 2, 4, 4) and up.shape == (1, 2, 16, 16)
    inner = slice(None) if len(taps) == 2 else slice(1, -1)
    assert torch.allclose(down[..., inner, inner], torch.tensor(1.5), atol=1e-6, rtol=0)
    assert torch.allclose(up[..., inner, inner], torch.tensor(1.5), atol=1e-6, rtol=0)
    if len(taps) == 4:
        assert down[0, 0, 0, 0] < 1.5


def test_noise_embeddings_restated():
    """Positional: frequencies 10000^(-i / (n/2 - 1)) with EDM's endpoint (SongUNet; sin half first, as it
    swaps the halves), 10000^(-i / (n/2)) without (ADM; cos first). Fourier: 2 pi times N(0, 16^2) draws."""
    c = torch.tensor([-1.5, 0.0, 0.7])
    song = tiny("ddpmpp").map_noise(c)
    i = torch.arange(8, dtype=torch.float64)
    ang = c.double()[:, None] * 10000 ** (-i / 7)
    assert torch.allclose(song.double(), torch.cat([ang.sin(), ang.cos()], dim=1), atol=1e-6)
    adm = tiny("adm").map_noise(c)
    ang = c.double()[:, None] * 10000 ** (-torch.arange(32, dtype=torch.float64) / 32)
    assert torch.allclose(adm.double(), torch.cat([ang.cos(), ang.sin()], dim=1), atol=1e-6)
    torch.manual_seed(0)
    fourier = edm.NoiseEmbedding(4096, "fourier")
    assert abs(float(fourier.freqs.std()) - 16) < 0.8
    ang = c[:, None] * 2 * math.pi * fourier.freqs
    assert torch.allclose(fourier(c), torch.cat([ang.cos(), ang.sin()], dim=1), atol=1e-4)


# --- training -------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["ddpmpp", "ncsnpp", "adm"])
def test_forward_and_backward_reach_every_parameter(arch):
    net = tiny(arch, augment_dim=9, dropout=0.1).train()
    x, c_noise = inputs()
    net(x, c_noise, torch.tensor([0, 3, 10, 5]), augment_labels=torch.randn(4, 9)).square().mean().backward()
    for name, p in net.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_activation_checkpointing_gives_the_same_gradients():
    net = perturb(tiny("ncsnpp", dropout=0.2)).train()
    x, c_noise = inputs()
    grads = []
    for on in (False, True):
        net.zero_grad()
        net.checkpointing = on
        torch.manual_seed(3)
        net(x, c_noise, torch.tensor([0, 3, 10, 5]), augment_labels=torch.randn(4, 9)).square().mean().backward()
        grads.append([p.grad.clone() for p in net.parameters()])
    assert memory.enable(net) == 1
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# --- checkpoint format and builders ---------------------------------------------------------------

def test_state_dict_uses_edms_names_and_official_keys_strips_the_precond_prefix():
    net = tiny("ncsnpp", encoder_type="residual")
    state = net.state_dict()
    assert {"map_noise.freqs", "map_label.weight", "enc.8x8_conv.weight", "enc.4x4_down.conv0.resample_filter",
            "enc.4x4_aux_residual.resample_filter", "dec.8x8_aux_conv.bias", "dec.4x4_in0.qkv.weight"} <= set(state)
    other = tiny("ncsnpp", encoder_type="residual")
    other.load_state_dict(edm.official_keys({f"model.{k}": v for k, v in state.items()}), strict=True)
    assert torch.equal(other.map_noise.freqs, net.map_noise.freqs)  # the random Fourier draws travel too
    assert edm.official_keys(state).keys() == state.keys()


@pytest.mark.parametrize("arch", ["ddpmpp", "ncsnpp", "adm"])
def test_builders_take_exactly_their_kwargs(arch):
    with torch.device("meta"):
        default = count(BUILDERS[arch](32, 3, 10))
        assert count(BUILDERS[arch](32, 3, 10, **edm.PRESETS[arch])) == default  # every name in KWARGS
        with pytest.raises(TypeError, match="chanel_mult"):
            BUILDERS[arch](32, 3, 10, chanel_mult=[1, 2])
        with pytest.raises(TypeError):  # diffrelay drops labels in its data pipeline, never in the network
            BUILDERS[arch](32, 3, 10, label_dropout=0.1)
        with pytest.raises(ValueError, match="halve"):
            BUILDERS[arch](36, 3, 10, channel_mult=[1, 2, 2, 2])
    shared = {"model_channels", "channel_mult", "channel_mult_emb", "num_blocks", "attn_resolutions", "dropout",
              "augment_dim"}
    song = {"embedding_type", "channel_mult_noise", "encoder_type", "decoder_type", "resample_filter"}
    assert set(edm.KWARGS[arch]) == shared | (set() if arch == "adm" else song)


@pytest.mark.parametrize("bad", [dict(embedding_type="sinusoid"), dict(encoder_type="unet"),
                                 dict(decoder_type="residual")])
def test_song_unet_refuses_unknown_variants(bad):
    with pytest.raises(ValueError):
        edm.build_ddpmpp(16, 3, 0, **(TINY_SONG | bad))
