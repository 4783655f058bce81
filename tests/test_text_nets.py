"""diffusers' text-conditional networks under the contract (families/), the Text through the objectives'
wrappers and losses, classifier-free guidance and autoguidance with text, and the checks made before any job."""

import copy
import importlib
import subprocess
import sys
import textwrap

import pytest
import torch

from diffrelay import nets
from diffrelay.errors import UserError
from diffrelay import families
from diffrelay.families import network as text_nets
from diffrelay.nets import checks, memory, registry
from diffrelay.objectives import ddpm, edm, flow
from diffrelay.sampling import guidance
from diffrelay.text.condition import Text

DIMS = {"states": 32, "length": 7, "pooled": 24}
R, C, B = 16, 3, 2
# The test and demo-sized UNet: attention and cross-attention at 8x8 only (16x16 self-attention costs most).
UNET = {"block_out_channels": [16, 32], "layers_per_block": 1, "attention_head_dim": 8, "norm_num_groups": 8,
        "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
        "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"]}
CONFIGS = {
    "unet": ("diffusers-unet", UNET),
    "sdxl": ("diffusers-unet", UNET | {"addition_embed_type": "text_time", "addition_time_embed_dim": 8}),
    "pixart": ("pixart", {"num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2, "out_channels": 2 * C}),
    "sd3": ("sd3", {"num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2, "pos_embed_max_size": 16}),
}


@pytest.fixture(scope="module")
def built():
    out = {}
    for name, (arch, kwargs) in CONFIGS.items():
        torch.manual_seed(0)
        net = registry.build_network(arch, kwargs, R, C, 0, text=DIMS)
        # diffusers zero-initialises the output convolutions (and PixArt/SD3 their adaLN): perturb every weight so
        # that each input (time, states, mask, pooled) moves the output.
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.05 * torch.randn_like(p))
        out[name] = net.eval()
    return out


def text_batch(seed=1, rows=B, length=DIMS["length"]) -> Text:
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(rows, length, dtype=torch.int64)
    mask[1:, 3:] = 0
    return Text(torch.randn(rows, length, DIMS["states"], generator=g), mask,
                torch.randn(rows, DIMS["pooled"], generator=g))


def direct(name, net, x, timestep, text):
    """diffusers' model called as its pipeline calls it, with the time input already scaled."""
    m = net.model
    if name == "sd3":
        return m(x, text.states, pooled_projections=text.pooled, timestep=timestep).sample
    if name == "pixart":  # PixArt's pipeline passes the mask; the learned-sigma half is dropped
        return m(x, text.states, timestep=timestep, encoder_attention_mask=text.mask,
                 added_cond_kwargs={"resolution": None, "aspect_ratio": None}).sample
    extra = {}
    if name == "sdxl":  # _get_add_time_ids: original size, crop top-left, target size
        ids = torch.tensor([[R, R, 0, 0, R, R]], dtype=torch.float32).repeat(x.shape[0], 1)
        extra = {"added_cond_kwargs": {"text_embeds": text.pooled, "time_ids": ids}}
    return m(x, timestep, text.states, **extra).sample  # SD's pipelines pass no encoder_attention_mask


# --- the objectives' wrappers call diffusers' model exactly as its pipeline would ------------------------------

@pytest.mark.parametrize("name", list(CONFIGS))
def test_edm_denoiser_is_the_preconditioned_diffusers_call(built, name):
    net, text = built[name], text_batch()
    x, sigma = torch.randn(B, C, R, R), torch.tensor([0.3, 7.0])
    got = edm.Denoiser(net)(x, sigma, text)
    s = sigma.reshape(-1, 1, 1, 1)
    c_skip, c_out, c_in = 0.25 / (s**2 + 0.25), s * 0.5 / (s**2 + 0.25).sqrt(), 1 / (0.25 + s**2).sqrt()
    f = direct(name, net, c_in * x, s.log().flatten() / 4 * 1000, text)[:, :C]
    assert torch.equal(got, c_skip * x + c_out * f)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_flow_and_ddpm_wrappers_are_the_diffusers_call_at_their_time_scale(built, name):
    net, text = built[name], text_batch()
    x = torch.randn(B, C, R, R)
    t = torch.tensor([0.2, 0.9])
    assert torch.equal(flow.VelocityModel(net)(x, t, text), direct(name, net, x, t * 1000, text)[:, :C])
    steps = copy.deepcopy(net)
    steps.time_scale = 1.0  # ddpm's integer steps, embedded as diffusers embeds them (model.kwargs.time_scale: 1)
    eps = ddpm.EpsModel(steps, C)(x, torch.tensor([10, 999]), text)
    full = direct(name, net, x, torch.tensor([10.0, 999.0]), text)
    assert torch.equal(eps, full) and eps.shape[1] == (2 * C if name == "pixart" else C)  # learned sigma kept


def test_pixart_masks_the_padding_and_sds_unet_attends_to_it_as_its_pipeline_does(built):
    text, x, t = text_batch(), torch.randn(B, C, R, R), torch.tensor([1.0, 2.0])
    changed = copy.deepcopy(text)
    changed.states[1, 3:] += 1  # only row 1's padded tokens
    for name, moves in (("pixart", False), ("unet", True)):
        a, b = (built[name](x, t, None, text=tx) for tx in (text, changed))
        assert torch.equal(a[0], b[0]) and (not torch.equal(a[1], b[1])) == moves, name


def test_sdxl_time_ids_use_pixel_size(built):
    net, text, x, t = copy.deepcopy(built["sdxl"]), text_batch(), torch.randn(B, C, R, R), torch.tensor([1.0, 2.0])
    net.pixels.fill_(128.0)  # model.kwargs.pixel_size: 128 (a latent run's image side)
    ids = torch.tensor([[128.0, 128, 0, 0, 128, 128]]).repeat(B, 1)
    want = net.model(x, t * 1000, text.states, added_cond_kwargs={"text_embeds": text.pooled, "time_ids": ids}).sample
    assert torch.equal(net(x, t, None, text=text), want)
    assert not torch.equal(want, built["sdxl"](x, t, None, text=text))
    built_with = registry.build_network("diffusers-unet", CONFIGS["sdxl"][1] | {"pixel_size": 128}, R, C, 0, text=DIMS)
    assert built_with.pixels.item() == 128 and "pixels" not in built_with.state_dict()


# --- training: a loss and its backward through each objective with a Text batch -------------------------------

@pytest.mark.parametrize("objective", ["edm", "ddpm", "flow"])
def test_each_objectives_loss_trains_every_parameter_from_a_text_batch(built, objective):
    name = {"edm": "sdxl", "ddpm": "pixart", "flow": "sd3"}[objective]  # pixart: ddpm's learned-sigma term too
    net = copy.deepcopy(built[name]).train()
    g = torch.Generator().manual_seed(3)
    images, rnd, noise = torch.rand(B, C, R, R, generator=g) * 2 - 1, torch.randn(B, generator=g), \
        torch.randn(B, C, R, R, generator=g)
    text = text_batch()
    if objective == "edm":
        loss = edm.loss(edm.Denoiser(net), images, text, rnd, noise, -1.2, 1.2, 0.5)
    elif objective == "ddpm":
        net.time_scale = 1.0
        loss = ddpm.loss(ddpm.EpsModel(net, C), images, text, rnd, noise)
    else:
        loss = flow.loss(flow.VelocityModel(net), images, text, rnd, noise, flow.TrainSettings())
    loss.backward()
    grads = [p.grad for p in net.parameters()]
    assert torch.isfinite(loss) and all(gr is not None and torch.isfinite(gr).all() for gr in grads)
    assert sum(gr.abs().sum() for gr in grads) > 0


def test_activation_checkpointing_is_diffusers_own_and_gives_the_same_gradients(built):
    def grads(net):
        loss = edm.loss(edm.Denoiser(net), torch.ones(B, C, R, R) * 0.5, text_batch(), torch.tensor([0.1, -0.4]),
                        torch.randn(B, C, R, R, generator=torch.Generator().manual_seed(0)), -1.2, 1.2, 0.5)
        return torch.autograd.grad(loss, list(net.parameters()))

    plain = copy.deepcopy(built["unet"]).train()
    ckpt = copy.deepcopy(plain)
    assert memory.enable(ckpt) == 1 and ckpt.model.is_gradient_checkpointing and not plain.checkpointing
    assert all(torch.equal(a, b) for a, b in zip(grads(plain), grads(ckpt)))


# --- guidance with text ---------------------------------------------------------------------------------------

def _heun(denoise, text, steps=3):
    latents = torch.randn(B, C, R, R, generator=torch.Generator().manual_seed(5))
    return edm.sample(denoise, latents, text, num_steps=steps, solver="heun")


@pytest.mark.parametrize("null", ["empty caption", "negative prompt"])
def test_classifier_free_guidance_with_text_is_the_two_branches_computed_apart(built, null):
    den = edm.Denoiser(built["sdxl"])
    text = text_batch()
    if null == "empty caption":  # one embedding for every row, as the sampler sets it: its tokens, then padding
        empty = text_batch(seed=9, rows=1)
        empty.mask[:, 2:] = 0
        text.null = empty[[0] * B]
    else:
        text.null = text_batch(seed=11)
    scale = 2.5
    got = _heun(guidance.guided(den, scale, null=0), text)

    def manual(x, sigma, t):
        cond, uncond = den(x, sigma, t.without_null()), den(x, sigma, t.null)
        return uncond + scale * (cond - uncond)

    want = _heun(manual, text)
    # One batch of 2B rows and two of B differ in float32's last bits (x starts at sigma_max = 80: about 1e-4 here).
    torch.testing.assert_close(got, want, rtol=0, atol=1e-3)
    other = copy.deepcopy(text)
    other.null = text_batch(seed=12)
    for changed in (_heun(den, text.without_null()), _heun(guidance.guided(den, scale, null=0), other)):
        assert (changed - got).abs().max() > 0.05  # guidance, and which null rows, move the images far more


def test_guidance_with_text_evaluates_both_branches_as_one_batch(built):
    seen = []

    def den(x, sigma, labels):
        seen.append(labels)
        return x * 0
    text = text_batch()
    text.null = text_batch(seed=4)
    guidance.guided(den, 2.0, null=0)(torch.zeros(B, C, R, R), torch.ones(B), text)
    (both,) = seen
    assert len(both) == 2 * B and torch.equal(both.states, torch.cat([text.states, text.null.states]))
    assert torch.equal(both.mask, torch.cat([text.mask, text.null.mask])) and both.null is None


def test_autoguidance_gives_the_guide_the_same_text_and_an_unconditional_guide_drops_only_class_labels(built):
    got = {}

    def recorder(key):
        def fn(x, sigma, labels):
            got[key] = labels
            return torch.full_like(x, float(len(got)))
        return fn
    text = text_batch()
    text.labels = torch.tensor([1, 2])
    out = guidance.autoguided(recorder("main"), recorder("ref"), 3.0)(torch.zeros(B, C, R, R), torch.ones(B), text)
    assert got["main"] is text and got["ref"] is text and torch.equal(out, torch.full_like(out, 1 + 3.0 * (2 - 1)))
    inner = []
    guidance.Unconditional(lambda x, s, labels: inner.append(labels) or x)(torch.zeros(1), torch.ones(1), text)
    assert isinstance(inner[0], Text) and inner[0].labels is None and inner[0].states is text.states
    inner.clear()
    guidance.Unconditional(lambda x, s, labels: inner.append(labels) or x)(torch.zeros(1), torch.ones(1),
                                                                           torch.tensor([1]))
    assert inner == [None]  # class labels: unchanged behaviour


# --- class labels beside text ------------------------------------------------------------------------------------

def test_diffusers_unet_takes_class_labels_with_a_null_row_and_the_transformers_refuse_them():
    torch.manual_seed(0)
    net = registry.build_network("diffusers-unet", UNET, R, C, 3, text=DIMS)
    assert net.model.class_embedding.num_embeddings == 4  # K + 1: label K is "no class"
    with torch.no_grad():
        for p in net.parameters():
            p.add_(0.05 * torch.randn_like(p))
    x, t, text = torch.randn(1, C, R, R), torch.zeros(1), text_batch(rows=1)
    outs = [net(x, t, torch.tensor([k]), text=text) for k in range(4)]
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[3])
    for arch in ("pixart", "sd3"):
        with pytest.raises(UserError, match=f"model.arch={arch}: takes no class labels") as e:
            registry.build_network(arch, CONFIGS[arch][1], R, C, 3, text=DIMS)
        assert "\n" not in str(e.value)


# --- sizes ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["unet", "sd3"])
def test_parameter_count_and_names_are_diffusers_own_models(built, name):
    from diffusers import SD3Transformer2DModel, UNet2DConditionModel

    arch, kwargs = CONFIGS[name]
    if name == "unet":
        own = UNet2DConditionModel(sample_size=R, in_channels=C, out_channels=C, cross_attention_dim=DIMS["states"],
                                   **kwargs)
    else:
        own = SD3Transformer2DModel(sample_size=R, in_channels=C, out_channels=C, joint_attention_dim=DIMS["states"],
                                    pooled_projection_dim=DIMS["pooled"], caption_projection_dim=32, **kwargs)
    assert registry.num_params(built[name]) == sum(p.numel() for p in own.parameters())
    assert list(built[name].state_dict()) == [f"model.{k}" for k in own.state_dict()]


# --- checks before any job -----------------------------------------------------------------------------------------

def test_text_problems_and_kwargs_checks_need_no_torch():
    code = ("import sys; from diffrelay import nets; from diffrelay.nets import checks; "
            "print(nets.text_problems({'arch': 'pixart'}, False)[0][0], 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["model.arch=pixart", "False"]


@pytest.mark.parametrize("arch, has_text, key", [
    ("diffusers-unet", False, "model.arch=diffusers-unet"), ("sd3", False, "model.arch=sd3"),
    ("unet", True, "model.arch=unet"), ("dit", True, "model.arch=dit"),
    ("pixart", True, None), ("dit", False, None), ("my_net:build", True, None), ("my_net:build", False, None)])
def test_text_problems_name_a_text_net_without_text_and_a_textless_net_given_text(arch, has_text, key):
    bad = nets.text_problems({"arch": arch}, has_text)
    assert [k for k, _ in bad] == ([key] if key else [])
    assert all("\n" not in m for _, m in bad)


def test_kwargs_check_takes_diffusers_keys_and_names_those_diffrelay_sets():
    ok = {"arch": "diffusers-unet", "kwargs": UNET | {"addition_embed_type": "text_time", "time_scale": 1}}
    assert nets.check_kwargs(ok) == []
    for arch, key in (("diffusers-unet", "cross_attention_dim"), ("pixart", "caption_channels"),
                      ("sd3", "pooled_projection_dim"), ("sd3", "sample_size"), ("pixart", "text")):
        (bad,) = nets.check_kwargs({"arch": arch, "kwargs": {key: 8}})
        assert bad[0] == f"model.kwargs.{key}" and "set by diffrelay itself" in bad[1]
    # A key diffusers' class does not take: one line when built, with the near key.
    with pytest.raises(UserError, match="did you mean layers_per_block") as e:
        registry.build_network("diffusers-unet", UNET | {"layer_per_block": 1}, R, C, 0, text=DIMS)
    assert "\n" not in str(e.value)
    assert "layers_per_block" in text_nets.config_keys(families.of_network("diffusers-unet"))


def test_model_checks_ddpm_time_scale_and_geometry():
    def keys(m, res=R):
        return [k for k, _ in checks.check_model({"objective": "edm", "kwargs": {}} | m, res)]
    assert keys({"arch": "diffusers-unet", "objective": "ddpm"}) == ["model.kwargs.time_scale"]
    assert keys({"arch": "sd3", "objective": "ddpm", "kwargs": {"time_scale": 1}}) == []
    assert keys({"arch": "diffusers-unet"}, res=20) == ["data.resolution=20"]  # 4 blocks by default: x8
    assert keys({"arch": "diffusers-unet", "kwargs": {"block_out_channels": [8, 16]}}, res=20) == []
    assert keys({"arch": "pixart", "kwargs": {"patch_size": 3}}) == ["model.kwargs.patch_size=3"]


def test_network_check_runs_the_text_net_forward_and_backward_and_refuses_a_net_without_pooled(built):
    n = registry.check({"arch": "diffusers-unet", "kwargs": UNET}, R, C, 0, text=DIMS)
    assert n == registry.num_params(built["unet"])
    with pytest.raises(UserError, match="needs a pooled text embedding") as e:
        registry.check({"arch": "sd3", "kwargs": CONFIGS["sd3"][1]}, R, C, 0, text=DIMS | {"pooled": 0})
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="model.arch=ddpmpp: takes no text"):
        registry.check({"arch": "ddpmpp", "kwargs": {}}, R, C, 0, text=DIMS)


WRONG_WIDTH = """
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 3)  # a text width of 16, whatever text["states"] says

        def forward(self, x, c_noise, labels, text=None):
            return x + self.proj(text.states).mean(1)[:, :, None, None]  # <- here

    def build(resolution, in_channels, num_classes, text=None):
        return Net()

    def build_without_text(resolution, in_channels, num_classes):
        return Net()
"""


def test_network_check_refuses_a_user_net_of_another_text_width_in_one_line(tmp_path, monkeypatch):
    (tmp_path / "wrong_width.py").write_text(textwrap.dedent(WRONG_WIDTH))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    try:
        with pytest.raises(UserError) as e:
            registry.check({"arch": "wrong_width:build", "kwargs": {}}, R, C, 0, text=DIMS)
        msg = str(e.value)
        assert "\n" not in msg and "wrong_width.py:11" in msg and "32" in msg and "16" in msg, msg
        assert registry.check({"arch": "wrong_width:build", "kwargs": {}}, R, C, 0, text=DIMS | {"states": 16}) == 51
        with pytest.raises(UserError, match="does not take the contract's keywords resolution, in_channels, "
                                            "num_classes, text") as e:
            registry.check({"arch": "wrong_width:build_without_text", "kwargs": {}}, R, C, 0, text=DIMS)
        assert "\n" not in str(e.value)
    finally:
        sys.modules.pop("wrong_width", None)
