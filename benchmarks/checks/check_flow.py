"""Our flow objective (diffrelay.objectives.flow) against SiT's transport/ and REPA's samplers.py.

  pip install torchdiffeq   # SiT's transport/integrators.py imports it (its ODE solver)
  python benchmarks/checks/check_flow.py --sit-src /tmp/SiT --repa-src /tmp/REPA

--sit-src is a checkout of github.com/willisma/SiT, --repa-src one of github.com/sihyun-yu/REPA. Their code is
imported from those folders at run time; nothing of it enters the package. Both sides get the same tiny seeded
network (our class-conditional UNet as a flow VelocityModel), the same images, times, latents and noise: one
CPU generator per image seeded by the image's seed (latent first, then one float64 draw per stochastic step),
fed to the official code by replacing torch's global draws while it runs.

Conventions mapped here (and written down in objectives/flow.py): SiT's time s runs from noise (0) to data (1)
and its network predicts x1 - x0 (data minus noise); ours t = 1 - s and v = noise - data. So SiT's model is
ours called as -v(x, 1 - s). REPA uses our convention directly, with its null class 1000 mapped to ours.

Cases (max abs difference of the float32 outputs):
  sit-loss:        Transport.training_losses (Linear, velocity) vs flow.loss at the same t and noise
  sit-ode-euler:   Sampler.sample_ode(euler, N) vs flow.sample(euler, N - 1 steps)
  sit-sde:         Sampler.sample_sde(Euler-Maruyama, diffusion 'sigma', last step 'Mean' 0.04) vs solver sde
  repa-euler/heun: euler_sampler with CFG 1.8 inside [0, 0.7] vs flow.sample with the same guidance interval
  repa-sde:        euler_maruyama_sampler, same guidance
Bounds (BOUNDS below, also written to the JSON and beside each case): about 10x each case's float32 rounding seen
(2.4e-7 to 1.1e-6). Exit status 1, one line per case outside its bound.
Writes benchmarks/results/flow.json. Not a test: CI cannot fetch the official sources.
"""

import argparse
import contextlib
import importlib.util
import sys
from pathlib import Path

import torch
from official import RESULTS, Gate, write_results

from diffrelay import config, objectives
from diffrelay.objectives import flow
from diffrelay.sampling import guidance

CLASSES, SEEDS, SHAPE = 10, [0, 1, 2, 3], (3, 16, 16)
RANDN = torch.randn  # ours, before global_draws replaces torch's
# Each case's bound: the same float32 network on both sides, the official code doing the arithmetic in its own order
# (and SiT's SDE in float64), so float32 rounding: about 10x what was seen.
BOUNDS = {"sit-loss": 3e-6, "sit-ode-euler": 1e-5, "sit-sde": 5e-6,  # 2.4e-7, 7.2e-7, 4.2e-7 seen
          "repa-euler": 1e-5, "repa-heun": 6e-6, "repa-sde": 2e-5}  # 7.2e-7, 6.0e-7, 1.1e-6 seen


def tiny_velocity_model():
    model = config.validate({"model": {"objective": "flow", "channels": 16, "channel_mult": [1, 2],
                                       "class_conditional": True}})["model"]
    torch.manual_seed(0)
    net = objectives.build(model, resolution=16, num_classes=CLASSES).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # random everywhere, zero-initialised layers too
    return net


def streams():
    gens = [torch.Generator().manual_seed(s) for s in SEEDS]
    latents = torch.stack([torch.randn(SHAPE, generator=g) for g in gens])

    def draw(*_args, **_kwargs):
        return torch.stack([RANDN(SHAPE, generator=g, dtype=torch.float64) for g in gens])

    return latents, draw


@contextlib.contextmanager
def global_draws(draw):
    """torch.randn / randn_like of the official code return our per-image streams while it runs."""
    saved = torch.randn, torch.randn_like
    torch.randn = lambda *a, **k: draw()
    torch.randn_like = lambda *a, **k: draw()
    try:
        yield
    finally:
        torch.randn, torch.randn_like = saved


def load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def diff(a, b) -> float:
    return (a.float().double() - b.float().double()).abs().max().item()


def check_sit(src: Path, net, labels) -> dict:
    sys.path.insert(0, str(src))
    try:
        from transport import Sampler, create_transport
    except ModuleNotFoundError as e:
        raise SystemExit(f"check_flow: importing SiT's transport failed ({e}); pip install torchdiffeq") from e
    transport = create_transport("Linear", "velocity", None, None, None)  # SiT's train.py defaults

    def sit_model(x, s, y):  # SiT's time and sign convention around our network
        return -net(x.float(), (1 - s).float(), y).to(x.dtype)

    out = {}
    g = torch.Generator().manual_seed(7)
    x1 = torch.randn(len(SEEDS), *SHAPE, generator=g)
    eps = torch.randn(len(SEEDS), *SHAPE, generator=g)
    t = torch.rand(len(SEEDS), generator=g)
    transport.sample = lambda data: (1 - t, eps, data)  # SiT draws s ~ U(0, 1) and x0 ~ N(0, 1) here
    with torch.no_grad():
        theirs = transport.training_losses(sit_model, x1, dict(y=labels))["loss"]
        # ours at the same t: rnd_normal is the normal quantile of t (flow.time_from_normal inverts it)
        rnd = torch.special.ndtri(t.double()).float()
        ours = torch.stack([flow.loss(net, x1[i:i + 1], labels[i:i + 1], rnd[i:i + 1], eps[i:i + 1],
                                      flow.TrainSettings()) for i in range(len(SEEDS))])
    out["sit-loss"] = {"max_abs_diff": diff(ours, theirs), "loss": theirs.mean().item()}
    sampler = Sampler(transport)
    n = 12
    z, draw = streams()
    with torch.no_grad():
        theirs = sampler.sample_ode(sampling_method="euler", num_steps=n)(z, sit_model, y=labels)[-1]
        ours = flow.sample(net, z, labels, num_steps=n - 1, solver="euler")
    out["sit-ode-euler"] = {"steps": n - 1, "max_abs_diff": diff(ours, theirs), "image_std": theirs.std().item()}
    z, draw = streams()
    with torch.no_grad(), global_draws(draw):
        theirs = sampler.sample_sde(sampling_method="Euler", diffusion_form="sigma", last_step="Mean",
                                    last_step_size=0.04, num_steps=n)(z.double(), sit_model, y=labels)[-1]
    z, draw = streams()
    with torch.no_grad():
        ours = flow.sample(net, z, labels, num_steps=n, solver="sde", noise=draw)
    out["sit-sde"] = {"steps": n, "max_abs_diff": diff(ours, theirs), "image_std": theirs.std().item()}
    return out


def check_repa(src: Path, net, labels) -> dict:
    repa = load_module(src / "samplers.py", "repa_samplers")

    def repa_model(x, t, y):  # REPA's null class is 1000; ours is the class count
        y = torch.where(y == 1000, torch.full_like(y, CLASSES), y)
        return net(x.float(), t.float(), y).to(x.dtype), None

    scale, interval = 1.8, (0.0, 0.7)  # REPA's README: cfg 1.8, guidance-high 0.7
    guided = guidance.guided(net, scale, null=CLASSES)
    out, n = {}, 10
    for name, heun in (("repa-euler", False), ("repa-heun", True)):
        z, _ = streams()
        with torch.no_grad():
            theirs = repa.euler_sampler(repa_model, z, labels, num_steps=n, heun=heun, cfg_scale=scale,
                                        guidance_low=interval[0], guidance_high=interval[1])
            ours = flow.sample(guided, z, labels, num_steps=n, solver="heun" if heun else "euler",
                               unguided=net, interval=interval)
        out[name] = {"steps": n, "cfg": scale, "interval": interval, "max_abs_diff": diff(ours, theirs)}
    z, draw = streams()
    with torch.no_grad(), global_draws(draw):
        theirs = repa.euler_maruyama_sampler(repa_model, z, labels, num_steps=n, cfg_scale=scale,
                                             guidance_low=interval[0], guidance_high=interval[1])
    z, draw = streams()
    with torch.no_grad():
        ours = flow.sample(guided, z, labels, num_steps=n, solver="sde", noise=draw, unguided=net, interval=interval)
    out["repa-sde"] = {"steps": n, "cfg": scale, "interval": interval, "max_abs_diff": diff(ours, theirs)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sit-src", type=Path, required=True)
    ap.add_argument("--repa-src", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=RESULTS / "flow.json")
    args = ap.parse_args()
    net = tiny_velocity_model()
    labels = torch.tensor([0, 3, 7, 9])
    cases = check_sit(args.sit_src, net, labels) | check_repa(args.repa_src, net, labels)
    g = Gate()
    for name, r in cases.items():
        r["bound"] = BOUNDS[name]
        g.at_most(name, r["max_abs_diff"], r["bound"])
        print(f"{name:16s} max |ours - official| = {r['max_abs_diff']:.3g} (bound {r['bound']:.0e})")
    write_results(args.out, "diffrelay objectives.flow vs SiT transport/ and REPA samplers.py, same net and draws",
                  cases=cases, gate=g.to_json())
    g.finish("check_flow")


if __name__ == "__main__":
    main()
