"""Scoring with two extractors in one pass against scoring with each alone (the goal: both <= 1.2x the slower).

  python benchmarks/bench_extractors.py [--images 200] [--size 32] [--dinov2 vitb14] [--threads 2] [--repeats 2]

Neither real weights file can be downloaded here, so both extractors have their real architecture and
random weights (the cost of a forward pass does not depend on the weights):
  inception  torchvision's Inception-v3 trunk (2048 features) at 299x299 after clean-fid's resize, as a
             custom TorchScript extractor: the network clean-fid's Inception file holds
  dinov2     diffrelay's DINOv2 ViT (--dinov2, L/14 by default on a GPU) built from a random state dict
             through the same path as the official file (dinov2.fetch --weights), at the images' own size
--light swaps in two cheap extractors (the seeded random CNN at 299x299 and a 2-block DINOv2-shaped ViT
at the images' own size): then decoding and resizing dominate, as on a GPU where the networks are fast, and
the ratio shows what the shared decode pass saves. Each case is `fid.score_all` on one folder of PNGs (decode, resize, features, statistics, FD, KID,
precision/recall) against reference statistics of other images: inception alone, dinov2 alone, both in
one pass. Also reported: the sum of the two alone, which is what two separate scoring jobs would cost.
Writes benchmarks/results/extractors.json.
"""

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_fid import shapes  # noqa: E402

from diffrelay.evaluation import dinov2, extractor, features, fid  # noqa: E402


def inception_file(out: Path) -> Path:
    from torchvision.models import inception_v3

    class Trunk(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = inception_v3(weights=None, aux_logits=False, init_weights=False).eval()
            self.net.fc = torch.nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net((x - 128.0) / 128.0)

    with torch.no_grad():  # traced: scripting sees torchvision's training-mode return type
        traced = torch.jit.trace(Trunk().eval(), torch.rand(2, 3, 299, 299) * 255)
    torch.jit.save(traced, str(out))
    return out


def dinov2_file(model: str, root: Path) -> Path:
    weights = root / f"random-{model}.pth"
    torch.save(dinov2.Features(dinov2.MODELS[model]).vit.state_dict(), weights)
    return dinov2.fetch(model, root / f"dinov2-{model}.pt", weights=weights)


def reference(ext_path: Path, folder: Path, out: Path, batch: int) -> Path:
    ext = extractor.load(ext_path)
    [feats] = features.of_files(features.image_files(folder), [ext], "clean", batch, fid._device())
    fid.save_ref(out, *fid.statistics(feats), feats, {
        "format": fid.FORMAT, "mode": "clean", "metric": ext.label, "extractor": ext_path.name,
        "extractor_sha256": ext.sha256, "num_images": len(feats)})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=200)
    p.add_argument("--ref-images", type=int, default=64)
    p.add_argument("--size", type=int, default=32, help="side of the generated PNGs")
    p.add_argument("--dinov2", default="vitl14" if torch.cuda.is_available() else "vitb14",
                   choices=sorted(dinov2.MODELS))
    p.add_argument("--light", action="store_true", help="cheap extractors: measure the shared pipeline")
    p.add_argument("--batch", type=int, default=50)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for name, n, seed in (("fake", args.images, 1), ("real", args.ref_images, 2)):
            (root / name).mkdir()
            for i, img in enumerate(shapes(n, seed, args.size)):
                Image.fromarray(img).save(root / name / f"{i:06d}.png")
        if args.light:
            dinov2.MODELS["light"] = dinov2.Shape(dim=32, depth=2, heads=2, ffn="mlp")
            args.dinov2 = "light"
            exts = {"inception": extractor.build_random(root / "random.pt", seed=0),
                    "dinov2": dinov2_file("light", root)}
        else:
            exts = {"inception": inception_file(root / "inception-arch.pt"), "dinov2": dinov2_file(args.dinov2, root)}
        pairs = {k: (e, reference(e, root / "real", root / f"ref-{k}.npz", args.batch)) for k, e in exts.items()}
        cases = {"inception": [pairs["inception"]], "dinov2": [pairs["dinov2"]],
                 "both": [pairs["inception"], pairs["dinov2"]]}
        fid.score_all(root / "fake", cases["both"][:1], batch_size=args.batch, workers=args.threads)  # warm-up
        times = {k: [] for k in cases}
        for _ in range(args.repeats):  # interleaved, so drift in machine load hits every case alike
            for k, case in cases.items():
                t0 = time.perf_counter()
                fid.score_all(root / "fake", case, batch_size=args.batch, workers=args.threads)
                times[k].append(time.perf_counter() - t0)

    best = {k: min(v) for k, v in times.items()}
    slower = max(best["inception"], best["dinov2"])
    result = {
        "case": "light (random CNN + 2-block ViT)" if args.light else "real architectures, random weights",
        "images": args.images, "size": args.size, "dinov2": args.dinov2, "threads": args.threads,
        "batch": args.batch, "repeats": args.repeats, "device": str(fid._device()),
        "seconds_best": {k: round(v, 2) for k, v in best.items()},
        "seconds_median": {k: round(statistics.median(v), 2) for k, v in times.items()},
        "both_over_slower": round(best["both"] / slower, 3),
        "both_over_sum_of_separate": round(best["both"] / (best["inception"] + best["dinov2"]), 3),
        "goal": "both <= 1.2 x the slower alone",
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "note": "random weights, real architectures (no weights file can be downloaded here)",
    }
    print(json.dumps(result, indent=2))
    out = HERE / "results" / ("extractors_light.json" if args.light else "extractors.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
