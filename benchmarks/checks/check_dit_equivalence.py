"""Our DiT (diffrelay.nets.dit) against facebookresearch/DiT's models.py, on the same weights.

  pip install --no-deps timm   # DiT's models.py imports PatchEmbed, Attention and Mlp from it
  python benchmarks/checks/check_dit_equivalence.py --dit-src /tmp/DiT [--sit-src /tmp/SiT]

--dit-src is a checkout of github.com/facebookresearch/DiT; its models.py is imported from there at run time
and nothing of it enters the package. For each case the official DiT is built with its own initialisation,
every parameter (its zero-initialised adaLN and output layers too) is then moved by seeded noise so that all
of them matter, and its state dict is loaded into ours through dit.official_keys. Both get the same inputs:
latents, integer timesteps (DiT's own; ours with time_scale 1) and labels, the null class among them.

Cases (max abs difference of the outputs, eval mode):
  tiny-learned-sigma:  depth 2, width 64, 4 heads, patch 2, 8x8x4 input, 10 classes, learn_sigma (the eps half:
                       ours drops the variance half; the variance half is compared through our unpatchified
                       full output too)
  tiny-patch4-fixed:   patch 4, 16x16x3 input, learn_sigma off
(float32 only: DiT's timestep_embedding casts to float32, so its network cannot run in float64.)
  position table:      ours against DiT's get_2d_sincos_pos_embed, 16x16 grid, width 1152
  parameter counts:    S/2, B/2, L/2, XL/2 at 32x32x4 with 1000 classes, both counted the same way
  sit-tiny-learned-sigma (with --sit-src, willisma/SiT models.py): our arch sit at time t against SiT's network
                       at its time s = 1 - t, negated (SiT's velocity is data minus noise), and SiT-XL/2's count
Bounds (BOUNDS below, also written to the JSON): 0 for every output (the same operations in the same order: bit
for bit) and the position table (float64 on both sides, then float32), parameter counts equal. Exit status 1, one line per figure outside its bound.
--cases runs some of the cases only (tests/test_check_scripts.py runs position-table against a stand-in models.py).
Writes benchmarks/results/dit_equivalence.json. Not a test: CI cannot fetch the official sources.
"""

import argparse
import importlib.util
from pathlib import Path

import torch
from official import RESULTS, Gate, write_results

from diffrelay.nets import dit, registry

CASE_NAMES = ("tiny-learned-sigma", "tiny-patch4-fixed", "position-table", "parameter-counts", "sit-tiny-learned-sigma")
# Each figure's bound: 0, as seen. Both networks run the same operations in the same order; both tables are
# computed in float64 and rounded to float32, where a last-bit difference of sin or cos does not survive.
BOUNDS = {"max_abs_diff": 0.0, "max_abs_diff_full_output": 0.0}


def official(src: Path, name: str):
    """models.py of a checkout (DiT's or SiT's: both call it models.py), under its own module name."""
    spec = importlib.util.spec_from_file_location(name, src.resolve() / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pair(models, *, input_size, in_channels, patch, depth, hidden, heads, classes, learn_sigma, dtype):
    torch.manual_seed(0)
    theirs = models.DiT(input_size=input_size, patch_size=patch, in_channels=in_channels, hidden_size=hidden,
                        depth=depth, num_heads=heads, num_classes=classes, learn_sigma=learn_sigma).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            if p.requires_grad:  # not pos_embed, the fixed table
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ours = dit.DiT(input_size, in_channels, classes, patch=patch, depth=depth, hidden_size=hidden, num_heads=heads,
                   out_channels=2 * in_channels if learn_sigma else in_channels, time_scale=1).eval()
    ours.load_state_dict(dit.official_keys(theirs.state_dict()))
    return theirs.to(dtype), ours.to(dtype)


def compare(models, dtype=torch.float32, **kw) -> dict:
    theirs, ours = pair(models, dtype=dtype, **kw)
    g = torch.Generator().manual_seed(2)
    n = 6
    x = torch.randn(n, kw["in_channels"], kw["input_size"], kw["input_size"], generator=g).to(dtype)
    t = torch.tensor([0, 1, 17, 250, 500, 999])  # DiT's integer timesteps
    y = torch.tensor([0, 3, kw["classes"], 7, kw["classes"], 9])  # the null class (label dropout's) twice
    with torch.no_grad():
        want = theirs(x, t, y)
        got = ours(x, t.to(dtype), y)
        full = ours.forward_all(x, t.to(dtype), y)  # both halves of the learned-sigma layout
    return {"output_shape": list(want.shape), "max_abs_output": float(want.abs().max()),
            "max_abs_diff": float((got - want[:, :kw["in_channels"]]).abs().max()),
            "max_abs_diff_full_output": float((full - want).abs().max())}


def compare_sit(sit_models) -> dict:
    """SiT's network at its time s against ours (arch sit) at t = 1 - s: ours is -SiT(x, 1 - t)."""
    torch.manual_seed(0)
    theirs = sit_models.SiT(input_size=8, patch_size=2, in_channels=4, hidden_size=64, depth=2, num_heads=4,
                            num_classes=10, learn_sigma=True).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ours = dit.build_sit(8, 4, 10, patch=2, depth=2, hidden_size=64, num_heads=4, out_channels=8).eval()
    ours.load_state_dict(dit.official_keys(theirs.state_dict()))
    x = torch.randn(6, 4, 8, 8, generator=g)
    t = torch.tensor([0.0, 0.02, 0.3, 0.5, 0.9, 1.0])  # ours: 0 = data, 1 = noise
    y = torch.tensor([0, 3, 10, 7, 10, 9])
    with torch.no_grad():
        want, got = -theirs(x, 1 - t, y), ours(x, t, y)
    with torch.device("meta"):
        counts = {"official": sum(p.numel() for p in sit_models.SiT_XL_2(input_size=32, num_classes=1000).parameters()),
                  "ours": registry.num_params(dit.build_sit(32, 4, 1000, size="XL", patch=2, out_channels=8))}
    return {"output_shape": list(want.shape), "max_abs_output": float(want.abs().max()),
            "max_abs_diff": float((got - want).abs().max()), "parameter_counts_SiT-XL/2": counts}


def gate(cases: dict) -> Gate:
    g = Gate()
    for name, r in cases.items():
        for key, bound in BOUNDS.items():
            if key in r:
                g.at_most(f"{name}/{key}", r[key], bound)
    counts = dict(cases.get("parameter-counts", {}))
    if "sit-tiny-learned-sigma" in cases:
        counts["SiT-XL/2"] = cases["sit-tiny-learned-sigma"]["parameter_counts_SiT-XL/2"]
    for name, c in counts.items():
        g.equal(f"parameter-counts/{name}", c["ours"], c["official"])
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dit-src", type=Path, required=True)
    ap.add_argument("--sit-src", type=Path, help="a checkout of github.com/willisma/SiT: adds the SiT case")
    ap.add_argument("--cases", default=",".join(CASE_NAMES),
                    help=f"comma-separated, of {', '.join(CASE_NAMES)} (default: all; the SiT one needs --sit-src)")
    ap.add_argument("--out", type=Path, default=RESULTS / "dit_equivalence.json")
    args = ap.parse_args()
    wanted = args.cases.split(",")
    if unknown := set(wanted) - set(CASE_NAMES):
        ap.error(f"unknown --cases {sorted(unknown)}; known: {', '.join(CASE_NAMES)}")
    models = official(args.dit_src, "dit_models")
    tiny = dict(input_size=8, in_channels=4, patch=2, depth=2, hidden=64, heads=4, classes=10, learn_sigma=True)
    cases = {}
    if "tiny-learned-sigma" in wanted:
        cases["tiny-learned-sigma"] = compare(models, **tiny)
    if "tiny-patch4-fixed" in wanted:
        cases["tiny-patch4-fixed"] = compare(models, **(tiny | dict(input_size=16, in_channels=3, patch=4,
                                                                   learn_sigma=False)))
    if "position-table" in wanted:
        want = torch.from_numpy(models.get_2d_sincos_pos_embed(1152, 16)).float()
        cases["position-table"] = {"grid": 16, "width": 1152,
                                   "max_abs_diff": float((dit._sincos_2d(16, 1152) - want).abs().max())}
    counts = {}
    if "parameter-counts" in wanted:
        for size in ("S", "B", "L", "XL"):
            with torch.device("meta"):
                theirs = models.DiT_models[f"DiT-{size}/2"](input_size=32, num_classes=1000)
                ours = dit.build(32, 4, 1000, size=size, patch=2, out_channels=8)
            counts[f"DiT-{size}/2"] = {"official": sum(p.numel() for p in theirs.parameters()),
                                       "ours": registry.num_params(ours)}
        cases["parameter-counts"] = counts
    if args.sit_src and "sit-tiny-learned-sigma" in wanted:
        cases["sit-tiny-learned-sigma"] = compare_sit(official(args.sit_src, "sit_models"))
        print(f"SiT-XL/2 parameters: {cases['sit-tiny-learned-sigma']['parameter_counts_SiT-XL/2']}")
    for name, r in cases.items():
        if "max_abs_diff" in r:
            print(f"{name:20s} max |ours - official| = {r['max_abs_diff']:.3g}")
    for name, c in counts.items():
        print(f"{name:20s} parameters: official {c['official']:,}, ours {c['ours']:,}")
    g = gate(cases)
    write_results(args.out, "diffrelay nets.dit vs facebookresearch/DiT models.py (and SiT's), same weights and inputs",
                  cases=cases, gate=g.to_json())
    g.finish("check_dit_equivalence")


if __name__ == "__main__":
    main()
