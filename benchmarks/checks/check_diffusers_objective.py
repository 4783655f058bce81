"""Our discrete-time objective with model.ddpm (diffrelay.objectives.ddpm) against diffusers, same draws.

  python benchmarks/checks/check_diffusers_objective.py --diffusers-src /path/to/diffusers/src

--diffusers-src is the `src` folder of a diffusers checkout (github.com/huggingface/diffusers); diffusers is
imported from there (put first on sys.path; the script checks diffusers.__file__ is under it). The training
scripts are read from <src>/../examples/text_to_image/ (or --scripts): train_text_to_image.py, and
train_text_to_image_lora_sdxl.py where it is there. Nothing of diffusers enters the package.

Cases, each on the same x0, noise and timesteps (0 and 999 among them):
  schedule/*:  betas and alphas_cumprod of DDPMScheduler for beta_schedule linear (1e-4..0.02) and scaled_linear
               (0.00085..0.012), each with and without rescale_betas_zero_snr, against ddpm.betas/alphas_cumprod.
               diffusers computes them in float32, we in float64: the bound is float32 rounding. rescale_f64:
               diffusers' rescale_zero_terminal_snr applied to our float64 betas, against ours (same arithmetic).
  add_noise/*, velocity/*:  the x_t our loss gives the network (recorded) against DDPMScheduler.add_noise, and
               ddpm.target(..., "v_prediction") against get_velocity, in float32 and float64; "same-abar": with
               diffusers' alphas_cumprod replaced by ours (the formula alone, bound 1e-15 relative-ish).
  snr/*:       the chain's SNR against training_utils.compute_snr (float32 there), relative difference.
  sampler-x0/*: chain.x0_eps / x0_from_eps against DDIMScheduler.step's pred_original_sample for epsilon,
               v_prediction and sample, zero terminal SNR included (where abar = 0 at t = 999).
  ddim-step/*, euler-step/*:  the whole step of DDIMScheduler and EulerDiscreteScheduler (prev_sample, at each of
               10 steps of SD's "leading" spacing with steps_offset 1) against the papers' update written out here,
               not diffrelay's and not diffusers': DDIM (Song et al. 2021, eq. 12, sigma_t(eta) of eq. 16, the last
               step to abar[0] as set_alpha_to_one false) for epsilon and v_prediction, eta 0 and 0.5 with the
               scheduler handed the noise; Euler (Karras et al. 2022, Alg. 2 without churn, the VP network read as a
               denoiser of sigma = sqrt((1 - abar) / abar), the last sigma 0) for epsilon and v_prediction. Both take
               the scheduler's alphas_cumprod (schedule/* compares it with ours), so the figure is the step's
               arithmetic alone; the timesteps are compared with the spacing's rule. sample.scheduler runs these
               classes themselves, so check_diffusers_sampling.py (both sides the same classes) cannot see their
               arithmetic: these figures do, for DDIM and Euler.
  loss/<script>/*:  ddpm.loss against the loss the script's own lines compute. The lines are taken from the
               script's source with `ast` (the statements of the `accelerator.accumulate` block that draw the noise
               and its offset, the timesteps, add the noise, pick the target, call the network and weigh the loss)
               and executed in a namespace holding args, noise_scheduler, compute_snr, the latents and a network;
               the namespace's torch hands out recorded draws (randn_like, randn) and our timesteps (randint), and
               ours gets the same: the base noise, the offset's draw (ddpm.offset_noise) and rnd_normal mapped onto
               those timesteps. diffusers' scripts have no target for prediction_type sample (they raise): for it
               the target statement is replaced by target = x0 (DDPMScheduler.step reads "sample" as x0) and the
               rest (weights min(SNR, gamma) with no division) is the script's. For epsilon, v_prediction and
               sample, snr_gamma None and 5, noise_offset 0 and 0.1; scaled_linear, and zero terminal SNR for v and
               sample. The script computes its loss in float32 from float32 alphas: relative bound 2e-5.
Bounds: the dicts below (written to the JSON); exit status 1 with one FAIL line per figure outside its bound.
Writes benchmarks/results/diffusers_objective.json. tests/test_ddpm_diffusers.py runs it against the
installed diffusers and a stand-in script.
"""

import argparse
import ast
import itertools
import sys
import time
import types
from pathlib import Path

import torch
from official import RESULTS, Gate, write_results

from diffrelay.objectives import ddpm
from diffrelay.objectives.ddpm_options import Options

B, C, RES = 8, 4, 8
TIMESTEPS = [0, 999, 1, 500, 998, 250, 750, 42]
SCHEDULES = {"linear": Options(), "scaled_linear": Options(beta_schedule="scaled_linear", beta_start=0.00085,
                                                                beta_end=0.012)}
# diffusers' float32 schedule against our float64 one: about 10x the differences seen (in brackets). The float32
# add_noise differences come from 1 - abar in float32 at small t (cancellation), not from the formula: with our
# alphas_cumprod put into the scheduler ("same-abar") the results are equal bit for bit.
BOUNDS = {"betas": 1e-8,  # max abs (1.8e-9)
          "betas-zsnr": 1e-4,  # max abs: the last betas, 1 - abar_t / abar_{t-1} near 1, in float32 (7.1e-6)
          "alphas_cumprod": 5e-6,  # max abs (4.7e-7)
          "rescale_f64": 1e-14,  # diffusers' function on our float64 betas: max abs (1.8e-15)
          "add_noise/float32": 4e-5, "add_noise/float64": 4e-5, "velocity/float32": 4e-5,  # max abs (3.8e-6)
          "velocity/float64": 4e-5, "add_noise/same-abar": 1e-15, "velocity/same-abar": 1e-15,  # (0)
          "snr": 2e-3,  # max relative, SNR > 0; float32 abar near 0 (1.7e-4)
          "sampler-x0": 1e-12,  # DDIMScheduler.step's pred_original_sample, same abar, float64: max abs
          "ddim-step": 1e-12,  # DDIMScheduler.step's prev_sample against eq. 12, same abar, float64: max abs
          "euler-step": 1e-6,  # EulerDiscreteScheduler.step's prev_sample (float32 inside) against Alg. 2 in
          #                      float64: max abs relative to the largest |prev_sample|
          "loss": 1e-5}  # relative (7.9e-7)
LOSS_NAMES = {"noise", "bsz", "timesteps", "noisy_latents", "noisy_model_input", "new_noise", "target",
              "model_pred", "loss"}
LOSS_FLAGS = ("noise_offset", "input_perturbation", "prediction_type", "snr_gamma", "dream_training")


def import_diffusers(src: Path):
    sys.path.insert(0, str(src))
    loaded = sys.modules.get("diffusers")
    if loaded is not None and not Path(loaded.__file__).resolve().is_relative_to(src.resolve()):
        for name in [m for m in sys.modules if m == "diffusers" or m.startswith("diffusers.")]:
            del sys.modules[name]  # another diffusers was imported first (an in-process caller): import this one
    import diffusers

    if not Path(diffusers.__file__).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"diffusers was imported from {diffusers.__file__}, not from {src}")
    return diffusers


def scheduler(diffusers, o: Options, kind="DDPMScheduler", **extra):
    return getattr(diffusers, kind)(num_train_timesteps=ddpm.T, beta_schedule=o.beta_schedule, beta_start=o.beta_start,
                                    beta_end=o.beta_end, rescale_betas_zero_snr=o.rescale_betas_zero_snr,
                                    prediction_type=o.prediction_type, **extra)


def maxdiff(a, b) -> float:
    return float((torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max())


def rel(a, b) -> float:
    a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
    return float(((a - b).abs() / b.abs().clamp(min=1e-30)).max())


def rnd_for(t: torch.Tensor) -> torch.Tensor:
    """rnd_normal whose timestep in ddpm.loss is t: the middle of its 1/T slice of the normal CDF."""
    return torch.special.ndtri((t.double() + 0.5) / ddpm.T)


def fake_net(x, t):
    """A network that depends on x_t and t (so add_noise and the timesteps matter), the same on both sides."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(C, 1, 1, generator=g, dtype=torch.float64)
    return (0.5 * x + (w * torch.cos(t.double() / 300).reshape(-1, 1, 1, 1)).to(x.dtype)).to(x.dtype)


def recorded_loss(net, x0, rnd, noise, o):
    seen = {}

    def record(x, t, labels):
        seen["x_t"], seen["t"] = x, t
        return net(x, t)

    return ddpm.loss(record, x0, None, rnd, noise, o), seen


def schedules(g: Gate, diffusers) -> dict:
    from diffusers.schedulers.scheduling_ddpm import rescale_zero_terminal_snr

    out = {}
    for (name, base), zsnr in itertools.product(SCHEDULES.items(), (False, True)):
        o = Options(**{**base.__dict__, "rescale_betas_zero_snr": zsnr})
        s, case = scheduler(diffusers, o), f"{name}{'-zsnr' if zsnr else ''}"
        d = {"betas-zsnr" if zsnr else "betas": maxdiff(ddpm.betas(o), s.betas),
             "alphas_cumprod": maxdiff(ddpm.alphas_cumprod(o), s.alphas_cumprod)}
        if zsnr:  # diffusers' function on our float64 betas
            plain = Options(**{**o.__dict__, "rescale_betas_zero_snr": False})
            d["rescale_f64"] = maxdiff(ddpm.betas(o), rescale_zero_terminal_snr(ddpm.betas(plain)))
        for k, v in d.items():
            g.at_most(f"schedule/{case}/{k}", v, BOUNDS[k])
        out[case] = d
    return out


def forward_terms(g: Gate, diffusers) -> dict:
    from diffusers.training_utils import compute_snr

    out = {}
    t = torch.tensor(TIMESTEPS)
    for (name, base), zsnr in itertools.product(SCHEDULES.items(), (False, True)):
        o = Options(**{**base.__dict__, "rescale_betas_zero_snr": zsnr, "prediction_type": "v_prediction"})
        case, chain = f"{name}{'-zsnr' if zsnr else ''}", ddpm._Chain(None, o)
        d = {}
        for dtype in (torch.float32, torch.float64):
            gen = torch.Generator().manual_seed(0)
            x0 = torch.randn(B, C, RES, RES, generator=gen, dtype=dtype)
            noise = torch.randn(B, C, RES, RES, generator=gen, dtype=dtype)
            _, seen = recorded_loss(fake_net, x0, rnd_for(t).to(dtype), noise, o)
            g.equal(f"add_noise/{case}/timesteps", seen["t"].tolist(), TIMESTEPS)
            s, key = scheduler(diffusers, o), str(dtype).removeprefix("torch.")
            d[f"add_noise/{key}"] = maxdiff(seen["x_t"], s.add_noise(x0, noise, t))
            d[f"velocity/{key}"] = maxdiff(ddpm.target(x0, noise, chain, t, "v_prediction"), s.get_velocity(x0, noise, t))
            if dtype == torch.float64:  # the formula alone: diffusers' arithmetic on our float64 alphas_cumprod
                s.alphas_cumprod = ddpm.alphas_cumprod(o)
                d["add_noise/same-abar"] = maxdiff(seen["x_t"], s.add_noise(x0, noise, t))
                d["velocity/same-abar"] = maxdiff(ddpm.target(x0, noise, chain, t, "v_prediction"),
                                                  s.get_velocity(x0, noise, t))
        s = scheduler(diffusers, o)
        theirs, ours = compute_snr(s, t), chain.snr[t]
        d["snr"] = rel(ours[ours > 0], theirs[ours > 0]) if (ours > 0).any() else 0.0
        g.equal(f"snr/{case}/zeros", (ours == 0).tolist(), (theirs == 0).tolist())
        for k, v in d.items():
            g.at_most(f"{k.split('/')[0]}/{case}/{k.split('/', 1)[1]}" if "/" in k else f"{k}/{case}", v,
                      BOUNDS[k])
        out[case] = d
    return out


def sampler_x0(g: Gate, diffusers) -> dict:
    """DDIMScheduler.step's pred_original_sample against our conversion, at every t of TIMESTEPS."""
    out = {}
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, C, RES, RES, generator=gen, dtype=torch.float64)
    pred = torch.randn(B, C, RES, RES, generator=gen, dtype=torch.float64)
    for kind, zsnr in (("epsilon", False), ("v_prediction", False), ("sample", False), ("v_prediction", True),
                       ("sample", True)):
        o = Options(**{**SCHEDULES["scaled_linear"].__dict__, "prediction_type": kind, "rescale_betas_zero_snr": zsnr})
        s = scheduler(diffusers, o, "DDIMScheduler", clip_sample=False)  # sample.ddpm.clip_denoised's default
        s.alphas_cumprod = ddpm.alphas_cumprod(o)  # the conversion alone, on one schedule
        s.set_timesteps(10)
        chain, worst = ddpm._Chain(None, o), 0.0
        for i, t in enumerate(TIMESTEPS):
            if kind == "epsilon" and zsnr:
                continue
            idx = torch.full((1,), t)
            ref = s.step(pred[i:i + 1], t, x[i:i + 1]).pred_original_sample
            ours = (chain.x0_from_eps(x[i:i + 1], idx, pred[i:i + 1]) if kind == "epsilon"
                    else chain.x0_eps(x[i:i + 1], idx, pred[i:i + 1], kind)[0])
            worst = max(worst, maxdiff(ours, ref))
        case = f"sampler-x0/{kind}{'-zsnr' if zsnr else ''}"
        g.at_most(case, worst, BOUNDS["sampler-x0"])
        out[case] = worst
    return out


STEP_CONFIG = {"beta_schedule": "scaled_linear", "beta_start": 0.00085, "beta_end": 0.012, "steps_offset": 1,
               "timestep_spacing": "leading"}  # SD's scheduler folder
STEPS = 10


def leading_timesteps(n: int) -> list[int]:
    """The "leading" spacing: every T // n-th timestep from 0, plus steps_offset, largest first."""
    return [i * (ddpm.T // n) + STEP_CONFIG["steps_offset"] for i in reversed(range(n))]


def ddim_update(x, out, a, a_prev, kind: str, eta: float, z):
    """One DDIM update, Song et al. 2021 eq. 12 with sigma_t(eta) of eq. 16, from x_t, the network's output, abar_t,
    abar_prev and the noise z."""
    if kind == "epsilon":
        eps = out
        x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
    else:  # v = sqrt(abar) eps - sqrt(1 - abar) x0 (Salimans & Ho 2022)
        x0 = a.sqrt() * x - (1 - a).sqrt() * out
        eps = a.sqrt() * out + (1 - a).sqrt() * x
    sigma = eta * ((1 - a_prev) / (1 - a)).sqrt() * (1 - a / a_prev).sqrt()
    return a_prev.sqrt() * x0 + (1 - a_prev - sigma ** 2).sqrt() * eps + sigma * z


def euler_update(x, out, sigma, sigma_next, kind: str):
    """One Euler step of Karras et al. 2022 (Alg. 2, no churn) for a VP network read as a denoiser at sigma:
    x = x0 + sigma eps in the sampler's (VE) space, the network fed x / sqrt(sigma^2 + 1)."""
    if kind == "epsilon":
        denoised = x - sigma * out
    else:  # v of the VP sample x / sqrt(sigma^2 + 1), where abar = 1 / (sigma^2 + 1)
        denoised = x / (sigma ** 2 + 1) - sigma / (sigma ** 2 + 1).sqrt() * out
    return x + (sigma_next - sigma) * (x - denoised) / sigma


def sampler_steps(g: Gate, diffusers) -> dict:
    """DDIMScheduler.step and EulerDiscreteScheduler.step, whole, against the papers' updates (ddim_update,
    euler_update) at every step of a 10-step chain."""
    out = {}
    want = leading_timesteps(STEPS)
    for kind, eta in (("epsilon", 0.0), ("v_prediction", 0.0), ("v_prediction", 0.5)):
        s = diffusers.DDIMScheduler(**STEP_CONFIG, prediction_type=kind, clip_sample=False, set_alpha_to_one=False)
        s.set_timesteps(STEPS)
        case = f"ddim-step/{kind}-eta{eta:g}"
        g.equal(f"{case}/timesteps", s.timesteps.tolist(), want)
        # its own alphas_cumprod and final_alpha_cumprod, in float64: the step's arithmetic in float64 on both sides
        s.alphas_cumprod, s.final_alpha_cumprod = s.alphas_cumprod.double(), s.final_alpha_cumprod.double()
        abar = s.alphas_cumprod
        gen = torch.Generator().manual_seed(2)
        worst = 0.0
        for i, t in enumerate(want):
            x, pred, z = (torch.randn(2, C, RES, RES, generator=gen, dtype=torch.float64) for _ in range(3))
            a_prev = abar[want[i + 1]] if i + 1 < len(want) else abar[0]  # the last step: set_alpha_to_one false
            ref = s.step(pred, t, x, eta=eta, variance_noise=z).prev_sample
            worst = max(worst, maxdiff(ddim_update(x, pred, abar[t], a_prev, kind, eta, z), ref))
        g.at_most(case, worst, BOUNDS["ddim-step"])
        out[case] = worst
    for kind in ("epsilon", "v_prediction"):
        s = diffusers.EulerDiscreteScheduler(**STEP_CONFIG, prediction_type=kind)
        s.set_timesteps(STEPS)
        case = f"euler-step/{kind}"
        g.equal(f"{case}/timesteps", s.timesteps.tolist(), [float(t) for t in want])
        abar = s.alphas_cumprod.double()
        sigmas = [float(((1 - abar[t]) / abar[t]).sqrt()) for t in want] + [0.0]
        gen = torch.Generator().manual_seed(3)
        worst = 0.0
        for i, t in enumerate(s.timesteps):
            x = torch.randn(2, C, RES, RES, generator=gen) * (sigmas[i] ** 2 + 1) ** 0.5
            pred = torch.randn(2, C, RES, RES, generator=gen)
            s.scale_model_input(x, t)  # as a pipeline calls it (step warns otherwise)
            ref = s.step(pred, t, x).prev_sample.double()
            ours = euler_update(x.double(), pred.double(), torch.tensor(sigmas[i], dtype=torch.float64),
                                sigmas[i + 1], kind)
            worst = max(worst, maxdiff(ours, ref) / float(ours.abs().max()))
        g.at_most(case, worst, BOUNDS["euler-step"])
        out[case] = worst
    return out


class DrawingTorch(types.ModuleType):
    """torch for the script's lines: its draws recorded (randn_like, randn) and its timesteps ours (randint)."""

    def __init__(self, timesteps):
        super().__init__("torch")
        self.draws, self.timesteps = [], timesteps

    def __getattr__(self, name):
        return getattr(torch, name)

    def randn_like(self, x, **kw):
        self.draws.append(torch.randn_like(x, **kw))
        return self.draws[-1].clone()

    def randn(self, *a, **kw):
        self.draws.append(torch.randn(*a, **kw))
        return self.draws[-1].clone()

    def randint(self, low, high, size, **kw):
        assert (low, high, tuple(size)) == (0, ddpm.T, (len(self.timesteps),)), (low, high, size)
        return self.timesteps.clone()


def loss_statements(path: Path) -> list:
    """The statements of the script's `with accelerator.accumulate(...)` block that make the loss."""
    tree = ast.parse(path.read_text())
    blocks = [n for n in ast.walk(tree) if isinstance(n, ast.With)
              and any("accumulate" in ast.unparse(i.context_expr) for i in n.items)]
    if len(blocks) != 1:
        raise SystemExit(f"{path}: expected one `with accelerator.accumulate(...)` block, found {len(blocks)}")
    keep = []
    for st in blocks[0].body:
        targets = st.targets if isinstance(st, ast.Assign) else [st.target] if isinstance(st, ast.AugAssign) else []
        names = {t.id if isinstance(t, ast.Name) else None for t in targets}
        text = ast.unparse(st.test) if isinstance(st, ast.If) else ""
        if (names and names <= LOSS_NAMES) or \
                any(f"args.{f}" in text or f"config.{f}" in text for f in LOSS_FLAGS):
            keep.append(st)
    return keep


def script_loss(diffusers, statements, o: Options, x0, timesteps):
    """The script's loss and the draws its lines made."""
    from diffusers.training_utils import compute_snr

    fake = DrawingTorch(timesteps)
    args = types.SimpleNamespace(noise_offset=o.noise_offset, input_perturbation=0, snr_gamma=o.snr_gamma,
                                 prediction_type=o.prediction_type, dream_training=False)
    ns = {"torch": fake, "F": torch.nn.functional, "args": args, "noise_scheduler": scheduler(diffusers, o),
          "compute_snr": compute_snr, "latents": x0, "model_input": x0, "encoder_hidden_states": None,
          "prompt_embeds": None, "unet_added_conditions": {}, "ValueError": ValueError,
          "unet": lambda x, t, *a, **k: (fake_net(x, t),)}
    for st in statements:
        is_target = isinstance(st, ast.If) and "prediction_type ==" in ast.unparse(st.test) and \
            "target" in ast.unparse(st)
        if is_target and o.prediction_type == "sample":
            ns["target"] = x0  # no such branch in diffusers' scripts: the x0 target
            continue
        exec(compile(ast.Module([st], []), "<script>", "exec"), ns)
    return ns["loss"], fake.draws


def losses(g: Gate, diffusers, scripts: list[Path]) -> dict:
    out = {}
    t = torch.tensor(TIMESTEPS)
    x0 = torch.randn(B, C, RES, RES, generator=torch.Generator().manual_seed(3))
    for path in scripts:
        statements = loss_statements(path)
        for kind, gamma, offset, zsnr in itertools.product(("epsilon", "v_prediction", "sample"), (None, 5.0),
                                                           (0.0, 0.1), (False, True)):
            if zsnr and kind == "epsilon":
                continue  # refused: no signal at t = 999
            o = Options(**{**SCHEDULES["scaled_linear"].__dict__, "prediction_type": kind, "snr_gamma": gamma,
                           "noise_offset": offset, "rescale_betas_zero_snr": zsnr})
            torch.manual_seed(11)
            theirs, draws = script_loss(diffusers, statements, o, x0, t)
            g.equal(f"loss/{path.stem}/draws-{kind}-{offset}", len(draws), 2 if offset else 1)
            noise = ddpm.offset_noise(draws[0], draws[1], offset) if offset else draws[0]
            ours, seen = recorded_loss(fake_net, x0, rnd_for(t).float(), noise, o)
            case = f"loss/{path.stem}/{kind}-gamma{gamma}-offset{offset}{'-zsnr' if zsnr else ''}"
            value = abs(float(ours) - float(theirs)) / abs(float(theirs))
            g.at_most(case, value, BOUNDS["loss"])
            out[case] = {"ours": float(ours), "diffusers": float(theirs), "rel_diff": value}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--diffusers-src", type=Path, required=True, help="the src folder of a diffusers checkout")
    ap.add_argument("--scripts", type=Path, help="folder of the training scripts (default <src>/../examples/"
                    "text_to_image)")
    ap.add_argument("--out", type=Path, default=RESULTS / "diffusers_objective.json")
    a = ap.parse_args()
    t0 = time.perf_counter()
    diffusers = import_diffusers(a.diffusers_src)
    folder = a.scripts or a.diffusers_src.resolve().parent / "examples" / "text_to_image"
    scripts = [p for p in (folder / "train_text_to_image.py", folder / "train_text_to_image_lora_sdxl.py")
               if p.exists()]
    g = Gate()
    g.equal("scripts found (train_text_to_image.py at least)", (folder / "train_text_to_image.py").exists(), True)
    results = {"schedules": schedules(g, diffusers), "forward": forward_terms(g, diffusers),
               "sampler_x0": sampler_x0(g, diffusers),
               "sampler_steps": sampler_steps(g, diffusers), "loss": losses(g, diffusers, scripts)}
    worst = g.worst()
    print("max differences:", {k: f"{v:.2e}" for k, v in worst.items()})
    write_results(a.out, "diffrelay's ddpm objective with model.ddpm against diffusers' schedulers and training "
                  "scripts", diffusers=diffusers.__version__, diffusers_file=diffusers.__file__,
                  scripts=[str(p) for p in scripts], bounds=BOUNDS, max_by_kind=worst, **results,
                  seconds=round(time.perf_counter() - t0, 1), gate=g.to_json())
    g.finish("check_diffusers_objective")


if __name__ == "__main__":
    main()
