"""Our DINOv2 (diffrelay.evaluation.dinov2) against the official implementation, on the same random weights.

  python benchmarks/checks/check_dinov2_equivalence.py --dinov2-src /tmp/dinov2src [--models tiny tiny-swiglu vits14]

--dinov2-src is a checkout of github.com/facebookresearch/dinov2 (e.g. `git archive HEAD | tar -x`); it is
imported from there, never fetched (no torch.hub), with xFormers disabled so its plain PyTorch paths run.
For each model shape, one seeded random state dict (every tensor random, LayerScale and norms included) is
loaded into the official DinoVisionTransformer, built with the hub backbones' arguments, and into ours
(strictly: so the key names and shapes also match). Compared, as max abs differences of the features:
  backbone@N      the two backbones on the same normalised N x N batch (518: the table as is; else resized)
  edm2@N          our whole extractor (TorchScript, as saved) on N x N images in [0, 255] against edm2's
                  detector steps (resize to 224 bicubic antialias, /255, ImageNet mean/std) + official model
Writes benchmarks/results/dinov2_equivalence.json. Not a test: CI cannot fetch the official source.
"""

import argparse
import json
import os
import platform
import sys
import time
import warnings
from functools import partial
from pathlib import Path

import torch
from official import RESULTS
from torch.nn import functional as F

SHAPES = {"tiny": (32, 2, 2, "mlp"), "tiny-swiglu": (32, 2, 2, "swiglu")}


def official_model(src_vits, src_layers, dim, depth, heads, ffn):
    # The arguments dinov2/hub/backbones.py passes for the non-register backbones.
    return src_vits.DinoVisionTransformer(
        img_size=518, patch_size=14, embed_dim=dim, depth=depth, num_heads=heads, mlp_ratio=4,
        init_values=1.0, ffn_layer="swiglufused" if ffn == "swiglu" else "mlp", block_chunks=0,
        num_register_tokens=0, interpolate_antialias=False, interpolate_offset=0.1,
        block_fn=partial(src_layers.NestedTensorBlock, attn_class=src_layers.MemEffAttention)).eval()


def random_state(reference: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for key, value in reference.items():
        noise = torch.randn(value.shape, generator=g)
        # Gains near 1 (norms, LayerScale) and small weights keep 24 blocks' activations in a sane range.
        gain = key.endswith("gamma") or (key.endswith("weight") and value.ndim == 1)
        state[key] = 1 + 0.1 * noise if gain else 0.02 * noise
    return state


def edm2_steps(x):
    x = F.interpolate(x.to(torch.float32), size=(224, 224), mode="bicubic", antialias=True)
    x = x.to(torch.float32) / 255
    x = x - torch.tensor([0.485, 0.456, 0.406]).reshape(1, -1, 1, 1)
    return x / torch.tensor([0.229, 0.224, 0.225]).reshape(1, -1, 1, 1)


def compare(name, src_vits, src_layers, seed=0):
    from diffrelay.evaluation import dinov2

    if name in SHAPES:
        dim, depth, heads, ffn = SHAPES[name]
        dinov2.MODELS[name] = dinov2.Shape(dim, depth, heads, ffn)
    s = dinov2.MODELS[name]
    official = official_model(src_vits, src_layers, s.dim, s.depth, s.heads, s.ffn)
    state = random_state(official.state_dict(), seed)
    official.load_state_dict(state, strict=True)
    net = dinov2.build(name, state, f"random {name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        scripted = torch.jit.script(net)
    g = torch.Generator().manual_seed(seed + 1)
    out = {"dim": s.dim, "depth": s.depth, "heads": s.heads, "ffn": s.ffn}
    with torch.no_grad():
        for n in (518, 224, 98):
            x = torch.randn((2, 3, n, n), generator=g)
            a, b = official(x), net.vit(x)
            out[f"backbone@{n}"] = (a - b).abs().max().item()
        out["feature_scale"] = a.abs().max().item()
        for n in (224, 32, 299):
            x = torch.randint(0, 256, (2, 3, n, n), generator=g).float()
            a, b = official(edm2_steps(x)), scripted(x)
            out[f"edm2@{n}"] = (a - b).abs().max().item()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dinov2-src", required=True, help="checkout of facebookresearch/dinov2")
    parser.add_argument("--models", nargs="+", default=["tiny", "tiny-swiglu", "vits14", "vitl14"])
    parser.add_argument("--dinov2-commit", default="", help="the checkout's commit, recorded in the results")
    parser.add_argument("--out", default=str(RESULTS / "dinov2_equivalence.json"))
    args = parser.parse_args()
    src = Path(args.dinov2_src)
    if not (src / "dinov2" / "models" / "vision_transformer.py").is_file():
        print(f"--dinov2-src={src}: no dinov2/models/vision_transformer.py there; extract the official "
              "repository there first", file=sys.stderr)
        return 2
    os.environ["XFORMERS_DISABLED"] = "1"  # the official plain PyTorch fallbacks, as on a machine without it
    sys.path.insert(0, str(src.resolve()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from dinov2 import layers as src_layers
        from dinov2.models import vision_transformer as src_vits
    torch.manual_seed(0)
    results = {}
    for name in args.models:
        t = time.perf_counter()
        results[name] = compare(name, src_vits, src_layers)
        results[name]["seconds"] = round(time.perf_counter() - t, 1)
        print(name, json.dumps(results[name]), flush=True)
    worst = max(v for r in results.values() for k, v in r.items() if "@" in k)
    report = {"torch": torch.__version__, "python": platform.python_version(), "dinov2_src": str(src),
              "dinov2_commit": args.dinov2_commit,
              "max_abs_diff": worst, "models": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"max abs difference over all cases: {worst:.3g}; written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
