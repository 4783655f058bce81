"""benchmarks/checks/check_diffusers_flux_loss.py: train.flow (uniform times, shift 1) with the FLUX network of
families/flux.py against the loss lines of diffusers' train_dreambooth_lora_flux.py. The script is not installed
with diffusers, so the stand-in below restates what its lines do (get_sigmas; in the accumulate block the VAE's
scale factor, the packed grid's ids, the time rounded to the scheduler's table, x_t = (1 - sigma) x + sigma noise
packed 2 x 2 into tokens, the guidance input of a guidance-distilled transformer, its time input sigma, the
prediction unpacked, the velocity loss, and with --with_prior_preservation the class half's loss added at
--prior_loss_weight); the check passes against it with the installed diffusers and fails when one line changes."""

import sys
from pathlib import Path

import pytest

from conftest import benchmark

STAND_IN = '''
def main(args):
    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        table = noise_scheduler_copy.sigmas.to(device=accelerator.device, dtype=dtype)
        steps = noise_scheduler_copy.timesteps.to(accelerator.device)
        rows = [int(torch.argwhere(steps == t)) for t in timesteps.to(accelerator.device)]
        return table[rows].reshape(-1, *[1] * (n_dim - 1))

    for step, batch in enumerate(train_dataloader):
        with accelerator.accumulate([transformer]):
            model_input = batch["latents"].to(dtype=weight_dtype)
            vae_scale_factor = 2 ** (len(vae_config_block_out_channels) - 1)
            latent_image_ids = FluxPipeline._prepare_latent_image_ids(
                model_input.shape[0], model_input.shape[2] // 2, model_input.shape[3] // 2, accelerator.device,
                weight_dtype)
            noise = torch.randn_like(model_input)
            b, c, h, w = model_input.shape
            u = compute_density_for_timestep_sampling(weighting_scheme=args.weighting_scheme, batch_size=b,
                                                      logit_mean=args.logit_mean, logit_std=args.logit_std,
                                                      mode_scale=args.mode_scale)
            timesteps = noise_scheduler_copy.timesteps[(u * noise_scheduler_copy.config.num_train_timesteps).long()]
            sigmas = get_sigmas(timesteps.to(device=model_input.device), n_dim=4, dtype=model_input.dtype)
            noisy_model_input = sigmas * noise + (1.0 - sigmas) * model_input
            tokens = FluxPipeline._pack_latents(noisy_model_input, b, c, h, w)
            guidance = None
            if unwrap_model(transformer).config.guidance_embeds:
                guidance = torch.full((b,), float(args.guidance_scale), device=accelerator.device)
            model_pred = transformer(hidden_states=tokens, timestep=timesteps / 1000, guidance=guidance,
                                     pooled_projections=pooled_prompt_embeds, encoder_hidden_states=prompt_embeds,
                                     txt_ids=text_ids, img_ids=latent_image_ids, return_dict=False)[0]
            model_pred = FluxPipeline._unpack_latents(model_pred, height=h * vae_scale_factor,
                                                      width=w * vae_scale_factor, vae_scale_factor=vae_scale_factor)
            weighting = compute_loss_weighting_for_sd3(weighting_scheme=args.weighting_scheme, sigmas=sigmas)
            target = noise - model_input
            if args.with_prior_preservation:
                model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
                target, target_prior = torch.chunk(target, 2, dim=0)
                weighting, weighting_prior = torch.chunk(weighting, 2, dim=0)
                prior = (weighting_prior.float() * (model_pred_prior.float() - target_prior.float()) ** 2)
                prior_loss = prior.reshape(target_prior.shape[0], -1).mean(1).mean()
            loss = ((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1))
            loss = loss.mean(1)
            loss = loss.mean()
            if args.with_prior_preservation:
                loss = loss + args.prior_loss_weight * prior_loss
            accelerator.backward(loss)
'''


def change(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old  # one line changed, nothing else
    return text.replace(old, new)


def test_the_check_passes_and_fails_when_the_guidance_or_the_target_changes(tmp_path, monkeypatch, capsys):
    import diffusers

    check = benchmark("check_diffusers_flux_loss")
    site = Path(diffusers.__file__).resolve().parents[1]

    def run(text):
        (tmp_path / "train_dreambooth_lora_flux.py").write_text(text)
        monkeypatch.setattr(sys, "argv", ["check", "--diffusers-src", str(site), "--script",
                                          str(tmp_path / "train_dreambooth_lora_flux.py"), "--out",
                                          str(tmp_path / "out.json")])
        with pytest.raises(SystemExit) as e:
            check.main()
            raise SystemExit(0)
        return e.value.code, [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]

    assert run(STAND_IN) == (0, [])
    # The guidance input of dev (schnell takes none): the guidance figure and dev's loss.
    code, fails = run(change(STAND_IN, "float(args.guidance_scale)", "float(args.guidance_scale) - 0.5"))
    assert code == 1 and {line.split(":")[0] for line in fails} == {
        "FAIL guidance/dev", "FAIL loss/dev", "FAIL guidance/dev-prior", "FAIL loss/dev-prior"}, fails
    # The velocity's sign: the loss of both cases, nothing the transformer saw.
    code, fails = run(change(STAND_IN, "target = noise - model_input", "target = model_input - noise"))
    assert code == 1 and {line.split(":")[0] for line in fails} == {"FAIL loss/dev", "FAIL loss/schnell",
                                                                    "FAIL loss/dev-prior"}, fails
    # Prior preservation's weight dropped (0.7 in the check): the prior case's loss alone.
    code, fails = run(change(STAND_IN, "loss + args.prior_loss_weight * prior_loss", "loss + prior_loss"))
    assert code == 1 and {line.split(":")[0] for line in fails} == {"FAIL loss/dev-prior"}, fails
    # Rows and columns swapped in the packing: the tokens (x_t) and the loss.
    code, fails = run(change(STAND_IN, "noisy_model_input, b, c, h, w)", "noisy_model_input, b, c, w, h)"))
    assert code == 1 and {"FAIL x_t/dev", "FAIL x_t/schnell"} <= {line.split(":")[0] for line in fails}, fails
