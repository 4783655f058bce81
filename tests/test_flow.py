"""Flow matching (model.objective flow): the loss, the time draws, the ODE and SDE samplers, guidance interval,
seeds, resume, and the settings' checks.

The references below restate the formulas from the papers (SiT, Ma et al. 2024, eq. 2-8 and its Euler-Maruyama
sampler; SD3, Esser et al. 2024, the logit-normal and the timestep shift) per image in float64, not from the
package; benchmarks/checks/check_flow.py compares the package with SiT's and REPA's own code."""

import json
import math

import numpy as np
import pytest
import torch

from conftest import run_cli
from diffrelay import config
from diffrelay.errors import UserError
from diffrelay.objectives import flow
from diffrelay.sampling import sample
from diffrelay.training import checkpoint
from test_sample import folder_bytes, sample_args, settings
from test_train import assert_two_segments_equal_one_run


def phi(n: float) -> float:
    return 0.5 * (1 + math.erf(n / math.sqrt(2)))


def shifted(t: float, s: float) -> float:
    return s * t / (1 + (s - 1) * t)


def toy_velocity(x, t):
    """A velocity field with a closed form that depends on t."""
    return (x - 0.3) * (1 + t) - 0.1 * t


def as_net(fn):
    return lambda x, t, labels: fn(x.double(), t.double().reshape(-1, 1, 1, 1)).float()


# ---------------------------------------------------------------------------------------------
# Training: the interpolant, the target and the time draws


@pytest.mark.parametrize("st", [flow.TrainSettings(), flow.TrainSettings("lognormal", -0.4, 1.3, 3.0),
                                flow.TrainSettings("lognormal", 0.0, 1.0, 3.0, precondition_outputs=True)])
def test_velocity_loss_is_the_linear_interpolant_restated(st):
    seen = {}

    def net(x_t, t, labels):
        seen["x_t"], seen["t"] = x_t, t
        return torch.full_like(x_t, 0.25)

    g = torch.Generator().manual_seed(0)
    x, eps, n = torch.randn(4, 3, 2, 2, generator=g), torch.randn(4, 3, 2, 2, generator=g), torch.randn(4, generator=g)
    got = flow.loss(net, x, None, n, eps, st)
    for i in range(4):
        raw = phi(float(n[i])) if st.time == "uniform" else 1 / (1 + math.exp(-(st.mean + st.std * float(n[i]))))
        t = shifted(raw, st.shift)
        assert abs(float(seen["t"][i]) - t) < 1e-6
        np.testing.assert_allclose(seen["x_t"][i].numpy(), ((1 - t) * x[i] + t * eps[i]).numpy(), atol=1e-6)
    # precondition_outputs: the x0 loss of train_dreambooth_lora_sd3.py, t^2 x the velocity loss
    weight = [shifted(1 / (1 + math.exp(-float(n[i]))), st.shift) ** 2 if st.precondition_outputs else 1.0
              for i in range(4)]
    want = np.mean([weight[i] * (0.25 - (eps[i] - x[i]).double().numpy()) ** 2 for i in range(4)])
    assert abs(float(got) - want) < 1e-6


def test_uniform_times_are_uniform_and_shift_one_is_the_identity_bit_for_bit():
    n = torch.randn(200_000, generator=torch.Generator().manual_seed(1))
    t = flow.time_from_normal(n, flow.TrainSettings())
    counts = np.histogram(t.numpy(), bins=10, range=(0, 1))[0]
    assert t.min() >= 0 and t.max() <= 1 and np.abs(counts / 20_000 - 1).max() < 0.03
    assert flow.shift_time(t, 1.0) is t
    s = flow.shift_time(t, 3.0)
    assert (s >= t).all() and float((s - t).max()) > 0.1  # a shift above 1 moves times towards noise


# ---------------------------------------------------------------------------------------------
# Samplers: restated per image


def ode_reference(v, z, steps, heun, shift):
    grid = [shifted(1 - i / steps, shift) for i in range(steps + 1)]
    x = z
    for i in range(steps):
        t, t_next = grid[i], grid[i + 1]
        d = v(x, t)
        x_next = x + (t_next - t) * d
        if heun and i < steps - 1:
            x_next = x + (t_next - t) * 0.5 * (d + v(x_next, t_next))
        x = x_next
    return x


def sde_reference(v, z, steps, last, shift, draw):
    """SiT's Euler-Maruyama sampler in t = 1 - s: diffusion w(t) = t (its 'sigma' form), drift v - w score,
    score = -(x + (1 - t) v) / t, noise sqrt(2 w |dt|); the last step of size `last` is the mean step."""
    grid = [shifted(1 - i * (1 - last) / (steps - 1), shift) for i in range(steps)] + [0.0]
    x = z
    for i in range(steps):
        t, t_next = grid[i], grid[i + 1]
        vel = v(x, t)
        score = -(x + (1 - t) * vel) / t
        x_mean = x + (t_next - t) * (vel - t * score)
        x = x_mean if i == steps - 1 else x_mean + math.sqrt(2 * t * abs(t_next - t)) * draw()
    return x


def streams(seeds, shape):
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    z = torch.stack([torch.randn(shape, generator=g) for g in gens])

    def noise(size):
        return torch.stack([torch.randn(size[1:], generator=g, dtype=torch.float64) for g in gens])

    return z, noise


@pytest.mark.parametrize("solver, shift", [("euler", 1.0), ("heun", 1.0), ("heun", 3.0)])
def test_ode_samplers_are_the_probability_flow_restated(solver, shift):
    z, _ = streams([3, 11], (1, 2, 2))
    got = flow.sample(as_net(toy_velocity), z, num_steps=5, solver=solver, settings=flow.SamplerSettings(shift=shift))
    for k in range(2):
        want = ode_reference(toy_velocity, z[k].double().numpy(), 5, solver == "heun", shift)
        np.testing.assert_allclose(got[k].double().numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("steps, last, shift", [(6, 0.04, 1.0), (4, 0.1, 2.0)])
def test_sde_sampler_is_sits_euler_maruyama_restated_with_one_noise_stream_per_image(steps, last, shift):
    seeds, shape = [5, 9], (1, 2, 2)
    z, noise = streams(seeds, shape)
    st = flow.SamplerSettings(shift=shift, last_step=last)
    got = flow.sample(as_net(toy_velocity), z, num_steps=steps, solver="sde", settings=st, noise=noise)
    for k, seed in enumerate(seeds):
        g = torch.Generator().manual_seed(seed)
        zk = torch.randn(shape, generator=g).double().numpy()
        want = sde_reference(toy_velocity, zk, steps, last, shift,
                             lambda: torch.randn(shape, generator=g, dtype=torch.float64).numpy())
        np.testing.assert_allclose(got[k].double().numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("solver", ["euler", "heun", "sde"])
def test_guidance_interval_in_t_guides_exactly_the_steps_whose_time_lies_inside(solver):
    calls = []

    def recorder(tag):
        def fn(x, t, labels):
            calls.append(tag)
            return x * 0.1
        return fn

    steps, lo, hi = 8, 0.0, 0.7  # REPA's interval: guidance only below t = 0.7
    z, noise = streams([1], (1, 2, 2))
    flow.sample(recorder("guided"), z, num_steps=steps, solver=solver, noise=noise,
                unguided=recorder("plain"), interval=(lo, hi))
    if solver == "sde":
        grid = [1 - i * 0.96 / (steps - 1) for i in range(steps)]
    else:
        grid = [1 - i / steps for i in range(steps)]
    want = []
    for i, t in enumerate(grid):
        want += ["guided" if lo <= t <= hi else "plain"] * (2 if solver == "heun" and i < steps - 1 else 1)
    assert calls == want


# ---------------------------------------------------------------------------------------------
# Through the sampling process: seeds and checks


def flow_snapshot(path, num_classes=3, label_dropout=0.1):
    return noisy_snapshot(path, {"data": {"resolution": 16},
                                 "model": {"objective": "flow", "channels": 8, "channel_mult": [1, 2],
                                           "class_conditional": True},
                                 "train": {"label_dropout": label_dropout}}, num_classes)


def noisy_snapshot(path, raw: dict, num_classes=3):
    """A 16x16 snapshot of the network `raw` (a config) with seeded noise added to every weight."""
    d = config.validate(raw)
    torch.manual_seed(0)
    from diffrelay import objectives

    net = objectives.build(d["model"], 16, num_classes)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    meta = {"step": 40, "model": d["model"], "config": d, "image_shape": [3, 16, 16], "num_classes": num_classes,
            "class_names": ["a", "b", "c"][:num_classes]}
    return checkpoint.save_snapshot(path, net.state_dict(), net.state_dict(), meta)


def test_flow_sde_pngs_are_byte_identical_for_any_process_count_and_batch_size(tmp_path):
    snap = flow_snapshot(tmp_path / "step_0000040.safetensors")
    one, two = tmp_path / "one", tmp_path / "two"
    run_cli(*sample_args(snap, one, "--num-images", 20, "--steps", 4, "--solver", "sde", "--batch-size", 8,
                         "--guidance", 1.5))
    run_cli("torchrun", "--standalone", "--nproc-per-node", 2, "-m", "diffrelay",
            *sample_args(snap, two, "--num-images", 20, "--steps", 4, "--solver", "sde", "--batch-size", 3,
                         "--guidance", 1.5))
    ref = folder_bytes(one)
    assert len(ref) == 21 and folder_bytes(two) == ref
    sample.run(snap, tmp_path / "ode", settings(num_images=20, steps=4, solver="euler", guidance=1.5))
    assert folder_bytes(tmp_path / "ode")["000000.png"] != ref["000000.png"]
    manifest = json.loads((one / "manifest.json").read_text())
    assert manifest["solver"] == "sde" and manifest["guidance"] == 1.5


def test_sampler_settings_of_the_other_objective_are_one_line(tmp_path):
    from test_sample import make_snapshot

    edm_snap = make_snapshot(tmp_path / "edm.safetensors")
    with pytest.raises(UserError, match="--solver sde: .* model.objective edm"):
        sample.run(edm_snap, tmp_path / "a", settings(solver="sde"))
    flow_snap = flow_snapshot(tmp_path / "flow.safetensors")
    from diffrelay.objectives import edm

    with pytest.raises(UserError, match="sample.edm .* model.objective flow"):
        sample.run(flow_snap, tmp_path / "b", settings(edm=edm.SamplerSettings(S_churn=10)))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("raw, words", [
    ({"model": {"objective": "vpred"}}, ["model.objective", "edm", "flow"]),
    ({"sample": {"solver": "sde"}}, ["sample.solver=sde", "model.objective: flow"]),
    ({"model": {"objective": "flow"}, "sample": {"edm": {"S_churn": 5}}}, ["sample.edm", "sample.flow"]),
    ({"model": {"objective": "flow", "class_conditional": True}, "train": {"label_dropout": 0.1},
      "sample": {"guidance": 2, "guidance_interval": [1.2, 1.5]}}, ["sample.guidance_interval", "[0.0, 1.0]"]),
    ({"model": {"objective": "flow", "class_conditional": True}, "train": {"label_dropout": 0.1},
      "sample": {"guidance": 2, "guidance_interval": [0.7, 0.2]}}, ["sample.guidance_interval", "lo < hi"]),
    ({"train": {"flow": {"shift": 0}}}, ["train.flow.shift"]),
    ({"sample": {"flow": {"last_step": 1.5}}}, ["sample.flow.last_step"]),
    ({"sample": {"flow": {"guided_channels": 3}}}, ["sample.flow", "model.objective: edm", "remove"]),
    ({"model": {"objective": "flow"}, "sample": {"flow": {"guided_channels": 4}}},
     ["sample.flow.guided_channels=4", "sees 3 channels", "at most 3"]),
    ({"model": {"objective": "ddpm"}, "sample": {"solver": "ddpm", "ddpm": {"guided_channels": 5}},
      "data": {"encoder": "sd-vae"}}, ["sample.ddpm.guided_channels=5", "sees 4 channels"]),
])
def test_objective_and_solver_mistakes_are_one_line_at_parse_time(raw, words):
    with pytest.raises(UserError) as err:
        config.validate(raw)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_edm_runs_keep_their_identity_and_flow_runs_have_their_own():
    edm_run = config.trajectory(config.Config(config.validate({})))
    assert "objective" not in edm_run["model"] and "flow" not in edm_run["train"]
    assert "p_mean" in edm_run["train"] and "sigma_data" in edm_run["model"]
    flow_cfg = config.Config(config.validate({"model": {"objective": "flow"}}))
    f = config.trajectory(flow_cfg)
    assert f["model"]["objective"] == "flow" and f["train"]["flow"]["time"] == "uniform"
    other = config.Config(config.validate({"model": {"objective": "flow"}, "train": {"flow": {"time": "lognormal"}}}))
    assert config.trajectory_hash(other) != config.trajectory_hash(flow_cfg)
    # EDM's keys do not change a flow run, flow's keys do not change an EDM run
    assert config.trajectory_hash(config.Config(config.validate(
        {"model": {"objective": "flow"}, "train": {"p_mean": 0.3}}))) == config.trajectory_hash(flow_cfg)
    assert config.trajectory_hash(config.Config(config.validate(
        {"train": {"flow": {"shift": 3}}}))) == config.trajectory_hash(config.Config(config.validate({})))
    # precondition_outputs off is no key of the trajectory (runs from before it keep their hash); on, another run
    assert "precondition_outputs" not in f["train"]["flow"]
    pre = config.Config(config.validate({"model": {"objective": "flow"}, "train": {"flow": {
        "precondition_outputs": True}}}))
    assert config.trajectory(pre)["train"]["flow"]["precondition_outputs"] is True
    assert config.trajectory_hash(pre) != config.trajectory_hash(flow_cfg)


# ---------------------------------------------------------------------------------------------
# Training: segments


def test_flow_training_in_two_segments_matches_one_run_bitwise(tmp_path):
    base = {
        "run": {"name": "r", "device": "cpu"},
        "data": {"kind": "shapes", "resolution": 16, "count": 20, "seed": 0},
        "model": {"objective": "flow", "channels": 8, "channel_mult": [1, 2], "num_blocks": 1,
                  "class_conditional": True},
        "train": {"total_steps": 4, "segment_steps": 2, "batch_size": 8, "lr": 0.002, "warmup_steps": 1,
                  "log_every": 1, "label_dropout": 0.1, "flow": {"time": "lognormal", "shift": 2.0}},
    }
    losses = assert_two_segments_equal_one_run(tmp_path, base)
    assert len(losses) == 4 and all(math.isfinite(v) and v > 0 for v in losses)


def test_guidance_extrapolates_only_the_first_guided_channels_as_sits_forward_with_cfg(tmp_path, monkeypatch):
    """SiT guides 3 of its 4 latent channels (models.py:261); sample.flow.guided_channels does the same, the other
    channels coming from the conditional pass. Here 2 of 3: the images change, and more channels than the
    snapshot has is one line."""
    from diffrelay.sampling import guidance

    snap = flow_snapshot(tmp_path / "f.safetensors")
    seen, real = [], guidance.guided
    monkeypatch.setattr(guidance, "guided", lambda f, scale, null, ch=None: seen.append(ch) or real(f, scale, null, ch))
    runs = {ch: sample.run(snap, tmp_path / f"ch{ch}", settings(num_images=4, steps=3, solver="euler", guidance=2.0,
                                                                 flow=flow.SamplerSettings(guided_channels=ch)))
            for ch in (None, 2)}
    assert seen == [None, 2]
    a, b = folder_bytes(tmp_path / "chNone"), folder_bytes(tmp_path / "ch2")
    assert all(a[k] != b[k] for k in a if k.endswith(".png") and k != "grid.png")
    assert runs[2]["flow"] == {"guided_channels": 2} and "flow" not in runs[None]  # part of the folder's identity
    with pytest.raises(UserError, match=r"sample.flow.guided_channels=4: .* has 3 image channels"):
        sample.run(snap, tmp_path / "ch4", settings(guidance=2.0, flow=flow.SamplerSettings(guided_channels=4)))
