"""FID feature extractors as TorchScript files: clean-fid's Inception, a seeded random CNN, DINOv2
(dinov2.py), or the user's own.

Examples:
  diffrelay fetch-extractor --extractor inception --out resources/extractors/inception-2015-12-05.pt
  diffrelay fetch-extractor --extractor random --seed 0 --out resources/extractors/random-seed0.pt
  diffrelay fetch-extractor --extractor dinov2 --out resources/extractors/dinov2-vitl14.pt
  diffrelay fetch-extractor --extractor my_features.pt --out resources/extractors/my_features.pt

Call convention (clean-fid's custom_feat_extractor): float images in [0, 255], shape (B, 3, H, W), where
H = W = 299 in "clean" mode (clean-fid resizes first) and the native size in "legacy_tensorflow" mode;
the result is (B, D) features. DINOv2 files take the images at their own size in both modes and resize
inside (Extractor.input_size None).
"""

import contextlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from cleanfid.inception_torchscript import InceptionV3W

from diffrelay import io, logs
from diffrelay.errors import UserError

# The URL clean-fid 0.1.35 downloads from (cleanfid/downloads_helper.py). Tests point it at a dead port.
INCEPTION_URL = os.environ.get(
    "DIFFRELAY_INCEPTION_URL",
    "https://nvlabs-fi-cdn.nvidia.com/stylegan2-ada-pytorch/pretrained/metrics/inception-2015-12-05.pt")
INCEPTION_DIM = 2048
RANDOM_DIM = 128  # below the few hundred images a run scores, so the covariance can have full rank
META = "diffrelay.json"  # extra file inside our own TorchScript archives: {"kind": "random" | "dinov2", ...}
log = logs.get()


@dataclass(frozen=True)
class Extractor:
    fn: Callable[[torch.Tensor], torch.Tensor]  # (B, 3, H, W) in [0, 255] -> (B, D)
    kind: str  # inception | random | custom | dinov2
    path: Path
    sha256: str
    label: str  # the metric's name in every result: "FID" only for Inception features
    # Side the scorer resizes images to before fn: 299 (clean-fid's resize, clean mode), or None to feed
    # the images at their own size (legacy_tensorflow mode, and DINOv2, which resizes inside its forward).
    input_size: int | None = 299
    # Where fn's weights live: test batches are made there (a CPU batch into a CUDA module fails).
    device: torch.device = torch.device("cpu")
    # Inception only, when sFID or IS are asked for: pool, spatial and class probabilities in one pass
    # (inception.Heads), its pool features checked equal to fn's.
    heads: Callable[[torch.Tensor], dict] | None = None


# ---------------------------------------------------------------------------- the random extractor

@contextlib.contextmanager
def quiet():
    """Hide torch 2.14's deprecation notice on every TorchScript call: clean-fid's Inception is TorchScript."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield

class RandomFeatures(nn.Module):
    """Three strided ReLU convolutions and a global average: a fixed, seeded map from images to features."""

    def __init__(self, seed: int, dim: int = RANDOM_DIM):
        super().__init__()
        # Padding keeps every layer valid down to 1x1 inputs, so legacy_tensorflow mode (native size) works too.
        # About 27 M multiply-adds per 299x299 image: cheaper than clean-fid's resize, so never the bottleneck.
        self.convs = nn.ModuleList([nn.Conv2d(3, 16, 5, stride=4, padding=2), nn.Conv2d(16, 32, 3, stride=2, padding=1),
                                    nn.Conv2d(32, dim, 3, stride=2, padding=1)])
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for conv in self.convs:
                fan_in = conv.weight[0].numel()
                conv.weight.copy_(torch.randn(conv.weight.shape, generator=g) * (2.0 / fan_in) ** 0.5)
                conv.bias.copy_(torch.randn(conv.bias.shape, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - 128.0) / 128.0  # the same input scaling clean-fid applies before Inception
        for conv in self.convs:
            x = F.relu(conv(x))
        return x.mean(dim=(2, 3))


def build_random(out, seed: int = 0) -> Path:
    """Write the seeded random extractor to `out` (TorchScript, atomically); a valid one already there is kept."""
    out = Path(out)
    if out.exists():
        meta = read_meta(out)
        if meta.get("kind") == "random" and meta.get("seed") == seed:
            log.info(f"{out}: random extractor (seed {seed}) already present; kept as is")
            return out
        raise UserError(f"{out}: exists but is not the random extractor with seed={seed} (found {meta or 'another file'}); "
                        "delete it or choose another --out")
    with quiet():
        module = torch.jit.script(RandomFeatures(seed).eval())
    with io.atomic_write(out, "w+b") as f, quiet():
        torch.jit.save(module, f, _extra_files={META: json.dumps({"kind": "random", "seed": seed, "dim": RANDOM_DIM})})
    log.info(f"{out}: random extractor (seed {seed}, {RANDOM_DIM} features) written")
    return out


# ---------------------------------------------------------------------------- loading and checking

class InceptionFile(InceptionV3W):
    """clean-fid's InceptionV3W (its forward, so the numbers equal clean-fid's FID), built from our file.

    InceptionV3W.__init__ would read (or download into) a shared folder such as /tmp; we skip it and
    hand over the module loaded from the path the workflow gave us.
    """

    def __init__(self, base, resize_inside: bool):
        nn.Module.__init__(self)
        self.base, self.layers, self.resize_inside = base, base.layers, resize_inside


def _is_inception(module) -> bool:
    # The interface clean-fid's wrapper relies on: a `layers` trunk and forward(img, return_features=...).
    names = [a.name for a in module.forward.schema.arguments]
    return hasattr(module, "layers") and "return_features" in names


def _jit_load(path: Path, device="cpu", fileobj=None):
    extra = {META: ""}
    try:
        with quiet():
                module = torch.jit.load(fileobj or str(path), map_location=device, _extra_files=extra)
    except FileNotFoundError as e:
        raise UserError(f"{path}: extractor file not found; run `diffrelay fetch-extractor --out {path}`") from e
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: not a loadable TorchScript extractor ({first}); fetch or rebuild it") from e
    try:
        meta = json.loads(extra[META]) if extra[META] else {}
    except json.JSONDecodeError:
        meta = {}
    return module.eval(), meta


def read_meta(path: Path) -> dict:
    try:
        return _jit_load(path)[1]
    except UserError:
        return {}


def load(path, mode: str = "clean", device="cpu", sha256: str | None = None, fileobj=None,
         heads: bool = False) -> Extractor:
    """Load an extractor file (or `fileobj`, named `path` in messages) and wrap it for `mode`; with `heads`, an
    Inception file also gets inception.Heads (verified here; other kinds get none).

    Raises UserError for a file that is not one."""
    path = Path(path)
    if fileobj is None and not path.is_file():
        raise UserError(f"{path}: extractor file not found; run `diffrelay fetch-extractor --out {path}`")
    module, meta = _jit_load(path, device, fileobj)
    sha256 = sha256 or io.sha256_file(path)
    size = 299 if mode == "clean" else None
    if meta.get("kind") == "dinov2":
        # edm2's protocol in the module itself (resize to 224 inside), whatever the mode: native images in.
        return Extractor(module, "dinov2", path, sha256, "FD_DINOv2", None, device=torch.device(device))
    if meta.get("kind") == "random":
        return Extractor(module, "random", path, sha256, "FD (random features)", size, device=torch.device(device))
    if _is_inception(module):
        fn = InceptionFile(module, resize_inside=(mode == "legacy_tensorflow")).eval()
        more = None
        if heads:
            from diffrelay.evaluation import inception

            more = inception.Heads(module, fn.resize_inside, path)
            with quiet():
                more.verify(fn, device)
        return Extractor(fn, "inception", path, sha256, "FID", size, device=torch.device(device), heads=more)
    return Extractor(module, "custom", path, sha256, f"FD ({path.name})", size, device=torch.device(device))


def check(ext: Extractor, want_dim: int | None = None) -> int:
    """Run test batches through `ext`; return the feature count or raise UserError.

    Clean mode feeds 299x299; legacy_tensorflow feeds the images' own size, tried (at 32x32) for our own
    extractors only, since a user's file may be written for clean mode alone."""
    dims = set()
    g = torch.Generator().manual_seed(0)
    for size in (299,) if ext.kind == "custom" else (299, 32):
        x = (torch.rand((2, 3, size, size), generator=g) * 255).to(ext.device)
        fn = ext.fn
        if ext.kind == "inception":
            fn = InceptionFile(ext.fn.base, resize_inside=(size != 299))
        try:
            with torch.no_grad():
                y = fn(x)
        except (RuntimeError, AssertionError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{ext.path}: fails on a (2, 3, {size}, {size}) test batch ({first}); "
                            "an extractor must map (B, 3, H, W) images in [0, 255] to (B, D) features") from e
        if not isinstance(y, torch.Tensor) or y.ndim != 2 or y.shape[0] != 2:
            shape = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise UserError(f"{ext.path}: output={shape} for a batch of 2; an extractor must return (B, D) features")
        if not torch.isfinite(y).all():
            raise UserError(f"{ext.path}: returns non-finite features for a test batch; it cannot be used for FID")
        dims.add(y.shape[1])
    if len(dims) != 1 or (want_dim is not None and dims != {want_dim}):
        raise UserError(f"{ext.path}: features={sorted(dims)} per image; expected {want_dim or 'one fixed count'}")
    return dims.pop()


# ---------------------------------------------------------------------------- fetching Inception

def _check_inception(path: Path, sha256: str | None = None, fileobj=None) -> Extractor:
    ext = load(path, sha256=sha256, fileobj=fileobj)
    if ext.kind != "inception":
        raise UserError(f"{path}: not clean-fid's Inception (no `layers` trunk / return_features argument); "
                        f"download it from {INCEPTION_URL}")
    check(ext, want_dim=INCEPTION_DIM)
    return ext


download = io.download  # shared with data/encoders.py (the SD-VAE weights)


def fetch_inception(out) -> Path:
    """Download clean-fid's Inception to `out` (temp file, check, rename); a file already there is checked and kept."""
    out = Path(out)
    if out.exists():
        # Placed by hand (offline machines) or fetched before: never downloaded again.
        _check_inception(out)
        log.info(f"{out}: Inception file present and valid; using it as is")
        return out
    log.info(f"downloading {INCEPTION_URL} -> {out}")
    with io.atomic_write(out, "w+b") as f:
        download(INCEPTION_URL, f, out, place_at=out)
        # Check the temp file before the rename, so a bad download never appears under the final name.
        sha256 = io.sha256_fileobj(f)
        f.seek(0)
        _check_inception(out, sha256=sha256, fileobj=f)
        f.seek(0, os.SEEK_END)
    log.info(f"{out}: Inception verified (loads, {INCEPTION_DIM} features per image)")
    return out


def copy_custom(src, out) -> Path:
    """Check a user's TorchScript extractor and copy it to `out` (atomically) unless it already is `out`."""
    src, out = Path(src), Path(out)
    ext = load(src)
    dim = check(ext)
    if not (out.exists() and out.resolve() == src.resolve()):
        io.check_file_target(out, lambda p: io.sha256_file(p) == io.sha256_file(src),
                             f"a copy of {src}", "choose another --out or move the file aside")
        with io.atomic_write(out) as f, open(src, "rb") as s:
            shutil.copyfileobj(s, f, 1 << 20)
    log.info(f"{out}: extractor {src.name} verified ({dim} features per image), reported as {ext.label!r}")
    return out
