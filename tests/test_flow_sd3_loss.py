"""benchmarks/checks/check_diffusers_sd3_loss.py: train.flow (lognormal times, precondition_outputs) against the loss
lines of diffusers' train_dreambooth_lora_sd3.py. The script is not installed with diffusers, so the stand-in below
restates its lines (get_sigmas and the accumulate block, SD3 paper's rectified-flow loss with the x0
preconditioning of EDM's section 5); the check passes against it with the installed diffusers and fails when one
line changes."""

import sys
from pathlib import Path

import pytest

from conftest import benchmark

STAND_IN = '''
def main(args):
    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):
        sigmas = noise_scheduler_copy.sigmas.to(device=accelerator.device, dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps.to(accelerator.device)
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    for step, batch in enumerate(train_dataloader):
        with accelerator.accumulate(models_to_accumulate):
            model_input = vae.encode(batch["pixel_values"])
            noise = torch.randn_like(model_input)
            bsz = model_input.shape[0]
            u = compute_density_for_timestep_sampling(weighting_scheme=args.weighting_scheme, batch_size=bsz,
                                                      logit_mean=args.logit_mean, logit_std=args.logit_std,
                                                      mode_scale=args.mode_scale)
            indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
            timesteps = noise_scheduler_copy.timesteps[indices].to(device=model_input.device)
            sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
            noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise
            model_pred = transformer(hidden_states=noisy_model_input, timestep=timesteps,
                                     encoder_hidden_states=prompt_embeds, pooled_projections=pooled_prompt_embeds,
                                     return_dict=False)[0]
            if args.precondition_outputs:
                model_pred = model_pred * (-sigmas) + noisy_model_input
            weighting = compute_loss_weighting_for_sd3(weighting_scheme=args.weighting_scheme, sigmas=sigmas)
            if args.precondition_outputs:
                target = model_input
            else:
                target = noise - model_input
            loss = torch.mean((weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(
                target.shape[0], -1), 1)
            loss = loss.mean()
            accelerator.backward(loss)
'''


def test_the_check_passes_and_fails_when_the_x0_preconditioning_changes(tmp_path, monkeypatch, capsys):
    import diffusers

    check = benchmark("check_diffusers_sd3_loss")
    site = Path(diffusers.__file__).resolve().parents[1]

    def run(text):
        (tmp_path / "train_dreambooth_lora_sd3.py").write_text(text)
        monkeypatch.setattr(sys, "argv", ["check", "--diffusers-src", str(site), "--script",
                                          str(tmp_path / "train_dreambooth_lora_sd3.py"), "--out",
                                          str(tmp_path / "out.json")])
        with pytest.raises(SystemExit) as e:
            check.main()
            raise SystemExit(0)
        return e.value.code, [line for line in capsys.readouterr().out.splitlines() if line.startswith("FAIL")]

    assert run(STAND_IN) == (0, [])
    code, fails = run(STAND_IN.replace("model_pred * (-sigmas) + noisy_model_input",
                                       "model_pred * (-sigmas) + 0.999 * noisy_model_input"))
    assert code == 1 and fails and all("precondition1" in line for line in fails), fails
