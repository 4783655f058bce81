"""DDPM noise prediction (model.objective ddpm): the schedule, DiT's respacing, the loss with learned sigma,
the ddpm and ddim samplers, guidance of some channels, resume, seeds and the settings' checks.

The references restate the formulas of the papers per image in float64 with Python floats (Ho et al. 2020
eq. 4, 7, 11; Nichol & Dhariwal 2021 eq. 13, 15 and the discretised decoder; Song et al. 2021 eq. 12), not
from the package; benchmarks/checks/check_ddpm_equivalence.py compares the package with DiT's own diffusion code."""

import json
import math

import pytest
import torch

from conftest import run_cli
from diffrelay import config
from diffrelay.errors import UserError
from diffrelay.objectives import ddpm
from diffrelay.sampling import guidance, sample
from test_flow import noisy_snapshot
from test_sample import folder_bytes, sample_args, settings
from test_train import assert_two_segments_equal_one_run


def abar(t: int) -> float:
    """prod_{s <= t} (1 - beta_s), beta linear from 1e-4 to 0.02 over 1000 steps."""
    out = 1.0
    for s in range(t + 1):
        out *= 1 - (1e-4 + (0.02 - 1e-4) * s / 999)
    return out


def test_the_schedule_is_dits_linear_betas():
    a = ddpm.alphas_cumprod()
    for t in (0, 1, 17, 500, 999):
        assert abs(float(a[t]) - abar(t)) < 1e-12
    assert abs(float(ddpm.sigma_of(999)) - math.sqrt((1 - abar(999)) / abar(999))) < 1e-9


@pytest.mark.parametrize("n", [1, 2, 25, 50, 250, 1000])
def test_respacing_spreads_the_steps_evenly_over_the_chain(n):
    got = ddpm.respaced(n)
    assert len(got) == n and got[0] == 0 and (n == 1 or got[-1] == 999)
    if n == 25:  # 4 x 999 / 24 = 166.5 exactly: DiT's round() takes the even neighbour
        assert got[4] == 166
    want = [0] if n == 1 else [int(math.floor(i * 999 / (n - 1) + 0.5)) for i in range(n)]
    # Python rounds halves to even: the two may differ by one at an exact half, nowhere else.
    assert all(abs(a - b) <= (1 if (i * 999 / max(n - 1, 1)) % 1 == 0.5 else 0) for i, (a, b) in enumerate(zip(got, want)))


# ---------------------------------------------------------------------------------------------
# Training


def toy(learned: bool):
    """An eps network with a closed form: eps = 0.3 x + 0.001 t, and v = tanh(x) for the learned variance."""

    class Net(torch.nn.Module):
        out_channels = 6 if learned else 3

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.tensor(0.3, dtype=torch.float64))
            self.u = torch.nn.Parameter(torch.tensor(1.0, dtype=torch.float64))

        def forward_all(self, x, t, labels=None):
            eps = self.w * x + 0.001 * t.reshape(-1, 1, 1, 1)
            return torch.cat([eps, torch.tanh(self.u * x)], 1) if learned else eps

        forward = forward_all

    return ddpm.EpsModel(Net(), 3)


def cdf(x):
    return 0.5 * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def reference_loss(x0, eps, t, learned, u=1.0):
    """One image's loss, element by element (lists of floats)."""
    a, a_prev = abar(t), abar(t - 1) if t > 0 else 1.0
    beta = 1 - a / a_prev
    var_small = lambda s: (1 - abar(s) / abar(s - 1)) * (1 - abar(s - 1)) / (1 - abar(s))  # noqa: E731, s >= 1
    total = 0.0
    for x, e in zip(x0, eps):
        xt = math.sqrt(a) * x + math.sqrt(1 - a) * e
        e_pred = 0.3 * xt + 0.001 * t
        term = (e - e_pred) ** 2
        if learned:
            x0_pred = (xt - math.sqrt(1 - a) * e_pred) / math.sqrt(a)
            c0, ct = beta * math.sqrt(a_prev) / (1 - a), (1 - a_prev) * math.sqrt(1 - beta) / (1 - a)
            mean, true_mean = c0 * x0_pred + ct * xt, c0 * x + ct * xt
            small = math.log(var_small(max(t, 1)))
            frac = (math.tanh(u * xt) + 1) / 2
            logv = frac * math.log(beta) + (1 - frac) * small
            if t == 0:
                s = math.exp(-0.5 * logv)
                up, lo = cdf(s * (x - mean + 1 / 255)), cdf(s * (x - mean - 1 / 255))
                p = up if x < -0.999 else 1 - lo if x > 0.999 else up - lo
                vb = -math.log(max(p, 1e-12))
            else:
                vb = 0.5 * (-1 + logv - small + math.exp(small - logv) + (true_mean - mean) ** 2 * math.exp(-logv))
            term += vb / math.log(2)
        total += term
    return total / len(x0)


@pytest.mark.parametrize("learned", [False, True])
def test_loss_is_dits_noise_mse_and_vlb_restated(learned):
    g = torch.Generator().manual_seed(0)
    x0 = torch.rand(4, 3, 2, 2, generator=g, dtype=torch.float64) * 2 - 1
    x0[0, 0, 0, 0], x0[0, 1, 0, 0] = -1.0, 1.0  # the decoder's edge bins, in the image drawn at t = 0
    eps = torch.randn(4, 3, 2, 2, generator=g, dtype=torch.float64)
    ts = [0, 1, 500, 999]
    rnd = torch.special.ndtri((torch.tensor(ts, dtype=torch.float64) + 0.5) / 1000)
    got = ddpm.loss(toy(learned).double(), x0, None, rnd, eps)
    want = sum(reference_loss(x0[i].flatten().tolist(), eps[i].flatten().tolist(), t, learned)
               for i, t in enumerate(ts)) / 4
    assert abs(got.item() - want) < 1e-9 * max(1, abs(want))


def test_timesteps_are_uniform_over_the_chain():
    n = torch.randn(200_000, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    seen = {}

    def net(x, t, labels):
        seen["t"] = t
        return torch.zeros_like(x)

    ddpm.loss(net, torch.zeros(len(n), 1, 1, 1), None, n, torch.zeros(len(n), 1, 1, 1))
    counts = torch.bincount(seen["t"], minlength=1000)
    assert seen["t"].min() == 0 and seen["t"].max() == 999 and counts.float().std() < 3 * math.sqrt(200)


def test_the_vlb_trains_the_variance_and_not_the_mean():
    net = toy(True)
    x0, eps = torch.rand(2, 3, 2, 2, dtype=torch.float64) - 0.5, torch.randn(2, 3, 2, 2, dtype=torch.float64)
    rnd = torch.special.ndtri(torch.tensor([0.2005, 0.7005], dtype=torch.float64))
    ddpm.loss(net, x0, None, rnd, eps).backward()
    mse_only = toy(False)
    ddpm.loss(mse_only, x0, None, rnd, eps).backward()
    # eps's weight sees the same gradient with or without the variance term: the mean is stopped in L_vlb ...
    assert torch.allclose(net.net.w.grad, mse_only.net.w.grad, rtol=1e-9, atol=0)
    # ... and the variance's parameter gets the L_vlb gradient, here by finite differences of the restatement.
    def restated(u):
        total = 0.0
        for i, t in enumerate((200, 700)):
            x, e = x0[i].flatten().tolist(), eps[i].flatten().tolist()
            with_vlb = reference_loss(x, e, t, True, u)
            total += with_vlb - reference_loss(x, e, t, False)
        return total / 2
    numeric = (restated(1 + 1e-6) - restated(1 - 1e-6)) / 2e-6
    assert abs(numeric) > 1e-7 and abs(net.net.u.grad.item() - numeric) < 1e-4 * abs(numeric)


# ---------------------------------------------------------------------------------------------
# Samplers


def reference_sample(z, noises, steps, solver, learned, eta=0.0):
    """One image (list of floats) through the respaced chain, per the papers' update rules."""
    ts = ddpm.respaced(steps)
    x = list(z)
    for i in reversed(range(len(ts))):
        a = abar(ts[i])
        a_prev = abar(ts[i - 1]) if i > 0 else 1.0
        beta = 1 - a / a_prev
        e = [0.3 * v + 0.001 * ts[i] for v in x]
        x0 = [(v - math.sqrt(1 - a) * ev) / math.sqrt(a) for v, ev in zip(x, e)]
        if solver == "ddpm":
            mean = [beta * math.sqrt(a_prev) / (1 - a) * p + (1 - a_prev) * math.sqrt(1 - beta) / (1 - a) * v
                    for p, v in zip(x0, x)]
            if i == 0:
                x = mean
                continue
            small = math.log(beta * (1 - a_prev) / (1 - a))  # beta~ of the chain's step i (i > 0 here)
            noise = noises.pop(0)
            out = []
            for m, v, n in zip(mean, x, noise):
                frac = (math.tanh(v) + 1) / 2 if learned else 1.0
                logv = frac * math.log(beta) + (1 - frac) * small
                out.append(m + math.exp(0.5 * logv) * n)
            x = out
        else:
            sd = eta * math.sqrt((1 - a_prev) / (1 - a)) * math.sqrt(1 - a / a_prev)
            x = [p * math.sqrt(a_prev) + math.sqrt(1 - a_prev - sd**2) * ev for p, ev in zip(x0, e)]
            if i > 0 and eta > 0:
                x = [v + sd * n for v, n in zip(x, noises.pop(0))]
    return x


@pytest.mark.parametrize("solver, learned, eta", [("ddpm", True, 0.0), ("ddpm", False, 0.0), ("ddim", True, 0.0),
                                                  ("ddim", False, 1.0)])
def test_samplers_are_the_update_rules_restated(solver, learned, eta):
    steps = 6
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2, 3, 2, 2, generator=g)
    draws = [torch.randn(2, 3, 2, 2, generator=g, dtype=torch.float64) for _ in range(steps)]
    it = iter(draws)
    net = toy(learned)
    got = ddpm.sample(net, z, None, steps, solver, ddpm.SamplerSettings(eta=eta), noise=lambda shape: next(it))
    for b in range(2):
        want = reference_sample(z[b].flatten().double().tolist(), [d[b].flatten().tolist() for d in draws], steps,
                                solver, learned, eta)
        assert all(abs(u - v) < 1e-5 * (1 + abs(v)) for u, v in zip(got[b].flatten().tolist(), want))


def test_guidance_of_some_channels_keeps_the_rest_conditional():
    def denoise(x, t, labels):
        return x * (1 + labels.reshape(-1, 1, 1, 1).float())

    x, t, labels = torch.ones(2, 8, 1, 1), torch.tensor([5, 5]), torch.tensor([1, 2])
    out = guidance.guided(denoise, 3.0, null=0, channels=3)(x, t, labels)
    cond, uncond = denoise(x, t, labels), x
    assert torch.equal(out[:, :3], (uncond + 3 * (cond - uncond))[:, :3]) and torch.equal(out[:, 3:], cond[:, 3:])
    assert torch.equal(guidance.guided(denoise, 3.0, null=0)(x, t, labels), uncond + 3 * (cond - uncond))


# ---------------------------------------------------------------------------------------------
# Through the processes: seeds, resume, identity and checks

DIT = {"arch": "dit", "objective": "ddpm", "class_conditional": True,
       "kwargs": {"patch": 4, "depth": 2, "hidden_size": 32, "num_heads": 2, "out_channels": 6, "time_scale": 1}}


def ddpm_snapshot(path):
    return noisy_snapshot(path, {"data": {"resolution": 16}, "model": DIT, "train": {"label_dropout": 0.1},
                                 "sample": {"solver": "ddpm"}})


def test_ddpm_pngs_are_byte_identical_for_any_process_count_and_batch_size(tmp_path):
    snap = ddpm_snapshot(tmp_path / "step_0000040.safetensors")
    one, two = tmp_path / "one", tmp_path / "two"
    run_cli(*sample_args(snap, one, "--num-images", 20, "--steps", 5, "--solver", "ddpm", "--batch-size", 8,
                         "--guidance", 1.5))
    run_cli("torchrun", "--standalone", "--nproc-per-node", 2, "-m", "diffrelay",
            *sample_args(snap, two, "--num-images", 20, "--steps", 5, "--solver", "ddpm", "--batch-size", 3,
                         "--guidance", 1.5))
    ref = folder_bytes(one)
    assert len(ref) == 21 and folder_bytes(two) == ref
    sample.run(snap, tmp_path / "ddim", settings(num_images=20, steps=5, solver="ddim", guidance=1.5))
    assert folder_bytes(tmp_path / "ddim")["000000.png"] != ref["000000.png"]
    # The ddpm flags of a hand-run (no --config): guiding fewer channels and DDIM's eta change the pixels.
    for flags in (["--solver", "ddpm", "--ddpm-guided-channels", 2], ["--solver", "ddim", "--ddpm-eta", 0.5]):
        out = tmp_path / str(flags[-1])
        run_cli(*sample_args(snap, out, "--num-images", 4, "--steps", 5, "--batch-size", 8, "--guidance", 1.5, *flags))
        assert folder_bytes(out)["000000.png"] != ref["000000.png"]
        assert json.loads((out / "manifest.json").read_text())["ddpm"] == {flags[-2][7:].replace("-", "_"): flags[-1]}
    assert json.loads((one / "manifest.json").read_text())["solver"] == "ddpm"


def test_sampler_mistakes_against_the_snapshot_are_one_line(tmp_path):
    from test_sample import make_snapshot

    snap = ddpm_snapshot(tmp_path / "d.safetensors")
    for s, words in [(settings(solver="heun"), "--solver heun: .* model.objective ddpm"),
                     (settings(solver="ddpm", steps=1001), "--steps 1001: .* at most 1000"),
                     (settings(solver="ddpm", ddpm=ddpm.SamplerSettings(guided_channels=4)), "guided_channels=4")]:
        with pytest.raises(UserError, match=words):
            sample.run(snap, tmp_path / "a", s)
    with pytest.raises(UserError, match="--solver ddim: .* model.objective edm"):
        sample.run(make_snapshot(tmp_path / "e.safetensors"), tmp_path / "a", settings(solver="ddim"))
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("raw, words", [
    ({"model": {"objective": "ddpm"}}, ["sample.solver=heun", "sample.solver: ddpm"]),
    ({"sample": {"solver": "ddim"}}, ["sample.solver=ddim", "model.objective: ddpm"]),
    ({"model": {"objective": "ddpm"}, "sample": {"solver": "ddpm", "steps": 2000}}, ["sample.steps=2000"]),
    ({"sample": {"ddpm": {"eta": 1.0}}}, ["sample.ddpm", "model.objective: edm"]),
    ({"model": {"objective": "ddpm"}, "sample": {"solver": "ddpm", "edm": {"S_churn": 5}}}, ["sample.edm"]),
    ({"model": {"objective": "ddpm"}, "sample": {"solver": "ddpm", "flow": {"shift": 3}}}, ["sample.flow"]),
    ({"model": {"objective": "ddpm"}, "sample": {"solver": "ddpm", "ddpm": {"eta": 0.5}}}, ["sample.ddpm.eta=0.5", "ddim"]),
    ({"model": DIT | {"kwargs": DIT["kwargs"] | {"time_scale": 1000}}, "sample": {"solver": "ddpm"}},
     ["model.kwargs.time_scale", "time_scale: 1"]),
    ({"model": {"objective": "ddpm", "class_conditional": True}, "train": {"label_dropout": 0.1},
      "sample": {"solver": "ddpm", "guidance": 2, "guidance_interval": [200, 300]}}, ["sample.guidance_interval"]),
])
def test_ddpm_mistakes_are_one_line_at_parse_time(raw, words):
    with pytest.raises(UserError) as err:
        config.validate(raw)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


def test_ddpm_runs_have_their_own_identity():
    edm_hash = config.trajectory_hash(config.Config(config.validate({})))
    d = config.Config(config.validate({"model": {"objective": "ddpm"}, "sample": {"solver": "ddpm"}}))
    assert config.trajectory(d)["model"]["objective"] == "ddpm" and config.trajectory_hash(d) != edm_hash
    # EDM's noise-level keys and flow's draws do not change a ddpm run
    same = config.validate({"model": {"objective": "ddpm"}, "sample": {"solver": "ddpm"},
                            "train": {"p_mean": 0.3, "flow": {"shift": 2.0}}})
    assert config.trajectory_hash(config.Config(same)) == config.trajectory_hash(d)


def test_ddpm_training_in_two_segments_matches_one_run_bitwise(tmp_path):
    base = {
        "run": {"name": "r", "device": "cpu"},
        "data": {"kind": "shapes", "resolution": 16, "count": 20, "seed": 0},
        "model": DIT,
        "train": {"total_steps": 4, "segment_steps": 2, "batch_size": 8, "lr": 0.002, "warmup_steps": 1,
                  "log_every": 1, "label_dropout": 0.1},
        "sample": {"solver": "ddpm"},
    }
    losses = assert_two_segments_equal_one_run(tmp_path, base)
    assert len(losses) == 4 and all(math.isfinite(v) and v > 0 for v in losses)
