"""EDM's stochastic sampler (sample.edm): the algorithm restated, its seeds, and its settings.

The reference below restates Algorithm 2 of Karras et al. 2022 from the paper, step by step and per image;
benchmarks/checks/check_edm_sampler.py compares the package with NVlabs/edm's own edm_sampler."""

import dataclasses
import math

import numpy as np
import pytest
import torch

from conftest import run_cli
from diffrelay.objectives import edm
from diffrelay.sampling import sample
from test_sample import folder_bytes, sample_args, settings

CHURN = edm.SamplerSettings(S_churn=40, S_min=0.05, S_max=50, S_noise=1.003)  # the paper's ImageNet-64 values


def algorithm_2(denoise, z, seed_noise, steps, st):
    """One image, float64: x_0 = sigma_0 z; at each step raise t to t_hat = t (1 + gamma) with noise
    sqrt(t_hat^2 - t^2) S_noise n_i, an Euler step to t_next and (except to 0) Heun's correction."""
    sig = [(st.sigma_max ** (1 / st.rho) + i / (steps - 1) * (st.sigma_min ** (1 / st.rho) - st.sigma_max ** (1 / st.rho)))
           ** st.rho for i in range(steps)] + [0.0]
    x = z * sig[0]
    for i in range(steps):
        t, t_next = sig[i], sig[i + 1]
        inside = st.S_min <= t <= (math.inf if st.S_max is None else st.S_max)
        gamma = min(st.S_churn / steps, math.sqrt(2) - 1) if inside else 0.0
        t_hat = t + gamma * t
        x = x + math.sqrt(t_hat**2 - t**2) * st.S_noise * seed_noise()
        d = (x - denoise(x, t_hat)) / t_hat
        x_next = x + (t_next - t_hat) * d
        if i < steps - 1:
            x_next = x + (t_next - t_hat) * 0.5 * (d + (x_next - denoise(x_next, t_next)) / t_next)
        x = x_next
    return x


def toy(x, t):
    """A denoiser with a closed form that depends on the noise level: shrink towards 0.3."""
    return (x + 0.3 * t**2) / (1 + t**2)


def test_the_sampler_is_algorithm_2_restated_with_one_noise_stream_per_image():
    steps, seeds, shape = 6, [3, 11], (1, 2, 2)
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    z = torch.stack([torch.randn(shape, generator=g) for g in gens])

    def noise(size):
        return torch.stack([torch.randn(size[1:], generator=g, dtype=torch.float64) for g in gens])

    net = lambda x, sigma, labels: toy(x.double(), sigma.double().reshape(-1, 1, 1, 1)).float()  # noqa: E731
    got = edm.sample(net, z, num_steps=steps, settings=CHURN, noise=noise)
    for k, seed in enumerate(seeds):
        g = torch.Generator().manual_seed(seed)
        zk = torch.randn(shape, generator=g).double().numpy()
        want = algorithm_2(toy, zk, lambda: torch.randn(shape, generator=g, dtype=torch.float64).numpy(), steps, CHURN)
        np.testing.assert_allclose(got[k].double().numpy(), want, rtol=1e-5, atol=1e-5)


def test_churn_outside_the_schedule_draws_but_changes_nothing_and_inside_it_changes_the_images(tmp_path):
    from test_sample import make_snapshot

    snap = make_snapshot(tmp_path / "step_0000040.safetensors")
    base = sample.run(snap, tmp_path / "ode", settings(num_images=8))
    never = edm.SamplerSettings(S_churn=40, S_min=100.0)  # above sigma_max: gamma is 0 at every step
    sample.run(snap, tmp_path / "never", settings(num_images=8, edm=never))
    sample.run(snap, tmp_path / "sde", settings(num_images=8, edm=CHURN))
    ode = {k: v for k, v in folder_bytes(tmp_path / "ode").items() if k != "grid.png"}
    assert {k: v for k, v in folder_bytes(tmp_path / "never").items() if k != "grid.png"} == ode
    sde = folder_bytes(tmp_path / "sde")
    assert all(sde[k] != v for k, v in ode.items())
    assert "edm" not in base and (tmp_path / "sde" / "manifest.json").read_text().count('"S_churn": 40') == 1


def test_stochastic_pngs_are_byte_identical_for_any_process_count_and_batch_size(tmp_path):
    from test_sample import make_snapshot

    snap = make_snapshot(tmp_path / "step_0000040.safetensors")
    flags = ["--s-churn", 40, "--s-min", 0.05, "--s-max", 50, "--s-noise", 1.003]
    one = tmp_path / "one"
    run_cli(*sample_args(snap, one, "--num-images", 24, "--steps", 3, "--batch-size", 8, *flags))
    two = tmp_path / "two"
    run_cli("torchrun", "--standalone", "--nproc-per-node", 2, "-m", "diffrelay",
            *sample_args(snap, two, "--num-images", 24, "--steps", 3, "--batch-size", 5, *flags))
    sample.run(snap, tmp_path / "b3", settings(num_images=24, batch_size=3, edm=CHURN))
    ref = folder_bytes(one)
    assert folder_bytes(two) == ref and folder_bytes(tmp_path / "b3") == ref
    ode = tmp_path / "ode"
    run_cli(*sample_args(snap, ode, "--num-images", 24, "--steps", 3))
    assert folder_bytes(ode)["000000.png"] != ref["000000.png"]


@pytest.mark.parametrize("flags, words", [
    (["--s-churn", -1], ["sample.edm.S_churn=-1", "at least 0"]),
    (["--s-min", 5, "--s-max", 1], ["sample.edm.S_min=5", "below sample.edm.S_max=1"]),
    (["--sigma-min", 90], ["sample.edm.sigma_min=90", "below sample.edm.sigma_max=80"]),
])
def test_bad_sampler_flags_are_one_line_before_any_work(tmp_path, flags, words):
    from test_sample import make_snapshot

    snap = make_snapshot(tmp_path / "step_0000040.safetensors")
    p = run_cli(*sample_args(snap, tmp_path / "out", *flags), check=False)
    lines = [x for x in p.stderr.splitlines() if x.startswith("diffrelay: error:")]
    assert p.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), p.stderr
    assert not (tmp_path / "out").exists() and not sample.work_dir(tmp_path / "out").exists()


@pytest.mark.parametrize("solver", ["heun", "euler"])
@pytest.mark.parametrize("lo, hi", [(0.5, 10.0), (0.0, 1000.0), (30.0, 30.5)])
def test_guidance_interval_guides_exactly_the_steps_whose_level_lies_inside(solver, lo, hi):
    """Which denoiser each evaluation used, against the schedule restated: a step of level t is guided iff
    lo <= t <= hi, and Heun's second evaluation of that step follows its first."""
    calls = []

    def recorder(tag):
        def fn(x, sigma, labels):
            calls.append((tag, float(sigma[0])))
            return x * 0.9
        return fn

    steps = 8
    edm.sample(recorder("guided"), torch.zeros(1, 1, 2, 2), num_steps=steps, solver=solver,
               unguided=recorder("plain"), interval=(lo, hi))
    rho, smin, smax = 7.0, 0.002, 80.0
    levels = [(smax ** (1 / rho) + i / (steps - 1) * (smin ** (1 / rho) - smax ** (1 / rho))) ** rho for i in range(steps)]
    want = []
    for i, t in enumerate(levels):
        tag = "guided" if lo <= t <= hi else "plain"
        want.append(tag)
        if solver == "heun" and i < steps - 1:
            want.append(tag)
    assert [tag for tag, _ in calls] == want


def test_guidance_interval_through_sample_run_changes_only_the_guided_images_and_is_recorded(tmp_path):
    from test_nets import _snapshot

    snap = tmp_path / "s.safetensors"
    d = _snapshot(snap, {"channels": 8, "channel_mult": [1, 2]}, label_dropout=0.1)
    with torch.no_grad():  # rewrite the snapshot with random weights, so every path shows in the pixels
        from diffrelay.training import checkpoint
        net, meta = checkpoint.load_snapshot(snap, model_cfg=d["model"])
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        checkpoint.save_snapshot(snap, net.state_dict(), net.state_dict(), meta)
    s = settings(num_images=8, guidance=2.0)
    full = sample.run(snap, tmp_path / "full", s, model_cfg=d["model"])
    part = sample.run(snap, tmp_path / "part", dataclasses.replace(s, guidance_interval=(0.3, 3.0)),
                      model_cfg=d["model"])
    sample.run(snap, tmp_path / "every", dataclasses.replace(s, guidance_interval=(0.0, 1000.0)),
               model_cfg=d["model"])
    images = {k: {n: b for n, b in folder_bytes(tmp_path / k).items() if n != "grid.png"}
              for k in ("full", "part", "every")}
    assert images["every"] == images["full"] and images["part"] != images["full"]
    assert "guidance_interval" not in full and part["guidance_interval"] == [0.3, 3.0]


@pytest.mark.parametrize("interval, words", [([3.0, 1.0], "lo < hi"), ([100.0, 200.0], "meet the schedule"),
                                             ([0.0, 0.001], "meet the schedule")])
def test_bad_guidance_interval_is_one_line_at_parse_time(interval, words):
    from diffrelay import config
    from diffrelay.errors import UserError

    with pytest.raises(UserError, match=f"sample.guidance_interval=.*{words}"):
        config.validate({"sample": {"guidance_interval": interval}})
