"""ADM's five numbers (FID, sFID, IS, precision, recall) from one pass, against the FID-only pass.

  python benchmarks/bench_adm_metrics.py [--images 10000] [--ref-images 10000] [--side 64] [--threads 2]

Both runs go through `diffrelay fid`'s scoring (fid.score_all) on the same folder of PNGs, in
legacy_tensorflow mode (ADM's resize), with a network of Inception-V3's architecture and cost laid out
as clean-fid's TorchScript file (torchvision's blocks, random weights: the real weights cannot be
downloaded here, and the time does not depend on them):
  fid_only  metrics unset, against an ADM batch's mu/sigma: what a run scores today;
  five      fid.metrics [fid, sfid, is, precision, recall] against an ADM batch with arr_0 and mu, sigma,
            mu_s, sigma_s. arr_0's features are computed once before, with 50 of the images (the workflow
            caches them in resources/fid-ref for every later checkpoint); that one-off time is reported apart.
ratio = five / fid_only, best of --repeats. Writes benchmarks/results/adm_metrics.json.
"""

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.nn import functional as F
from torchvision.models import inception as tv

from diffrelay.evaluation import fid

RESULTS = Path(__file__).resolve().parent / "results"


class Mixed6(nn.Module):
    """InceptionC with its 1x1 branch reachable as `conv`, as in clean-fid's file."""

    def __init__(self):
        super().__init__()
        self.block = tv.InceptionC(768, channels_7x7=160)
        self.conv = self.block.branch1x1

    def forward(self, x):
        return self.block(x)


class InceptionLike(nn.Module):
    def __init__(self):
        super().__init__()
        c = tv.BasicConv2d
        self.layers = nn.Sequential(OrderedDict(
            conv=c(3, 32, kernel_size=3, stride=2), conv_1=c(32, 32, kernel_size=3),
            conv_2=c(32, 64, kernel_size=3, padding=1), pool0=nn.MaxPool2d(3, 2), conv_3=c(64, 80, kernel_size=1),
            conv_4=c(80, 192, kernel_size=3), pool1=nn.MaxPool2d(3, 2), mixed=tv.InceptionA(192, 32),
            mixed_1=tv.InceptionA(256, 64), mixed_2=tv.InceptionA(288, 64), mixed_3=tv.InceptionB(288),
            mixed_4=tv.InceptionC(768, 128), mixed_5=tv.InceptionC(768, 160), mixed_6=Mixed6(),
            mixed_7=tv.InceptionC(768, 192), mixed_8=tv.InceptionD(768), mixed_9=tv.InceptionE(1280),
            mixed_10=tv.InceptionE(2048), pool2=nn.AdaptiveAvgPool2d(1)))
        self.output = nn.Linear(2048, 1008)

    def forward(self, img, return_features: bool = False, use_fp16: bool = False, no_output_bias: bool = False):
        b, c, h, w = img.shape
        x = img.to(torch.float32)
        theta = torch.eye(2, 3)
        theta[0, 2] += 1.0 / w - 1.0 / 299
        theta[1, 2] += 1.0 / h - 1.0 / 299
        grid = F.affine_grid(theta.unsqueeze(0).repeat(b, 1, 1), [b, c, 299, 299], False)
        x = F.grid_sample(x, grid, "bilinear", "border", False)
        feats = self.layers((x - 128) / 128).reshape(-1, 2048)
        if return_features:
            return feats
        return torch.softmax(F.linear(feats, self.output.weight) if no_output_bias else self.output(feats), 1)


def pictures(n, side, seed):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 64, (n, side, side, 3)) + rng.integers(0, 192, (n, 1, 1, 3))).astype(np.uint8)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=10000)
    ap.add_argument("--ref-images", type=int, default=10000)
    ap.add_argument("--side", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "adm_metrics.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="bench-adm-") as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            net = tmp / "inception-2015-12-05.pt"
            torch.jit.save(torch.jit.script(InceptionLike().eval()), str(net))
        folder = tmp / "samples"
        folder.mkdir()
        warm = tmp / "warm"  # a few images: the first run's cost is arr_0's features, not the samples'
        warm.mkdir()
        for i, x in enumerate(pictures(a.images, a.side, 1)):
            Image.fromarray(x).save(folder / f"{i:06d}.png")
            if i < 50:
                Image.fromarray(x).save(warm / f"{i:06d}.png")
        ref_images = pictures(a.ref_images, a.side, 2)
        rng = np.random.default_rng(3)
        feats, spatial = rng.standard_normal((256, 2048)), rng.standard_normal((256, 2023))
        stats = {"mu": feats.mean(0), "sigma": np.cov(feats, rowvar=False) + np.eye(2048),
                 "mu_s": spatial.mean(0), "sigma_s": np.cov(spatial, rowvar=False) + np.eye(2023)}
        np.savez(tmp / "stats.npz", mu=stats["mu"], sigma=stats["sigma"])
        np.savez(tmp / "batch.npz", arr_0=ref_images, **stats)
        args = dict(mode="legacy_tensorflow", batch_size=a.batch_size, workers=a.threads, device="cpu")
        t0 = time.perf_counter()
        fid.score_all(warm, [(net, tmp / "batch.npz")], metrics=["fid", "precision"], cache_dir=tmp / "cache",
                      **args)
        first = time.perf_counter() - t0
        times = {"fid_only": [], "five": []}
        for _ in range(a.repeats):
            for name, kw in (("fid_only", {"metrics": None}), ("five", {
                    "metrics": ["fid", "sfid", "is", "precision", "recall"], "cache_dir": tmp / "cache"})):
                ref = tmp / ("stats.npz" if name == "fid_only" else "batch.npz")
                t0 = time.perf_counter()
                fid.score_all(folder, [(net, ref)], **args, **kw)
                times[name].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    out = {"images": a.images, "ref_images": a.ref_images, "side": a.side, "threads": a.threads,
           "seconds": {k: round(v, 2) for k, v in best.items()}, "ratio": round(best["five"] / best["fid_only"], 4),
           "first_run_with_reference_features_s": round(first, 2),
           "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
