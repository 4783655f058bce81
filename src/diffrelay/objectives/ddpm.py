"""DDPM noise prediction over 1000 discrete steps (Ho et al. 2020; improved DDPM, Nichol & Dhariwal 2021), as
DiT trains and samples it (DiT's diffusion/gaussian_diffusion.py, respace.py and create_diffusion defaults).

Schedule: beta linear from 1e-4 to 0.02 over T = 1000 steps (DiT's "linear", scaled for 1000 steps),
abar_t = prod_{s <= t} (1 - beta_s), x_t = sqrt(abar_t) x + sqrt(1 - abar_t) eps. The network gets the integer
timestep t in 0..T-1 as its time input (c_noise) and predicts eps; with twice the image's channels (DiT's
learned-sigma layout: nets/dit.py forward_all) its second half v in [-1, 1] sets the step's variance,
log var = (v + 1)/2 log beta_t + (1 - v)/2 log beta~_t (iDDPM Eq. 15).

Training draws one standard normal n per sample (the loader's draw) and makes t = floor(Phi(n) T), uniform
over 0..T-1 as DiT's randint. The loss is DiT's: the mean over pixels of (eps - eps_pred)^2, plus, with the
learned-sigma half, iDDPM's L_vlb term for the variance with the mean held fixed (stop-gradient), in bits:
KL(q(x_{t-1} | x_t, x_0) || p(x_{t-1} | x_t)) and at t = 0 the discretised Gaussian decoder NLL.

Samplers, on the grid of `steps` timesteps respaced as DiT's space_timesteps(T, str(steps)):
  ddpm:  ancestral sampling (p_sample_loop): x_0 predicted from eps (no clipping, as DiT's sample.py), the
         posterior mean, and noise of the learned variance (or beta, DiT's "fixed large" variance, for a network
         without the learned-sigma half) except at the last step;
  ddim:  DDIM (Song et al. 2021) with eta (0: deterministic).
Coefficients are computed in float64 and the sampler runs in float64 (DiT's in float32): the bound is in
benchmarks/checks/check_ddpm_equivalence.py's results.

model.ddpm (objectives/ddpm_options.py) makes it the objective as diffusers trains Stable Diffusion and its kin:
the scaled_linear schedule, zero-terminal-SNR rescaling, v- or x0-prediction (the target; the samplers convert
the prediction to x0 and eps as diffusers' DDIMScheduler.step does), min-SNR-gamma weights and offset noise (the
offset's draw is the loader's, data/loader.py). benchmarks/checks/check_diffusers_objective.py compares each with
diffusers. Its defaults are DiT's objective above, bit for bit.
"""

import dataclasses
import functools
import math

import numpy as np
import torch
from torch import nn

from diffrelay.errors import UserError
from diffrelay.objectives import reduce
from diffrelay.objectives.draws import ahead
from diffrelay.objectives.ddpm_options import DEFAULT, Options
from diffrelay.text import condition

T = 1000
SOLVERS = ("ddpm", "ddim")


def betas(options: Options = DEFAULT) -> torch.Tensor:
    """The betas in float64. Default: DiT's linear schedule (get_named_beta_schedule("linear", 1000)); NumPy's
    linspace, whose rounding differs from torch's in the last bit. scaled_linear is diffusers' (linspace of
    sqrt(beta), squared), then rescale_betas_zero_snr its rescale_zero_terminal_snr; diffusers computes them in
    float32."""
    o = options
    if o.beta_schedule == "scaled_linear":
        out = np.linspace(o.beta_start**0.5, o.beta_end**0.5, T, dtype=np.float64) ** 2
    else:
        out = np.linspace(o.beta_start, o.beta_end, T, dtype=np.float64)
    return torch.from_numpy(rescale_zero_terminal_snr(out) if o.rescale_betas_zero_snr else out)


def rescale_zero_terminal_snr(beta: np.ndarray) -> np.ndarray:
    """Lin et al. 2024, Algorithm 1, as diffusers' scheduling_ddpm.rescale_zero_terminal_snr: sqrt(abar) shifted
    to end at 0 and scaled to keep its first value; the last beta is then 1 and the last abar exactly 0."""
    root = np.sqrt(np.cumprod(1 - beta))
    first, last = root[0], root[-1]
    abar = ((root - last) * (first / (first - last))) ** 2
    return 1 - np.append(abar[:1], abar[1:] / abar[:-1])


def alphas_cumprod(options: Options = DEFAULT) -> torch.Tensor:
    return torch.from_numpy(np.cumprod(1 - betas(options).numpy()))


def sigma_of(t, options: Options = DEFAULT) -> torch.Tensor:
    """The EDM noise level of timestep t: x_t / sqrt(abar_t) = x + sigma eps (the unit of sample.guidance_interval;
    infinite where abar is 0, the last timestep of a zero-terminal-SNR schedule)."""
    a = alphas_cumprod(options)[torch.as_tensor(t)]
    return ((1 - a) / a).sqrt()


def respaced(steps: int) -> list[int]:
    """The timesteps DiT's space_timesteps(T, str(steps)) keeps: `steps` indices spread evenly over 0..T-1,
    each rounded as Python's round rounds (half to even), with the stride added up step by step as there."""
    if steps > T:
        raise ValueError(f"{steps} steps: at most {T}")
    stride = 1.0 if steps <= 1 else (T - 1) / (steps - 1)
    taken, cur = [], 0.0
    for _ in range(steps):
        taken.append(round(cur))
        cur += stride
    return sorted(set(taken))


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """sample.ddpm: DDIM's eta, and how many output channels guidance extrapolates (None: every eps channel;
    DiT's sample.py guides the first 3 of its 4 latent channels and takes the rest from the conditional pass)."""

    eta: float = 0.0
    guided_channels: int | None = None
    clip_denoised: bool = False  # clip the predicted x_0 to [-1, 1] (ADM's pixel models; DiT's sample.py does not)

    def changed(self) -> dict:
        default = SamplerSettings()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


class EpsModel(nn.Module):
    """F(x_t, t, labels) -> eps, or eps and the variance half (2C channels) for a learned-sigma network: every
    output channel (a built-in DiT's forward_all; a network of one's own may return 2C channels from forward).
    Whether the variance is learned is read off the output's channels, where it is used. labels may be a
    text.condition.Text, given to the network as text= (condition.call)."""

    def __init__(self, net: nn.Module, in_channels: int):
        super().__init__()
        self.net = net  # the raw network F of the diffrelay.nets contract
        self.in_channels = in_channels
        self.full = callable(getattr(net, "forward_all", None))  # the raw network here, never a DDP wrapper

    def forward(self, x, t, labels=None):
        fn = self.net.forward_all if self.full else self.net
        return condition.call(fn, x, t.reshape(-1).to(x.dtype), labels).to(x.dtype)


def _gather(values: torch.Tensor, t, like: torch.Tensor) -> torch.Tensor:
    # A schedule value per row at timestep t, as a (B, 1, 1, 1) tensor of the computation's dtype; `values` are
    # on the computation's device already (_chain), so this makes no host-device copy.
    return values[t].to(like.dtype).reshape(-1, 1, 1, 1)


def _normal_kl(mean1, logvar1, mean2, logvar2):
    # KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)) per element.
    return 0.5 * (-1 + logvar2 - logvar1 + (logvar1 - logvar2).exp() + (mean1 - mean2) ** 2 * (-logvar2).exp())


def _cdf(x):
    # The tanh approximation of the standard normal CDF that iDDPM's decoder likelihood uses.
    return 0.5 * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _decoder_nll(x, mean, log_scale):
    """-log p(x_0 | x_1) per element for x in [-1, 1] binned at 2/255 (iDDPM's discretised Gaussian)."""
    inv = (-log_scale).exp()
    upper, lower = _cdf(inv * (x - mean + 1 / 255)), _cdf(inv * (x - mean - 1 / 255))
    log_upper = upper.clamp(min=1e-12).log()
    log_one_minus_lower = (1 - lower).clamp(min=1e-12).log()
    mid = (upper - lower).clamp(min=1e-12).log()
    return -torch.where(x < -0.999, log_upper, torch.where(x > 0.999, log_one_minus_lower, mid))


class _Chain:
    """The posterior q(x_prev | x_t, x_0) of a chain of timesteps: the full 0..T-1 one for training, or a
    respaced one for sampling (whose betas are 1 - abar_t / abar_prev, as respace.py makes them)."""

    def __init__(self, steps: list[int] | None = None, options: Options = DEFAULT):
        abar = alphas_cumprod(options).numpy()
        if steps is not None:
            abar = abar[steps]
        # As respace.py: the chain's betas, and abar made again from them (equal up to the last bit).
        beta = 1 - abar / np.append(1.0, abar[:-1])
        abar = np.cumprod(1 - beta)
        beta, prev, abar = map(torch.from_numpy, (beta, np.append(1.0, abar[:-1]), abar))
        self.beta, self.abar, self.abar_prev = beta, abar, prev
        var = self.beta * (1 - prev) / (1 - abar)
        # beta~_0 is 0; its log is clipped to beta~_1 (iDDPM's posterior_log_variance_clipped).
        self.log_var_small = torch.cat([var[1:2], var[1:]]).log()
        self.log_beta = self.beta.log()
        self.log_var_large = torch.cat([var[1:2], self.beta[1:]]).log()  # DiT's variance without learned sigma
        self.coef_x0 = self.beta * prev.sqrt() / (1 - abar)
        self.coef_xt = (1 - prev) * (1 - self.beta).sqrt() / (1 - abar)
        self.snr = abar / (1 - abar)  # compute_snr's (sqrt(abar) / sqrt(1 - abar))^2; 0 where abar is 0

    def to(self, device) -> "_Chain":
        for name, value in vars(self).items():
            setattr(self, name, value.to(device))
        return self

    def x0_from_eps(self, x, i, eps):
        return _gather((1 / self.abar).sqrt(), i, x) * x - _gather((1 / self.abar - 1).sqrt(), i, x) * eps

    def x0_eps(self, x, i, pred, prediction: str):
        """(x0, eps) from a v_prediction or sample prediction, as diffusers' DDIMScheduler.step; finite where abar
        is 0 (no division by sqrt(abar), which epsilon's x0 needs)."""
        a, s = _gather(self.abar.sqrt(), i, x), _gather((1 - self.abar).sqrt(), i, x)
        if prediction == "v_prediction":
            return a * x - s * pred, a * pred + s * x
        return pred, (x - a * pred) / s

    def eps_from_x0(self, x, i, x0):
        return (x - _gather(self.abar.sqrt(), i, x) * x0) / _gather((1 - self.abar).sqrt(), i, x)

    def posterior_mean(self, x0, x, i):
        return _gather(self.coef_x0, i, x) * x0 + _gather(self.coef_xt, i, x) * x

    def log_var(self, i, v, like):
        """The step's log variance: learned from v in [-1, 1] (iDDPM Eq. 15), or for v None DiT's default
        without learned sigma, "fixed large": beta_t, with beta~_1 at the first step."""
        if v is None:
            return _gather(self.log_var_large, i, like).expand_as(like)
        small = _gather(self.log_var_small, i, like)
        frac = (v + 1) / 2
        return frac * _gather(self.log_beta, i, like) + (1 - frac) * small


@functools.lru_cache(maxsize=16)
def _chain(steps: tuple | None, device: str, options: Options = DEFAULT) -> _Chain:
    """The chain's tables on `device`, made once (a training step or a sampling step then copies nothing)."""
    return _Chain(None if steps is None else list(steps), options).to(device)


def make_tables(device: str, options: Options = DEFAULT) -> None:
    """Make and cache the training chain's tables on `device` now (validate's memory pass: made on the real CPU
    before a fake-tensor pass uses them, so the cache never holds fake tensors)."""
    _chain(None, device, options)


def target(images, noise, chain, t, prediction: str):
    """What the network learns to predict: eps, diffusers' get_velocity sqrt(abar) eps - sqrt(1 - abar) x0,
    or x0."""
    if prediction == "v_prediction":
        return _gather(chain.abar.sqrt(), t, images) * noise - _gather((1 - chain.abar).sqrt(), t, images) * images
    return images if prediction == "sample" else noise


def offset_noise(noise, draw, offset: float):
    """Offset noise (Guttenberg 2023) as diffusers' training scripts add it: noise + offset * draw, with draw
    ~ N(0, 1) of shape (B, C, 1, 1), one number per sample and channel (data/loader.py draws it)."""
    return noise + offset * draw


def snr_weights(chain, t, gamma: float, prediction: str, like):
    """Min-SNR-gamma (Hang et al. 2023) as diffusers' training scripts weight each sample's mean squared error:
    min(SNR, gamma), divided by SNR for epsilon and by SNR + 1 for v_prediction (x0 untouched for sample)."""
    snr = chain.snr[t]
    w = snr.clamp(max=gamma)
    w = w / snr if prediction == "epsilon" else w / (snr + 1) if prediction == "v_prediction" else w
    return w.to(like.dtype)


def loss(net, images, labels, rnd_normal, noise, options: Options = DEFAULT, weights=None):
    """DiT's training loss at timesteps drawn from rnd_normal (B,), with noise (B, C, H, W) from the caller (with
    model.ddpm.noise_offset's offset in it already: data/loader.py); model.ddpm's target and weights."""
    t = (0.5 * (1 + torch.erf(rnd_normal.double() / math.sqrt(2))) * T).long().clamp(0, T - 1)
    chain = _chain(None, str(images.device), options)
    x_t = _gather(chain.abar.sqrt(), t, images) * images + _gather((1 - chain.abar).sqrt(), t, images) * noise
    out = net(x_t, t, labels)
    c, kind = images.shape[1], options.prediction_type
    eps = out[:, :c]
    per_sample = ((target(images, noise, chain, t, kind) - eps) ** 2).mean(dim=(1, 2, 3))
    if options.snr_gamma is not None:
        per_sample = per_sample * snr_weights(chain, t, options.snr_gamma, kind, per_sample)
    if out.shape[1] == 2 * c and kind == "sample":  # a network of one's own (config validation catches DiT's)
        raise UserError(f"the network returns {2 * c} channels (learned sigma, L_vlb), which is defined here for "
                        f"model.ddpm.prediction_type epsilon and v_prediction, not {kind}; make it return {c} channels")
    if out.shape[1] == 2 * c:  # learned sigma (read off the output: `net` may be a DDP wrapper)
        # L_vlb trains the variance only: the mean comes from eps with its gradient stopped (iDDPM Sec. 3.1); from
        # v, through x0 = sqrt(abar) x_t - sqrt(1 - abar) v, as HunyuanDiT's gaussian_diffusion.py (VELOCITY).
        log_var = chain.log_var(t, out[:, c:], images)
        pred = eps.detach()
        x0 = chain.x0_from_eps(x_t, t, pred) if kind == "epsilon" else chain.x0_eps(x_t, t, pred, kind)[0]
        mean = chain.posterior_mean(x0, x_t, t)
        true_mean = chain.posterior_mean(images, x_t, t)
        kl = _normal_kl(true_mean, _gather(chain.log_var_small, t, images), mean, log_var).mean(dim=(1, 2, 3))
        nll = _decoder_nll(images, mean, 0.5 * log_var).mean(dim=(1, 2, 3))
        per_sample = per_sample + torch.where(t == 0, nll, kl) / math.log(2)
    return reduce.mean(per_sample, weights)


@torch.no_grad()
def sample(net, latents, labels=None, num_steps: int = 250, solver: str = "ddpm",
           settings: SamplerSettings = SamplerSettings(), noise=None, unguided=None, interval=None,
           options: Options = DEFAULT):
    """From latents ~ N(0, 1) at t = T - 1 to images: `num_steps` respaced steps of DDPM or DDIM. net(x, t, labels)
    is an EpsModel (or its guided form) predicting options.prediction_type; noise(shape) gives the draws (float64,
    one stream per image), each asked for a step ahead (draws.ahead).
    interval = (lo, hi) in EDM's sigma of the step's timestep (sigma_of): `net` there, `unguided` elsewhere."""
    steps = respaced(num_steps)
    chain, c, dev = _chain(tuple(steps), str(latents.device), options), latents.shape[1], latents.device
    sigmas = sigma_of(steps, options).tolist()  # the gate's Python floats: an `if` on a tensor would read it each step
    guided = net
    x = latents.to(torch.float64)
    draws = ahead(noise, x.shape, len(steps) - 1 if solver == "ddpm" or settings.eta > 0 else 0)
    for i in reversed(range(len(steps))):
        if interval is not None:
            net = guided if interval[0] <= sigmas[i] <= interval[1] else unguided
        t = torch.full((x.shape[0],), steps[i], device=dev)
        out = net(x.float(), t, labels).double()
        idx = torch.full((x.shape[0],), i, device=dev)
        pred, v = out[:, :c], (out[:, c:] if out.shape[1] > c else None)
        if options.prediction_type == "epsilon":
            x0, eps = chain.x0_from_eps(x, idx, pred), None  # eps re-derived below, as DiT does
        else:
            x0, eps = chain.x0_eps(x, idx, pred, options.prediction_type)
        if settings.clip_denoised:
            x0 = x0.clamp(-1, 1)
            eps = None if eps is None else chain.eps_from_x0(x, idx, x0)  # diffusers' DDIM: eps of the clipped x0
        if solver == "ddpm":
            x = chain.posterior_mean(x0, x, idx)
            if i > 0:
                x = x + (0.5 * chain.log_var(idx, v, x)).exp() * next(draws)
            continue
        # DDIM: eps re-derived from x_0 (as DiT's ddim_sample), then the eta-scaled step to abar_prev.
        a, a_prev = _gather(chain.abar, idx, x), _gather(chain.abar_prev, idx, x)
        if eps is None:
            eps = (_gather((1 / chain.abar).sqrt(), idx, x) * x - x0) / _gather((1 / chain.abar - 1).sqrt(), idx, x)
        sd = settings.eta * ((1 - a_prev) / (1 - a)).sqrt() * (1 - a / a_prev).sqrt()
        x = x0 * a_prev.sqrt() + (1 - a_prev - sd**2).sqrt() * eps
        if i > 0 and settings.eta > 0:
            x = x + sd * next(draws)
    return x.float()
