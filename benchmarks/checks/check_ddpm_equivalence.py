"""Our DDPM objective (diffrelay.objectives.ddpm) against facebookresearch/DiT's diffusion code, same draws.

  python benchmarks/checks/check_ddpm_equivalence.py --dit-src /tmp/DiT

--dit-src is a checkout of github.com/facebookresearch/DiT; its diffusion/ package (create_diffusion,
gaussian_diffusion.py, respace.py) is imported from there at run time and nothing of it enters the package.
Both sides run the same tiny network (diffrelay.nets.dit, proven equal to DiT's models.py by
check_dit_equivalence.py): every parameter moved by seeded noise so that the zero-initialised adaLN and output
layers matter, and the learned-sigma half passed through tanh (identically on both sides) so that it stays in
[-1, 1] as a trained DiT's does. The official side gets the network's forward_all (all 2C channels, DiT's
output), ours the same module through ddpm.EpsModel. float32 on the CPU.

Cases:
  respacing:  ddpm.respaced(n) against sorted(space_timesteps(1000, str(n))) for every n in 1..1000
  schedules:  ddpm._Chain() and _Chain(respaced(n)) for n = 250, 25 against SpacedDiffusion's float64 arrays
              (alphas_cumprod, alphas_cumprod_prev, betas, posterior_log_variance_clipped, posterior_mean_coef1/2,
              the fixed-large log variance log(append(posterior_variance[1], betas[1:]))): max abs difference
  loss:       create_diffusion("").training_losses(...)["loss"].mean() against ddpm.loss with rnd_normal chosen so
              that our timesteps are DiT's t (t = 0, the decoder NLL, and t = 999 among them; the t our network
              sees is checked against DiT's): loss difference and the max abs difference of every parameter's
              gradient; learned sigma and (learn_sigma=False) without
  samplers:   p_sample_loop / ddim_sample_loop (eta 0 and 1) against ddpm.sample, from the same latents, with
              the per-step noise DiT draws (torch.randn_like, patched to hand out a fixed list) given to ours in
              the same order (ours draws none at the last step, DiT draws one there and masks it): max abs
              difference of the final samples (ours runs in float64, DiT in float32, so not 0: the bound)
  cfg:        DiT's sample.py guidance (models.py forward_with_cfg on the first 3 channels, cfg_scale 4) against
              sampling.guidance.guided(..., channels=3); run only where guided takes `channels`, and needs
              timm importable for DiT's models.py (pip install --no-deps timm)
Bounds (the dicts below, also written to the JSON): respacing, betas, alphas_cumprod, loss and gradients 0 (bit for
bit, as seen); the other float64 schedule arrays 1e-14 (2.2e-16 seen: last-bit rounding); each sampler about 10x
its own float32 rounding seen (3.6e-7 to 5.8e-6); cfg 4e-6 (3.6e-7 seen), and guiding every channel instead must
differ by at least 1e-3 (0.028 seen), or the case could not tell. A cfg case that could not run fails too. Exit
status 1, one line per figure outside its bound.
Writes benchmarks/results/ddpm_equivalence.json. Not a test: CI cannot fetch the official sources.
"""

import argparse
import contextlib
import importlib.util
import inspect
import sys
import time
from pathlib import Path

import numpy as np
import torch
from official import RESULTS, Gate, write_results
from torch import nn

from diffrelay.nets import dit
from diffrelay.objectives import ddpm
from diffrelay.sampling import guidance

RES, C, CLASSES = 8, 4, 10  # 8x8x4 latents, 10 classes (row 10: the null class)
DATA_STD = 0.5
SCHEDULE_BOUND = 1e-14  # float64 arrays computed in another order: last-bit rounding (2.2e-16 seen)
LOSS_BOUNDS = {"loss_abs_diff": 0.0, "max_abs_grad_diff": 0.0}  # bit for bit, as seen
# Ours samples in float64, DiT in float32: each case about 10x its float32 rounding seen.
SAMPLER_BOUNDS = {"ddpm-learned-sigma-250": 1e-5, "ddpm-learned-sigma-25": 4e-6,  # 9.5e-7, 3.6e-7 seen
                  "ddim-eta0-learned-sigma-250": 6e-5, "ddim-eta0-learned-sigma-25": 2e-5,  # 5.8e-6, 1.3e-6
                  "ddim-eta1-learned-sigma-25": 3e-5,  # 2.7e-6
                  "ddpm-fixed-large-250": 1e-5, "ddpm-fixed-large-25": 4e-6,  # 9.5e-7, 3.6e-7
                  "ddim-eta0-fixed-large-25": 2e-5}  # 1.3e-6
CFG_BOUND = 4e-6  # 3.6e-7 seen
CFG_ALL_CHANNELS_AT_LEAST = 1e-3  # guiding all 4 channels must differ (0.028 seen), or the case cannot tell


def official_diffusion(src: Path):
    """DiT's diffusion/ package under its own module name (its modules import each other relatively)."""
    root = src.resolve() / "diffusion"
    spec = importlib.util.spec_from_file_location("dit_diffusion", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["dit_diffusion"] = module
    spec.loader.exec_module(module)
    return module


def official_models(src: Path):
    spec = importlib.util.spec_from_file_location("dit_models", src.resolve() / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Net(nn.Module):
    """A tiny DiT of the nets contract whose learned-sigma half goes through tanh; records the timesteps it sees."""

    def __init__(self, learned_sigma: bool, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.in_channels, self.out_channels = C, 2 * C if learned_sigma else C
        self.dit = dit.build(RES, C, CLASSES, patch=2, depth=2, hidden_size=64, num_heads=4,
                             out_channels=self.out_channels, time_scale=1)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for p in self.dit.parameters():  # the zero-initialised adaLN and output layers too
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        self.seen = []

    def forward_all(self, x, t, labels=None):
        self.seen.append(t.detach().clone())
        out = self.dit.forward_all(x, t, labels)
        # eps: the exact one for data ~ N(0, DATA_STD^2) plus the network's, so that sampled trajectories stay
        # in range (a random eps alone makes x_0 = (x - sqrt(1 - abar) eps) / sqrt(abar) blow up near t = T).
        a = ddpm.alphas_cumprod()[t.long()].to(x.dtype).reshape(-1, 1, 1, 1)
        eps = (1 - a).sqrt() * x / (a * DATA_STD**2 + 1 - a) + 0.1 * out[:, :C]
        if self.out_channels == C:
            return eps
        return torch.cat([eps, torch.tanh(out[:, C:])], dim=1)

    def forward(self, x, t, labels=None):
        return self.forward_all(x, t, labels)[:, :C]


class Theirs(nn.Module):
    """The same network as DiT's diffusion code calls its model: model(x, t, y=...) -> every output channel."""

    def __init__(self, net: Net):
        super().__init__()
        self.net = net

    def forward(self, x, t, y=None):
        return self.net.forward_all(x, t.to(x.dtype), y)


@contextlib.contextmanager
def fixed_randn_like(draws: list[torch.Tensor]):
    """torch.randn_like handing out `draws` in order (DiT's samplers call th.randn_like(x) once per step)."""
    original, used = torch.randn_like, [0]

    def fake(x, *args, **kwargs):
        d = draws[used[0]]
        assert d.shape == x.shape, (d.shape, x.shape)
        used[0] += 1
        return d.to(x.dtype).clone()

    torch.randn_like = fake
    try:
        yield used
    finally:
        torch.randn_like = original


def stream(draws: list[torch.Tensor], rows=slice(None)):
    """Our sampler's noise(shape): the same draws in the same order, in float64."""
    used = [0]

    def noise(shape):
        d = draws[used[0]][rows].double()
        assert tuple(d.shape) == tuple(shape), (d.shape, shape)
        used[0] += 1
        return d

    return noise, used


def max_diff(a, b) -> float:
    return float((torch.as_tensor(np.asarray(a)) - torch.as_tensor(np.asarray(b))).abs().max())


def compare_respacing(respace) -> dict:
    bad = [n for n in range(1, ddpm.T + 1) if ddpm.respaced(n) != sorted(respace.space_timesteps(ddpm.T, str(n)))]
    return {"n": f"1..{ddpm.T}", "mismatches": bad}


def compare_schedules(diff) -> dict:
    gd = sys.modules["dit_diffusion.gaussian_diffusion"]
    base = gd.get_named_beta_schedule("linear", ddpm.T)
    out = {"betas": max_diff(ddpm.betas().numpy(), base),
           "alphas_cumprod": max_diff(ddpm.alphas_cumprod().numpy(), np.cumprod(1 - base))}
    for spacing in ("", "250", "25"):
        theirs = diff.create_diffusion(spacing)
        ours = ddpm._Chain(ddpm.respaced(int(spacing)) if spacing else None)
        assert ours.abar.shape[0] == theirs.num_timesteps
        large = np.log(np.append(theirs.posterior_variance[1], theirs.betas[1:]))
        pairs = {"abar": (ours.abar, theirs.alphas_cumprod), "abar_prev": (ours.abar_prev, theirs.alphas_cumprod_prev),
                 "beta": (ours.beta, theirs.betas), "log_beta": (ours.log_beta, np.log(theirs.betas)),
                 "log_var_small": (ours.log_var_small, theirs.posterior_log_variance_clipped),
                 "coef_x0": (ours.coef_x0, theirs.posterior_mean_coef1),
                 "coef_xt": (ours.coef_xt, theirs.posterior_mean_coef2), "log_var_large": (ours.log_var_large, large)}
        out[f"chain_{spacing or 'full'}"] = {k: max_diff(a.numpy(), b) for k, (a, b) in pairs.items()}
        steps = ddpm.respaced(int(spacing)) if spacing else list(range(ddpm.T))
        assert list(theirs.timestep_map) == steps, f"timestep_map of {spacing!r}"  # the timesteps the net sees
    return out


def compare_loss(diff, learned_sigma: bool) -> dict:
    net = Net(learned_sigma)
    g = torch.Generator().manual_seed(3)
    t = torch.tensor([0, 0, 1, 2, 37, 500, 998, 999])
    b = len(t)
    images = (torch.randn(b, C, RES, RES, generator=g) * 0.6).clamp(-1, 1)  # some at +-1: the decoder's edges
    noise = torch.randn(b, C, RES, RES, generator=g)
    labels = torch.tensor([0, 3, CLASSES, 7, 1, CLASSES, 9, 2])
    # Our t = floor(Phi(n) T): n = Phi^-1((t + 1/2) / T) lands in the middle of t's bin.
    rnd_normal = torch.special.ndtri((t.double() + 0.5) / ddpm.T).float()

    theirs = diff.create_diffusion("", learn_sigma=learned_sigma)
    net.seen.clear()
    want = theirs.training_losses(Theirs(net), images, t, model_kwargs=dict(y=labels), noise=noise)["loss"].mean()
    assert len(net.seen) == 1 and torch.equal(net.seen[0], t.float()), net.seen
    net.zero_grad(set_to_none=True)
    want.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}

    net.seen.clear()
    net.zero_grad(set_to_none=True)
    got = ddpm.loss(ddpm.EpsModel(net, C), images, labels, rnd_normal, noise)
    assert len(net.seen) == 1 and torch.equal(net.seen[0], t.float()), (net.seen, t)  # the same timesteps
    got.backward()
    grad_diff = max(float((p.grad - grads[n]).abs().max()) for n, p in net.named_parameters())
    grad_max = max(float(g.abs().max()) for g in grads.values())
    want, got = float(want.detach()), float(got.detach())
    return {"timesteps": t.tolist(), "loss_official": want, "loss_ours": got,
            "loss_abs_diff": abs(got - want), "max_abs_grad": grad_max,
            "max_abs_grad_diff": grad_diff, "parameters": len(grads)}


def compare_sampler(diff, learned_sigma: bool, solver: str, steps: int, eta: float = 0.0) -> dict:
    net = Net(learned_sigma)
    g = torch.Generator().manual_seed(4)
    b = 4
    z = torch.randn(b, C, RES, RES, generator=g)
    labels = torch.tensor([0, 5, 9, CLASSES])
    draws = [torch.randn(b, C, RES, RES, generator=g) for _ in range(steps)]
    theirs = diff.create_diffusion(str(steps), learn_sigma=learned_sigma)
    kw = dict(noise=z, clip_denoised=False, model_kwargs=dict(y=labels), device=z.device, progress=False)
    with torch.no_grad(), fixed_randn_like(draws) as used_theirs:
        if solver == "ddpm":
            want = theirs.p_sample_loop(Theirs(net), z.shape, **kw)
        else:
            want = theirs.ddim_sample_loop(Theirs(net), z.shape, eta=eta, **kw)
    assert used_theirs[0] == steps, used_theirs
    seen, net.seen = net.seen, []
    noise, used_ours = stream(draws)
    got = ddpm.sample(ddpm.EpsModel(net, C), z, labels, num_steps=steps, solver=solver,
                      settings=ddpm.SamplerSettings(eta=eta), noise=noise)
    stochastic = solver == "ddpm" or eta > 0
    assert used_ours[0] == (steps - 1 if stochastic else 0), used_ours
    assert len(seen) == len(net.seen) == steps and all(map(torch.equal, seen, net.seen)), "timesteps differ"
    return {"steps": steps, "max_abs_sample": float(want.abs().max()), "max_abs_diff": float((got - want).abs().max())}


def compare_cfg(diff, src: Path, steps: int = 25, scale: float = 4.0) -> dict:
    """DiT's sample.py: a doubled batch (labels, then the null class), model.forward_with_cfg guiding channels
    0..2 and taking the rest from the conditional rows, and the first half kept."""
    if "channels" not in inspect.signature(guidance.guided).parameters:
        return {"skipped": "sampling.guidance.guided takes no `channels` argument (sample.ddpm.guided_channels)"}
    try:
        models = official_models(src)
    except ImportError as e:
        return {"skipped": f"DiT's models.py (for forward_with_cfg) does not import: {e}"}
    net = Net(True)
    g = torch.Generator().manual_seed(5)
    b = 4
    z = torch.randn(b, C, RES, RES, generator=g)
    labels = torch.tensor([0, 5, 9, 3])
    draws = [torch.randn(2 * b, C, RES, RES, generator=g) for _ in range(steps)]

    class Shim:  # forward_with_cfg calls self.forward(x, t, y) only: DiT's forward, all channels
        forward = Theirs(net)

    def model(x, t, y, cfg_scale):
        return models.DiT.forward_with_cfg(Shim, x, t, y, cfg_scale)

    theirs = diff.create_diffusion(str(steps))
    kw = dict(y=torch.cat([labels, torch.full_like(labels, CLASSES)]), cfg_scale=scale)
    with torch.no_grad(), fixed_randn_like(draws):
        want = theirs.p_sample_loop(model, (2 * b, C, RES, RES), noise=torch.cat([z, z]), clip_denoised=False,
                                    model_kwargs=kw, device=z.device, progress=False).chunk(2)[0]
    got = {}
    for channels in (3, None):  # None: every channel guided, to show that the difference matters here
        noise, _ = stream(draws, slice(0, b))
        fn = guidance.guided(ddpm.EpsModel(net, C), scale, CLASSES, channels=channels)
        got[channels] = ddpm.sample(fn, z, labels, num_steps=steps, solver="ddpm", noise=noise)
    return {"steps": steps, "cfg_scale": scale, "guided_channels": 3, "max_abs_sample": float(want.abs().max()),
            "max_abs_diff": float((got[3] - want).abs().max()),
            "max_abs_diff_all_channels_guided": float((got[None] - want).abs().max())}


def gate(respacing: dict, schedules: dict, loss: dict, samplers: dict, cfg: dict) -> Gate:
    g = Gate()
    g.equal("respacing/mismatches", respacing["mismatches"], [])
    for name, r in schedules.items():
        if name.startswith("chain"):
            for key, value in r.items():
                g.at_most(f"schedule/{name}/{key}", value, SCHEDULE_BOUND)
        else:
            g.at_most(f"schedule/{name}", r, 0.0)
    for name, r in loss.items():
        for key, bound in LOSS_BOUNDS.items():
            g.at_most(f"loss/{name}/{key}", r[key], bound)
    for name, r in samplers.items():
        g.at_most(f"sample/{name}", r["max_abs_diff"], SAMPLER_BOUNDS[name])
    if "skipped" in cfg:  # not compared is not passed
        g.equal("cfg/compared", f"skipped: {cfg['skipped']}", "compared")
    else:
        g.at_most("cfg/max_abs_diff", cfg["max_abs_diff"], CFG_BOUND)
        g.at_least("cfg/max_abs_diff_all_channels_guided", cfg["max_abs_diff_all_channels_guided"],
                   CFG_ALL_CHANNELS_AT_LEAST)
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dit-src", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=RESULTS / "ddpm_equivalence.json")
    args = ap.parse_args()
    torch.set_num_threads(min(torch.get_num_threads(), 2))
    start = time.perf_counter()
    diff = official_diffusion(args.dit_src)
    respacing = compare_respacing(sys.modules["dit_diffusion.respace"])
    schedules = compare_schedules(diff)
    loss = {"learned-sigma": compare_loss(diff, True), "fixed-large": compare_loss(diff, False)}
    samplers = {"ddpm-learned-sigma-250": compare_sampler(diff, True, "ddpm", 250),
                "ddpm-learned-sigma-25": compare_sampler(diff, True, "ddpm", 25),
                "ddim-eta0-learned-sigma-250": compare_sampler(diff, True, "ddim", 250),
                "ddim-eta0-learned-sigma-25": compare_sampler(diff, True, "ddim", 25),
                "ddim-eta1-learned-sigma-25": compare_sampler(diff, True, "ddim", 25, eta=1.0),
                "ddpm-fixed-large-250": compare_sampler(diff, False, "ddpm", 250),
                "ddpm-fixed-large-25": compare_sampler(diff, False, "ddpm", 25),
                "ddim-eta0-fixed-large-25": compare_sampler(diff, False, "ddim", 25)}
    cfg = compare_cfg(diff, args.dit_src)

    print(f"respacing n = {respacing['n']}: {len(respacing['mismatches'])} mismatches {respacing['mismatches'][:10]}")
    print(f"schedule betas {schedules['betas']:.3g}, alphas_cumprod {schedules['alphas_cumprod']:.3g}")
    for name, r in schedules.items():
        if name.startswith("chain"):
            print(f"schedule {name:16s} max |ours - official| over {len(r)} arrays = {max(r.values()):.3g}  "
                  + " ".join(f"{k}={v:.3g}" for k, v in r.items() if v))
    for name, r in loss.items():
        print(f"loss {name:24s} official {r['loss_official']:.6f} ours {r['loss_ours']:.6f}  "
              f"|diff| {r['loss_abs_diff']:.3g}  max |grad diff| {r['max_abs_grad_diff']:.3g} "
              f"(max |grad| {r['max_abs_grad']:.3g})")
    for name, r in samplers.items():
        print(f"sample {name:26s} max |ours - official| = {r['max_abs_diff']:.3g} (max |x| {r['max_abs_sample']:.3g})")
    if "skipped" in cfg:
        print(f"cfg: skipped: {cfg['skipped']}")
    else:
        print(f"cfg scale {cfg['cfg_scale']} on {cfg['guided_channels']} channels: max |ours - official| = "
              f"{cfg['max_abs_diff']:.3g} (max |x| {cfg['max_abs_sample']:.3g}; all channels guided instead: "
              f"{cfg['max_abs_diff_all_channels_guided']:.3g})")
    seconds = time.perf_counter() - start
    print(f"{seconds:.1f} s")
    g = gate(respacing, schedules, loss, samplers, cfg)
    write_results(args.out, "diffrelay objectives.ddpm vs facebookresearch/DiT diffusion/ (create_diffusion), "
                  "same network, inputs and draws, float32 on the CPU", respacing=respacing, schedules=schedules,
                  loss=loss, samplers=samplers, cfg=cfg, seconds=round(seconds, 1), gate=g.to_json())
    g.finish("check_ddpm_equivalence")


if __name__ == "__main__":
    main()
