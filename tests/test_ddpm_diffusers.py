"""model.ddpm (issue 40, item 2): the discrete-time objective as diffusers trains Stable Diffusion and its kin.
Defaults keep every ddpm run what it was; scaled_linear and zero-terminal-SNR schedules are diffusers'; the samplers
read a v- or x0-prediction as the equivalent noise prediction; the offset noise is the loader's draw; bad values
are one line; benchmarks/checks/check_diffusers_objective.py passes against the installed diffusers and fails when a
stand-in training script's min-SNR division is dropped."""

import sys
from pathlib import Path

import pytest
import torch

from conftest import benchmark
from diffrelay import config
from diffrelay.errors import UserError
from diffrelay.objectives import ddpm
from diffrelay.objectives.ddpm_options import Options
from test_loader import write_prepared

REPO = Path(__file__).resolve().parents[1]
SD = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)


SAMPLE = {"solver": "ddim", "steps": 10}


def ddpm_cfg(**ddpm_keys) -> dict:
    model = {"objective": "ddpm", "arch": "dit", "kwargs": {"time_scale": 1}, "ddpm": ddpm_keys}
    return {"model": model, "sample": SAMPLE}


def test_defaults_keep_the_run_and_the_keys_change_it():
    base = config.trajectory_hash(config.Config(config.validate(ddpm_cfg())))  # model.ddpm: {} written
    plain = config.validate({"model": {"objective": "ddpm", "arch": "dit", "kwargs": {"time_scale": 1}},
                             "sample": SAMPLE})
    assert plain["model"]["ddpm"] is None  # no section filled in: snapshots and hashes as before
    assert config.trajectory_hash(config.Config(plain)) == base
    written = config.validate(ddpm_cfg(beta_schedule="linear", prediction_type="epsilon", snr_gamma=None))
    assert config.trajectory_hash(config.Config(written)) == base  # the defaults written out: the same run
    v = config.validate(ddpm_cfg(prediction_type="v_prediction"))
    assert v["model"]["ddpm"]["beta_end"] == 0.02  # the rest of the section filled
    assert config.trajectory(config.Config(v))["model"]["ddpm"] == {"prediction_type": "v_prediction"}
    assert config.trajectory_hash(config.Config(v)) != base


@pytest.mark.parametrize("model, fragment", [
    (ddpm_cfg(snr_gamma=-1)["model"], "model.ddpm.snr_gamma=-1: must be greater than 0"),
    (ddpm_cfg(beta_start=0.02, beta_end=0.01)["model"], "model.ddpm.beta_end=0.01: must be greater than"),
    (ddpm_cfg(rescale_betas_zero_snr=True)["model"], "set model.ddpm.prediction_type: v_prediction"),
    ({"objective": "flow", "ddpm": {"noise_offset": 0.1}}, "model.ddpm.noise_offset=0.1: applies to model.objective"),
    (ddpm_cfg(prediction_type="sample")["model"] | {"kwargs": {"time_scale": 1, "out_channels": 6}},
     "model.kwargs.out_channels=6: DiT's learned sigma"),
])
def test_bad_values_are_one_line_naming_the_key(model, fragment):
    with pytest.raises(UserError) as e:
        config.validate({"model": model, "sample": SAMPLE if model.get("objective") == "ddpm" else {}}, "run.yaml")
    assert str(e.value).startswith("run.yaml: ") and fragment in str(e.value) and "\n" not in str(e.value)


def test_schedules_are_diffusers_ones():
    from diffusers import DDPMScheduler

    assert torch.equal(ddpm.betas(), ddpm.betas(Options()))  # DiT's, bit for bit (the default argument)
    for zsnr in (False, True):
        o = Options(**SD, rescale_betas_zero_snr=zsnr, prediction_type="v_prediction")
        ref = DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                            rescale_betas_zero_snr=zsnr)
        assert (ddpm.alphas_cumprod(o) - ref.alphas_cumprod.double()).abs().max() < 5e-6  # theirs is float32
    abar = ddpm.alphas_cumprod(Options(**SD, rescale_betas_zero_snr=True, prediction_type="v_prediction"))
    assert abar[-1] == 0 and abs(abar[0] - ddpm.alphas_cumprod(Options(**SD))[0]) < 1e-15


def _eps_net(x, t, labels=None):
    """A deterministic stand-in for a noise-predicting network."""
    return torch.tanh(x) * 0.7 + torch.cos(t.double() / 97).reshape(-1, 1, 1, 1).to(x.dtype) * 0.3


def _as(prediction, options, eps_net):
    """eps_net's prediction rewritten as a v- or x0-predicting network (the same model)."""
    abar = ddpm.alphas_cumprod(options)

    def net(x, t, labels=None):
        a = abar[t.long()].reshape(-1, 1, 1, 1).to(x.dtype)
        eps = eps_net(x, t)
        x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
        return a.sqrt() * eps - (1 - a).sqrt() * x0 if prediction == "v_prediction" else x0

    return net


@pytest.mark.parametrize("solver, eta", [("ddpm", 0.0), ("ddim", 0.0), ("ddim", 0.5)])
def test_a_v_or_x0_network_samples_as_the_equivalent_noise_network(solver, eta):
    z = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    draws = torch.randn(40, 2, 3, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    def run(net, options):
        it = iter(draws)
        return ddpm.sample(net, z, None, 12, solver, ddpm.SamplerSettings(eta=eta), noise=lambda shape: next(it),
                           options=options)

    eps = run(_eps_net, Options(**SD))
    for kind in ("v_prediction", "sample"):
        o = Options(**SD, prediction_type=kind)
        # equal up to the float32 rounding of the network's output (the samplers call it in float32)
        assert (run(_as(kind, o, _eps_net), o) - eps).abs().max() / eps.abs().max() < 1e-6, kind


def test_zero_terminal_snr_samples_from_pure_noise_with_v_as_with_x0():
    o_v = Options(**SD, rescale_betas_zero_snr=True, prediction_type="v_prediction")
    o_x = Options(**SD, rescale_betas_zero_snr=True, prediction_type="sample")
    abar = ddpm.alphas_cumprod(o_v)

    def v_net(x, t, labels=None):
        return torch.tanh(x) * 0.5 + 0.1

    def x0_net(x, t, labels=None):  # the same model: x0 = sqrt(abar) x - sqrt(1 - abar) v, finite at abar = 0
        a = abar[t.long()].reshape(-1, 1, 1, 1).to(x.dtype)
        return a.sqrt() * x - (1 - a).sqrt() * v_net(x, t)

    z = torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(2))
    for solver in ("ddim", "ddpm"):
        draws = iter(torch.randn(20, 2, 3, 4, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
        a = ddpm.sample(v_net, z, None, 8, solver, noise=lambda s: next(draws), options=o_v)
        draws = iter(torch.randn(20, 2, 3, 4, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
        b = ddpm.sample(x0_net, z, None, 8, solver, noise=lambda s: next(draws), options=o_x)
        assert torch.isfinite(a).all() and (a - b).abs().max() < 1e-6, solver


def test_the_loss_targets_and_weights_as_min_snr_says():
    x0 = torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    noise = torch.randn(4, 3, 4, 4, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    t = torch.tensor([0, 10, 500, 999])
    rnd = torch.special.ndtri((t.double() + 0.5) / ddpm.T)
    zero = lambda x, t, labels: torch.zeros_like(x)  # noqa: E731 -- the loss is then the target's mean square
    for kind in ("epsilon", "v_prediction", "sample"):
        o = Options(**SD, prediction_type=kind, snr_gamma=5.0)
        a = ddpm.alphas_cumprod(o)[t].reshape(-1, 1, 1, 1)
        want = {"epsilon": noise, "sample": x0, "v_prediction": a.sqrt() * noise - (1 - a).sqrt() * x0}[kind]
        snr = (a / (1 - a)).flatten()
        w = torch.minimum(snr, torch.full_like(snr, 5.0))
        w = w / snr if kind == "epsilon" else w / (snr + 1) if kind == "v_prediction" else w
        got = ddpm.loss(zero, x0, None, rnd, noise, o)
        assert abs(float(got) - float(((want**2).mean(dim=(1, 2, 3)) * w).mean())) < 1e-12, kind
    learned = lambda x, t, labels: torch.cat([x, x], 1)  # noqa: E731 -- 2C channels: learned sigma
    # L_vlb is defined for epsilon and v (HunyuanDiT trains its learned sigma with v), not for x0-prediction
    with pytest.raises(UserError, match="prediction_type epsilon and v_prediction, not sample"):
        ddpm.loss(learned, x0, None, rnd, noise, Options(prediction_type="sample"))
    assert torch.isfinite(ddpm.loss(learned, x0, None, rnd, noise, Options(prediction_type="v_prediction")))


def test_noise_offset_is_one_loader_draw_per_sample_and_channel(tmp_path):
    from diffrelay.data.loader import BatchMaker

    data = write_prepared(tmp_path / "d", n=8)
    idx = torch.arange(8).numpy()
    plain = BatchMaker(data, 0, 8, rank=0, world=1, grad_accum=1, device="cpu").make(3, idx).rounds[0][3]
    ranks = [BatchMaker(data, 0, 8, rank=r, world=2, grad_accum=1, device="cpu", noise_offset=0.1).make(3, idx)
             for r in range(2)]
    offset = torch.empty_like(plain)
    for r, b in enumerate(ranks):
        offset[r::2] = b.rounds[0][3]
    diff = offset - plain  # the same base noise, plus 0.1 x one normal per (sample, channel)
    assert torch.allclose(diff, diff[:, :, :1, :1].expand_as(diff), atol=1e-7)
    assert 0.01 < float(diff.abs().mean()) < 0.3


def _check_script():
    return benchmark("check_diffusers_objective")


# The loss of Hang et al. 2023 (min-SNR-gamma) and of offset noise, restated from the papers in the shape of
# diffusers' training loop (its own train_text_to_image.py is not installed with the package).
STAND_IN = '''
for step, batch in enumerate(train_dataloader):
    with accelerator.accumulate(unet):
        latents = vae.encode(batch["pixel_values"])
        noise = torch.randn_like(latents)
        if args.noise_offset:
            noise = noise + args.noise_offset * torch.randn((latents.shape[0], latents.shape[1], 1, 1))
        timesteps = torch.randint(0, 1000, (latents.shape[0],))
        noisy_latents = noise_scheduler.add_noise(latents, noise, timesteps)
        if noise_scheduler.config.prediction_type == "epsilon":
            target = noise
        elif noise_scheduler.config.prediction_type == "v_prediction":
            target = noise_scheduler.get_velocity(latents, noise, timesteps)
        else:
            raise ValueError("no such target")
        model_pred = unet(noisy_latents, timesteps, None)[0]
        loss = ((model_pred.float() - target.float()) ** 2).mean(dim=(1, 2, 3))
        if args.snr_gamma is not None:
            snr = compute_snr(noise_scheduler, timesteps)
            weight = snr.clamp(max=args.snr_gamma)
            if noise_scheduler.config.prediction_type == "epsilon":
                weight = weight / snr
            elif noise_scheduler.config.prediction_type == "v_prediction":
                weight = weight / (snr + 1)
            loss = loss * weight
        loss = loss.mean()
'''


@pytest.mark.slow  # 4.2 s, nearly all of it importing diffusers.training_utils (compute_snr) for the first time
def test_check_against_diffusers_passes_and_fails_when_the_min_snr_division_goes(tmp_path, monkeypatch, capsys):
    import diffusers

    check = _check_script()
    site = Path(diffusers.__file__).resolve().parents[1]  # the installed package's folder
    scripts = tmp_path / "scripts"
    scripts.mkdir()

    def run(text):
        (scripts / "train_text_to_image.py").write_text(text)
        monkeypatch.setattr(sys, "argv", ["check", "--diffusers-src", str(site), "--scripts", str(scripts),
                                          "--out", str(tmp_path / "out.json")])
        with pytest.raises(SystemExit) as e:
            check.main()
            raise SystemExit(0)
        return e.value.code, [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]

    assert run(STAND_IN) == (0, [])
    code, fails = run(STAND_IN.replace("weight = weight / snr\n", "weight = weight\n"))
    assert code == 1 and fails and all(line.startswith("FAIL loss/train_text_to_image/epsilon-gamma5.0")
                                       for line in fails), fails
