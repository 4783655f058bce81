"""Estimated training and sampling cost of the recipes (config/examples/*): parameters, FLOPs, H100 hours.

  python benchmarks/recipe_cost.py [CONFIG.yaml ...] [--classes N] [--mfu 0.4] [--out results/recipe_cost.json]

Each config is read on top of config/config.yaml (diffrelay.config.load) and its network built as training
builds it (objectives.build) on the meta device: no weights, no memory, no GPU. FLOPs are counted by torch's
FlopCounterMode (diffrelay.nets.cost: matmuls and convolutions at 2 per multiply-add, elementwise ops not
counted) for one image: the forward pass, and forward + backward measured together (with the recipe's
activation checkpointing, which recomputes the forward). Hours = FLOPs / (MFU x peak) on an H100 SXM (dense
BF16, 989.4 TFLOP/s) at an assumed MFU: AN ESTIMATE, not a measurement; real runs differ with the
kernels, the precision and the data loading. Not counted: the optimizer, EMA, the VAE (latents are encoded
once by prepare; decoding samples is small next to the sampler), evaluation.

Sampling: images x network evaluations x forward FLOPs, twice when guided (the guided and the unguided pass
both run). Evaluations per image: Heun 2 x steps - 1, euler, sde, ddpm and ddim one per step (nets.cost.nfe).
Images: fid.final.num_images when fid.final is on, else sample.num_images (one seed set, one guidance value).

Without arguments: the paper recipes in config/examples that exist (PAPER_RECIPES), else the CIFAR-10-sized
DiT-S/2 and UNet recipes. Writes benchmarks/results/recipe_cost.json and prints a markdown table.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "src"))

from diffrelay import config, nets, objectives  # noqa: E402
from diffrelay.config import preflight  # noqa: E402
from diffrelay.nets import cost, registry  # noqa: E402

PAPER_RECIPES = ["edm-cifar10-ddpmpp-cond", "dit-xl2-imagenet256", "sit-xl2-imagenet256", "edm2-xs-imagenet512"]
# Before the paper recipes exist: the CIFAR-10-sized recipes (renamed once, hence both names).
FALLBACK = ["dit-s2", "pixel-dit-s2", "cifar10-unet", "unet-cifar10"]
# Classes of a dataset whose folder is not here, read off data.path (marked assumed in the output).
KNOWN_CLASSES = {"imagenet": 1000, "cifar10": 10, "cifar-10": 10}
# The papers' own figures, to compare with (multiply-adds, the unit of their "Gflops"). DiT README/Table 4 and
# SiT README: XL/2 at 256x256 "119" (118.6 in DiT's paper); parameters: DiT's README (675,129,632 with learned
# sigma); EDM's CIFAR-10 DDPM++ 55.73 M (EDM's Table 7, as tests/test_nets_edm.py restates); edm2's Table 2 XS:
# 125 M parameters, 46 Gflops at 512x512 (from the paper; not stated in edm2's README).
PAPER = {"dit-xl2": {"params_m": 675.13, "gmacs": 118.6, "source": "DiT paper Table 4 / README (119)"},
         "sit-xl2": {"params_m": 675.13, "gmacs": 118.6, "source": "SiT README (119), same network as DiT-XL/2"},
         "edm2-xs": {"params_m": 125, "gmacs": 46, "source": "edm2 paper Table 2 (not verifiable from its README)"},
         "edm-cifar10": {"params_m": 55.73, "gmacs": None, "source": "EDM paper (parameters only)"}}


def classes_of(cfg, override: int | None) -> tuple[int, bool]:
    """(classes, assumed): the dataset's count when known here, else the recipe's data.path names it."""
    if not cfg.model.class_conditional or cfg.data.labels == "none":
        return 0, False
    if override is not None:
        return override, True
    try:
        return preflight.num_classes(cfg), cfg.data.kind != "shapes"
    except (OSError, ValueError):
        path = str(cfg.data.path).lower()
        for key, k in KNOWN_CLASSES.items():
            if key in path:
                return k, True
        raise SystemExit(f"{cfg.data.path}: not here and no known dataset in its name; give --classes") from None


def row(path: Path, args) -> dict:
    cfg = config.load([REPO / "config/config.yaml", path])
    d = cfg.to_dict()
    classes, assumed = classes_of(cfg, args.classes)
    channels, side = preflight.net_geometry(cfg)
    arch, kwargs = nets.arch_kwargs(d["model"])
    checkpointing = d["train"]["activation_checkpointing"]
    built = {}

    def build():
        built["net"] = net = objectives.build(d["model"], side, classes, channels)
        if checkpointing:
            registry.enable_checkpointing(net, arch)
        return net

    shape = (1, channels, side, side)
    counted = cost.measure(build, shape, classes, train=True, cpu="the recipes are counted on meta only")
    params = registry.num_params(getattr(built["net"], "net", built["net"]))
    fwd, train = counted["forward"], counted["train"]
    t, s, f = cfg.train, cfg.sample, cfg.fid
    images = t.total_steps * t.batch_size
    guidance = s.guidance if isinstance(s.guidance, (list, tuple)) else [s.guidance]
    guided = any(g != 1 for g in guidance)
    sample_images = f.final.num_images if f.final.best > 0 else s.num_images
    evaluations = cost.nfe(s.solver, s.steps)
    sample_flops = cost.sampling_flops(fwd, sample_images, evaluations, guided)
    paper = next((v for k, v in PAPER.items() if k in path.stem), None)
    return {"recipe": path.stem, "file": str(path.relative_to(REPO) if path.is_relative_to(REPO) else path),
            "arch": arch, "kwargs": kwargs, "objective": d["model"]["objective"], "net_input": [channels, side, side],
            "classes": classes, "classes_assumed": assumed, "params": params,
            "forward_flops": fwd, "forward_gmacs": round(cost.macs(fwd) / 1e9, 2),
            "train_flops_per_image": train, "train_over_forward": round(train / fwd, 3),
            "activation_checkpointing": checkpointing, "precision": d["train"]["precision"], "train_images": images,
            "train_eflops": round(train * images / 1e18, 2),
            "train_h100_hours": round(cost.gpu_hours(train, images, args.mfu), 1),
            "sample_images": sample_images, "solver": s.solver, "steps": s.steps, "nfe": evaluations,
            "guided": guided, "sample_eflops": round(sample_flops / 1e18, 3),
            "sample_h100_hours": round(cost.gpu_hours(sample_flops, 1, args.mfu), 2), "paper": paper}


def table(rows: list[dict], mfu: float) -> str:
    head = ["recipe", "parameters", "forward GFLOPs/image (G MACs)", "train GFLOPs/image (x fwd)",
            "training images", "training EFLOPs", f"H100-hours train @ MFU {mfu:.2f}", "sampling: images x NFE",
            "H100-hours sampling"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            r["recipe"], f"{r['params'] / 1e6:.2f} M", f"{r['forward_flops'] / 1e9:.1f} ({r['forward_gmacs']:.1f})",
            f"{r['train_flops_per_image'] / 1e9:.1f} ({r['train_over_forward']:.2f}x)", f"{r['train_images']:,}",
            f"{r['train_eflops']:,}", f"{r['train_h100_hours']:,}",
            f"{r['sample_images']:,} x {r['nfe']}{' x 2 (guided)' if r['guided'] else ''}",
            f"{r['sample_h100_hours']:,}"]) + " |")
    return "\n".join(lines)


def default_recipes() -> list[Path]:
    found = [p for p in sorted((REPO / "config/examples").glob("*.yaml")) if any(n in p.stem for n in PAPER_RECIPES)]
    return found or [p for n in FALLBACK if (p := REPO / f"config/examples/{n}.yaml").is_file()]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", type=Path, help="recipe YAMLs [default: the paper recipes]")
    p.add_argument("--classes", type=int, help="class count when the dataset is not here [default: from data.path]")
    p.add_argument("--mfu", type=float, default=cost.DEFAULT_MFU, help="model FLOPs utilisation assumed")
    p.add_argument("--out", type=Path, default=HERE / "results" / "recipe_cost.json")
    args = p.parse_args()
    rows = [row(c.resolve(), args) for c in (args.configs or default_recipes())]
    note = (f"ESTIMATE: FLOPs counted by torch FlopCounterMode (matmuls/convolutions, 2 per multiply-add, "
            f"elementwise ops not counted) on one image; hours = FLOPs / ({args.mfu:.2f} MFU x "
            f"{cost.H100_BF16_PEAK / 1e12:.1f} TFLOP/s, H100 SXM dense BF16); papers' Gflops are multiply-adds (MACs)")
    out = {"note": note, "mfu": args.mfu, "peak_flops": cost.H100_BF16_PEAK, "torch": torch.__version__, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(note + "\n")
    print(table(rows, args.mfu))
    for r in rows:
        if r["paper"]:
            pp = r["paper"]
            print(f"\n{r['recipe']}: {r['params'] / 1e6:.2f} M parameters, {r['forward_gmacs']} G MACs per forward; "
                  f"paper: {pp['params_m']} M" + (f", {pp['gmacs']} Gflops (MACs)" if pp["gmacs"] else "")
                  + f" [{pp['source']}]")
        if r["precision"] == "fp32":
            print(f"\n{r['recipe']}: train.precision fp32: the hours use the BF16 peak; the H100's TF32 tensor-core "
                  "peak (train.tf32) is half of it and plain FP32 far less, so expect twice the hours or more")
        if r["classes_assumed"]:
            print(f"\n{r['recipe']}: {r['classes']} classes assumed (from data.path or --classes)")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
