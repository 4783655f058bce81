"""Flow matching with the linear interpolant and velocity prediction (SiT, REPA, LightningDiT, SD3).

Convention (REPA's loss.py and samplers.py; SD3): t runs from 0 (data) to 1 (noise),
    x_t = (1 - t) x + t eps,    the network predicts v = d x_t / d t = eps - x,
and the network's time input (c_noise in the diffrelay.nets contract) is t itself, in [0, 1]. SiT's
transport/ uses the mirror image: its s = 1 - t runs from noise to data and its velocity is x - eps (the
same network up to the sign of its output and s -> 1 - s; benchmarks/checks/check_flow.py maps one onto the other).

Training draws one standard normal n per sample (the loader's draw, as EDM's ln sigma) and makes t from it:
  uniform:    t = Phi(n), the normal CDF, so t ~ U(0, 1) (SiT's t ~ U(0, 1));
  lognormal:  t = sigmoid(mean + std n), the logit-normal of SD3 and REPA's "lognormal" weighting;
then the timestep shift of SD3 / LightningDiT, t <- shift t / (1 + (shift - 1) t) (shift > 1: more noise).
The loss is SiT's for velocity: the mean over pixels of (v_pred - (eps - x))^2, averaged over the batch.

Samplers, from t = 1 (x = eps) to t = 0, on the grid shifted the same way:
  euler, heun:  the probability-flow ODE dx/dt = v, N steps on linspace(1, 0, N + 1) (REPA's euler_sampler;
                heun adds the correction at t_next except on the last step);
  sde:          SiT's Euler-Maruyama sampler with diffusion form "sigma" (its sample.py default) and last step
                "Mean" of size 0.04: N - 1 stochastic steps on linspace(1, last_step, N), drift
                v - (w / 2) score with w(t) = 2 t and score = ((t - 1) v - x) / t, noise sqrt(w |dt|), then one
                mean step to 0 (REPA's euler_maruyama_sampler is the same sampler).
"""

import dataclasses
import math

import torch
from torch import nn

from diffrelay.objectives import reduce
from diffrelay.objectives.draws import ahead
from diffrelay.text import condition

SOLVERS = ("euler", "heun", "sde")


class VelocityModel(nn.Module):
    """v(x_t, t) = F(x_t, t, labels): no preconditioning; F's time input is t in [0, 1]. labels may be a
    text.condition.Text, given to F as text= (condition.call)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net  # the raw network F of the diffrelay.nets contract

    def forward(self, x, t, labels=None):
        return condition.call(self.net, x, t.reshape(-1).to(x.dtype), labels).to(x.dtype)


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """train.flow: how t is drawn."""

    time: str = "uniform"  # uniform | lognormal
    mean: float = 0.0
    std: float = 1.0
    shift: float = 1.0
    precondition_outputs: bool = False


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """sample.flow: the grid's shift and the SDE's last step."""

    shift: float = 1.0
    last_step: float = 0.04
    guided_channels: int | None = None  # read by the guidance around the sampler (sampling/sample.py)

    def changed(self) -> dict:
        default = SamplerSettings()
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


def shift_time(t, shift: float):
    """SD3's timestep shift; shift 1 is the identity, bit for bit."""
    return t if shift == 1 else shift * t / (1 + (shift - 1) * t)


def time_from_normal(rnd, st: TrainSettings):
    """t in [0, 1] from standard normal draws (one a sample)."""
    if st.time == "uniform":
        t = 0.5 * (1 + torch.erf(rnd / math.sqrt(2)))  # the normal CDF
    else:
        t = torch.sigmoid(st.mean + st.std * rnd)
    return shift_time(t, st.shift)


def loss(net, images, labels, rnd_normal, noise, st: TrainSettings, weights=None):
    """SiT's velocity loss at times drawn from rnd_normal (B,), with noise (B, C, H, W) from the caller; with
    precondition_outputs, the loss on the x0 the velocity implies, as train_dreambooth_lora_sd3.py writes it
    (model_pred * (-sigmas) + noisy_model_input against model_input: t^2 x the velocity loss)."""
    t = time_from_normal(rnd_normal, st).reshape(-1, 1, 1, 1)
    x_t = (1 - t) * images + t * noise
    v = net(x_t, t.flatten(), labels)
    if st.precondition_outputs:
        return reduce.mean((v * (-t) + x_t - images) ** 2, weights)
    return reduce.mean((v - (noise - images)) ** 2, weights)


def _score(v, x, t):
    # The score of p_t from the velocity under x_t = (1 - t) x + t eps (REPA's get_score_from_velocity).
    return ((t - 1) * v - x) / t


@torch.no_grad()
def sample(net, latents, labels=None, num_steps: int = 50, solver: str = "heun",
           settings: SamplerSettings = SamplerSettings(), noise=None, unguided=None, interval=None):
    """From latents ~ N(0, 1) at t = 1 to images at t = 0. noise(shape) gives the SDE's draws (float64, one
    stream per image), each asked for a step ahead (draws.ahead). interval = (lo, hi) in t: `net` (guided) at
    the steps with lo <= t_cur <= hi, `unguided` elsewhere, decided per step as REPA does."""
    st, dev = settings, latents.device
    guided = net

    def v(x, t):
        return net(x.float(), t.float().expand(x.shape[0]), labels).double()

    x = latents.to(torch.float64)
    if solver in ("euler", "heun"):
        grid = shift_time(torch.linspace(1, 0, num_steps + 1, dtype=torch.float64, device=dev), st.shift)
        levels = grid.tolist()  # the gate's Python floats, read once (as in edm.sample)
        for i in range(num_steps):
            t_cur, t_next = grid[i], grid[i + 1]
            if interval is not None:
                net = guided if interval[0] <= levels[i] <= interval[1] else unguided
            d = v(x, t_cur)
            x_next = x + (t_next - t_cur) * d
            if solver == "heun" and i < num_steps - 1:
                x_next = x + (t_next - t_cur) * (0.5 * d + 0.5 * v(x_next, t_next))
            x = x_next
        return x.float()
    grid = shift_time(torch.linspace(1, st.last_step, num_steps, dtype=torch.float64, device=dev), st.shift)
    grid = torch.cat([grid, torch.zeros(1, dtype=torch.float64, device=dev)])
    levels = grid.tolist()  # the gate's Python floats, read once; the arithmetic keeps grid's tensors (edm.sample)
    draws = ahead(noise, x.shape, num_steps - 1)
    for i in range(num_steps):
        t_cur, t_next = grid[i], grid[i + 1]
        if interval is not None:
            net = guided if interval[0] <= levels[i] <= interval[1] else unguided
        dt, w = t_next - t_cur, 2 * t_cur
        vel = v(x, t_cur)
        drift = vel - 0.5 * w * _score(vel, x, t_cur)
        if i < num_steps - 1:
            x = x + drift * dt + w.sqrt() * (next(draws) * dt.abs().sqrt())
        else:  # the last step, to t = 0, is the mean step: no noise
            x = x + dt * drift
    return x.float()
