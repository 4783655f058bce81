"""Our EDM sampler (diffrelay.objectives.edm.sample) against NVlabs/edm's edm_sampler, with churn and without.

  python benchmarks/checks/check_edm_sampler.py --edm-src /tmp/edmsrc [--edm2-src /tmp/edm2src]

--edm-src is a checkout of github.com/NVlabs/edm (e.g. `git archive HEAD | tar -x`). Only the function
edm_sampler is taken from its generate.py (read with ast and run with torch and numpy, so its other imports
are not needed); nothing of it enters the package. Both samplers get the same tiny seeded random network (our
EDM-preconditioned UNet, class-conditional), the same latents and the same churn noise: one CPU generator
per image seeded by the image's seed, latents first, then one float64 draw per step, as edm's
StackedRandomGenerator gives them. Reported: the max abs difference of the final images (float64), per case.
With --edm2-src (a checkout of github.com/NVlabs/edm2), also autoguidance: our sampler guided by a second,
weaker tiny network (guidance.autoguided) against edm2's generate_images.py edm_sampler(net, ..., gnet, guidance)
run in float64, deterministic and with edm2's churn.
Bounds (BOUNDS below, also written to the JSON and beside each case): 0 for edm's cases (the same float64 steps
in the same order: bit for bit, as seen); autoguidance about 10x its float32 rounding seen (4.8e-7, 1.7e-6: edm2
mixes the two denoisers in float64, ours in float32). Exit status 1, one line per case outside its bound.
--cases runs some of the cases only (tests/test_check_scripts.py runs one against a stand-in generate.py).
Writes benchmarks/results/edm_sampler.json. Not a test: CI cannot fetch the official source.
"""

import argparse
import ast
import math
from pathlib import Path

import numpy as np
import torch
from official import RESULTS, Gate, write_results

from diffrelay import config
from diffrelay.objectives import edm

CASES = {  # name: (steps, sampler settings); ImageNet-64's tuned churn is Table 5 of the EDM paper
    "ode-18": (18, edm.SamplerSettings()),
    "ode-6-sigma-rho": (6, edm.SamplerSettings(sigma_min=0.01, sigma_max=40.0, rho=5.0)),
    "churn-imagenet64-18": (18, edm.SamplerSettings(S_churn=40, S_min=0.05, S_max=50, S_noise=1.003)),
    "churn-all-levels-8": (8, edm.SamplerSettings(S_churn=80, S_noise=1.0)),
}
# Each case's bound. edm's: 0, both run the same float64 steps around the same float32 network. Autoguidance:
# edm2 mixes the two denoisers' outputs in float64, ours in float32 (guidance.autoguided), so float32 rounding.
BOUNDS = {"ode-18": 0.0, "ode-6-sigma-rho": 0.0, "churn-imagenet64-18": 0.0, "churn-all-levels-8": 0.0,
          "autoguidance-32-g2": 5e-6, "autoguidance-12-g1.4-churn": 2e-5}  # 4.8e-7, 1.7e-6 seen


def official_sampler(src: Path, file: str = "generate.py"):
    """edm_sampler from edm's generate.py (edm2's generate_images.py), compiled alone."""
    tree = ast.parse((src / file).read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "edm_sampler")
    namespace = {"torch": torch, "np": np}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(src / file), "exec"), namespace)
    return namespace["edm_sampler"]


class OfficialNet:
    """What edm_sampler expects of its net (EDMPrecond's interface) around our denoiser."""

    sigma_min, sigma_max = 0.0, math.inf

    def __init__(self, denoiser):
        self.denoiser = denoiser

    def round_sigma(self, sigma):
        return torch.as_tensor(sigma)

    def __call__(self, x, sigma, labels):
        sigma = torch.as_tensor(sigma, dtype=torch.float64).reshape(-1).expand(x.shape[0])
        return self.denoiser(x.float(), sigma.float(), labels)


def streams(seeds, shape):
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    latents = torch.stack([torch.randn(shape, generator=g) for g in gens])

    def draw(size, dtype=torch.float64):
        return torch.stack([torch.randn(size[1:], generator=g, dtype=dtype) for g in gens])

    return latents, draw


def check_autoguidance(src: Path, net, model: dict, labels, seeds, shape, wanted) -> dict:
    """Ours (guidance.autoguided around edm.sample) against edm2's edm_sampler with gnet, in float64."""
    from diffrelay.sampling import guidance

    edm2_sampler = official_sampler(src, "generate_images.py")
    torch.manual_seed(1)
    weak = edm.build(model | {"channels": 8}, resolution=16, num_classes=10).eval()  # smaller, as edm2's XS
    with torch.no_grad():
        for p in weak.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    results = {}
    for name, steps, scale, st in (("autoguidance-32-g2", 32, 2.0, edm.SamplerSettings()),
                                   ("autoguidance-12-g1.4-churn", 12, 1.4, edm.SamplerSettings(S_churn=20, S_noise=1.003))):
        if name not in wanted:
            continue
        z, draw = streams(seeds, shape)
        with torch.no_grad():
            ours = edm.sample(guidance.autoguided(net, weak, scale), z, labels, num_steps=steps, solver="heun",
                              settings=st, noise=draw).double()
        z, draw = streams(seeds, shape)
        s_max = math.inf if st.S_max is None else st.S_max
        # edm2 draws churn noise only at steps inside [S_min, S_max]; edm, and so ours, at every step: the
        # streams line up where every step is inside, as in this case (S_min 0, no S_max).
        with torch.no_grad():
            theirs = edm2_sampler(OfficialNet(net), z, labels, gnet=OfficialNet(weak), num_steps=steps,
                                  guidance=scale, S_churn=st.S_churn, S_min=st.S_min, S_max=s_max,
                                  S_noise=st.S_noise, dtype=torch.float64,
                                  randn_like=lambda x: draw(x.shape, x.dtype))
        diff = (ours - theirs.float().double()).abs().max().item()
        results[name] = {"steps": steps, "guidance": scale, "settings": st.changed(), "max_abs_diff": diff,
                         "bound": BOUNDS[name], "image_std": theirs.std().item()}
        print(f"{name:28s} steps {steps:2d}  max |ours - edm2| = {diff:.3g} (bound {BOUNDS[name]:.0e})  "
              f"(image std {theirs.std().item():.3g})")
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--edm-src", type=Path, required=True)
    ap.add_argument("--edm2-src", type=Path, help="also check autoguidance against edm2's edm_sampler")
    ap.add_argument("--cases", default=",".join(BOUNDS),
                    help=f"comma-separated, of {', '.join(BOUNDS)} (default: all; autoguidance needs --edm2-src)")
    ap.add_argument("--out", type=Path, default=RESULTS / "edm_sampler.json")
    args = ap.parse_args()
    wanted = args.cases.split(",")
    if unknown := set(wanted) - set(BOUNDS):
        ap.error(f"unknown --cases {sorted(unknown)}; known: {', '.join(BOUNDS)}")
    edm_sampler = official_sampler(args.edm_src)
    model = config.validate({"model": {"channels": 16, "channel_mult": [1, 2], "class_conditional": True}})["model"]
    torch.manual_seed(0)
    net = edm.build(model, resolution=16, num_classes=10).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # random everywhere, zero-initialised layers too
    seeds, shape = [0, 1, 2, 3], (3, 16, 16)
    labels = torch.tensor([0, 3, 7, 10])  # 10 = the null class of a 10-class network
    results = {}
    for name, (steps, st) in CASES.items():
        if name not in wanted:
            continue
        z, draw = streams(seeds, shape)
        with torch.no_grad():
            ours = edm.sample(net, z, labels, num_steps=steps, solver="heun", settings=st, noise=draw).double()
        z, draw = streams(seeds, shape)
        s_max = math.inf if st.S_max is None else st.S_max
        with torch.no_grad():
            theirs = edm_sampler(OfficialNet(net), z, labels, randn_like=lambda x: draw(x.shape, x.dtype),
                                 num_steps=steps, sigma_min=st.sigma_min, sigma_max=st.sigma_max, rho=st.rho,
                                 S_churn=st.S_churn, S_min=st.S_min, S_max=s_max, S_noise=st.S_noise)
        # ours returns float32 images; the official float64 result is compared after the same cast
        diff = (ours - theirs.float().double()).abs().max().item()
        results[name] = {"steps": steps, "settings": st.changed(), "max_abs_diff": diff, "bound": BOUNDS[name],
                         "image_std": theirs.std().item()}
        print(f"{name:24s} steps {steps:2d}  max |ours - edm| = {diff:.3g} (bound {BOUNDS[name]:.0e})  "
              f"(image std {theirs.std().item():.3g})")
    if args.edm2_src:
        results |= check_autoguidance(args.edm2_src, net, model, labels, seeds, shape, wanted)
    g = Gate()
    for name, r in results.items():
        g.at_most(name, r["max_abs_diff"], r["bound"])
    write_results(args.out, "diffrelay edm.sample vs NVlabs/edm generate.py edm_sampler (and edm2's, for autoguidance), "
                   "same nets and draws",
                  cases=results, gate=g.to_json())
    g.finish("check_edm_sampler")


if __name__ == "__main__":
    main()
