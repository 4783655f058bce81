"""EDM (Karras et al. 2022): preconditioning, training loss, and the Heun/Euler sampler with churn.

The sampler follows EDM's Algorithm 2 (NVlabs/edm generate.py, edm_sampler): the rho schedule from
sigma_max to sigma_min, then 0; with S_churn > 0 each step first raises the noise level from t to
t_hat = t (1 + gamma), gamma = min(S_churn / steps, sqrt(2) - 1) inside [S_min, S_max], adding fresh
noise of std sqrt(t_hat^2 - t^2) * S_noise. benchmarks/checks/check_edm_sampler.py compares it with edm_sampler.
"""

import dataclasses
import math

import torch
from torch import nn

from diffrelay import nets
from diffrelay.objectives import reduce
from diffrelay.objectives.draws import ahead
from diffrelay.nets import registry
from diffrelay.text import condition

SIGMA_MIN, SIGMA_MAX, RHO = 0.002, 80.0, 7.0  # the paper's sampling defaults


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """`sample.edm`: the schedule and EDM's stochasticity (Table 5 of the paper lists tuned values; S_churn
    = 0 is the deterministic sampler). S_max None means no upper bound (edm_sampler's float('inf'))."""

    sigma_min: float = SIGMA_MIN
    sigma_max: float = SIGMA_MAX
    rho: float = RHO
    S_churn: float = 0.0
    S_min: float = 0.0
    S_max: float | None = None
    S_noise: float = 1.0

    def changed(self) -> dict:
        """The settings that differ from the paper's deterministic defaults (what identifies a sample folder)."""
        default = SamplerSettings()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


class Denoiser(nn.Module):
    """D(x; sigma) = c_skip x + c_out F(c_in x, c_noise): keeps the network's input and target at unit scale."""

    def __init__(self, net: nn.Module, sigma_data: float = 0.5):
        super().__init__()
        self.net = net  # the raw network F of the diffrelay.nets contract
        self.sigma_data = sigma_data

    def forward(self, x, sigma, labels=None, return_logvar: bool = False, augment_labels=None):
        """D(x; sigma); with return_logvar also the network's uncertainty u(sigma) (edm2's Precond does the same,
        inside the forward, so DDP sees every parameter the loss uses). augment_labels (train.augment) go to the
        network as its fourth argument, and only when given: a network of one's own need not take them. labels may
        be a text.condition.Text (a text run), which reaches the network as text= (condition.call)."""
        sigma = sigma.reshape(-1, 1, 1, 1).to(x.dtype)
        sd2 = self.sigma_data**2
        c_skip = sd2 / (sigma**2 + sd2)
        c_out = sigma * self.sigma_data / (sigma**2 + sd2).sqrt()
        c_in = 1 / (sd2 + sigma**2).sqrt()
        c_noise = sigma.log().flatten() / 4
        f = condition.call(self.net, c_in * x, c_noise, labels) if augment_labels is None else \
            condition.call(self.net, c_in * x, c_noise, labels, augment_labels)
        denoised = c_skip * x + c_out * f.to(x.dtype)
        return (denoised, self.net.logvar(c_noise).to(x.dtype)) if return_logvar else denoised


def build(model_cfg: dict, resolution: int, num_classes: int, in_channels: int = 3, text: dict | None = None) -> Denoiser:
    """The network described by a `model` section (a plain dict, as stored in checkpoints), preconditioned;
    `text`: a text run's dims, given to the network's builder as text= (nets' contract).

    Callers pass the section of the run's config; a snapshot's own record is only compared with it
    (checkpoint.load_snapshot), so a file never decides which code runs.
    """
    arch, kwargs = nets.arch_kwargs(model_cfg)
    classes = num_classes if model_cfg["class_conditional"] else 0
    return Denoiser(registry.build_network(arch, kwargs, resolution, in_channels, classes, text=text),
                    sigma_data=model_cfg["sigma_data"])


def loss(net, images, labels, rnd_normal, noise, p_mean: float, p_std: float, sigma_data: float,
         uncertainty: bool = False, augment_labels=None, weights=None):
    """Weighted denoising loss at log-normal noise levels.

    rnd_normal (B,) and noise (B, C, H, W) are standard normal draws made by the caller (see
    draw_noise), so they resume exactly and do not depend on how the batch is split. With `uncertainty`
    (edm2's network) each level's loss is divided by exp(u(sigma)) and u(sigma) added, u learned by the network:
    edm2's EDM2Loss (paper Eq. 21), per element here as EDM's is. augment_labels: those of EDM's augmentation pipe,
    which the caller has applied to `images` (EDM's loss too takes the clean images augmented).
    """
    sigma = (rnd_normal.reshape(-1, 1, 1, 1) * p_std + p_mean).exp()
    weight = (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2
    aug = {} if augment_labels is None else {"augment_labels": augment_labels}
    if not uncertainty:
        denoised = net(images + noise * sigma, sigma, labels, **aug)
        return reduce.mean(weight * (denoised - images) ** 2, weights)
    denoised, logvar = net(images + noise * sigma, sigma, labels, return_logvar=True, **aug)
    return reduce.mean((weight / logvar.exp()) * (denoised - images) ** 2 + logvar, weights)


def draw_noise(generator: torch.Generator, count: int, shape, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rnd_normal (count,), noise (count, *shape)) from one generator, made on `device`.

    Two batched draws, no Python object per sample: the caller seeds `generator` once per step
    and draws the whole global batch, so row i is the same whatever the process count.
    """
    rnd = torch.randn(count, generator=generator, device=device)
    return rnd, torch.randn(count, *shape, generator=generator, device=device)


def sigma_steps(num_steps: int, device=None, sigma_min: float = SIGMA_MIN, sigma_max: float = SIGMA_MAX,
                rho: float = RHO) -> torch.Tensor:
    """Noise levels from sigma_max down to sigma_min spaced by the rho schedule, then 0."""
    i = torch.arange(num_steps, dtype=torch.float64, device=device)
    t = (sigma_max ** (1 / rho) + i / max(num_steps - 1, 1) * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    return torch.cat([t, torch.zeros(1, dtype=torch.float64, device=device)])


@torch.no_grad()
def sample(net, latents, labels=None, num_steps: int = 18, solver: str = "heun",
           settings: SamplerSettings = SamplerSettings(), noise=None, unguided=None, interval=None):
    """From latents ~ N(0, 1) to images in about [-1, 1]: the probability-flow ODE, or with settings.S_churn > 0
    EDM's stochastic sampler. noise(shape) gives the churn noise (float64, one stream per image: the caller's
    per-seed generators, so an image does not depend on its batch); drawn at every step, as edm_sampler does,
    each asked for a step ahead (draws.ahead).

    interval = (lo, hi): `net` (the guided denoiser) only at steps whose noise level lo <= t <= hi, `unguided`
    elsewhere (Kynkaanniemi et al. 2024). Decided once per step by the step's level before churn, for both
    of Heun's evaluations, as REPA's samplers.py decides by t_cur."""
    st = settings
    t = sigma_steps(num_steps, latents.device, st.sigma_min, st.sigma_max, st.rho)
    # The gates compare the levels as Python floats, read once here: an `if` on a device tensor waits for the GPU
    # at every step. The arithmetic keeps t's tensors, so no device computes other bits (CUDA divides by a host
    # scalar through its reciprocal).
    levels = t.tolist()
    s_max = math.inf if st.S_max is None else st.S_max
    x = latents.to(torch.float64) * t[0]
    draws = ahead(noise, x.shape, num_steps if st.S_churn > 0 else 0)
    guided = net
    for i in range(num_steps):
        t_cur, t_next = t[i], t[i + 1]
        if interval is not None:
            net = guided if interval[0] <= levels[i] <= interval[1] else unguided
        if st.S_churn > 0:
            gamma = min(st.S_churn / num_steps, math.sqrt(2) - 1) if st.S_min <= levels[i] <= s_max else 0.0
            t_hat = t_cur + gamma * t_cur
            x = x + (t_hat**2 - t_cur**2).sqrt() * st.S_noise * next(draws)
            t_cur = t_hat
        d = (x - net(x.float(), t_cur.float().expand(x.shape[0]), labels).double()) / t_cur
        x_next = x + (t_next - t_cur) * d
        if solver == "heun" and i < num_steps - 1:
            d2 = (x_next - net(x_next.float(), t_next.float().expand(x.shape[0]), labels).double()) / t_next
            x_next = x + (t_next - t_cur) * (0.5 * d + 0.5 * d2)
        x = x_next
    return x.float()
