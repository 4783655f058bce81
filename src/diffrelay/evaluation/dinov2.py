"""DINOv2 features for FD_DINOv2: our own ViT that loads Meta's official backbone weights, saved as TorchScript.

Examples:
  diffrelay fetch-extractor --extractor dinov2 --out resources/extractors/dinov2-vitl14.pt
  diffrelay fetch-extractor --extractor dinov2-vitb14 --out resources/extractors/dinov2-vitb14.pt
  diffrelay fetch-extractor --extractor dinov2 --weights ~/dinov2_vitl14_pretrain.pth --out ...

Model: the backbones of facebookresearch/dinov2 (dinov2/hub/backbones.py, dinov2/models/vision_transformer.py):
patch 14, a class token, a learned position table for 518 px (37 x 37 patches) resized bicubically to the
input's patch grid with a scale factor of (grid + 0.1) / 37 and no antialias (the hub models' defaults),
pre-norm blocks with LayerScale, LayerNorm eps 1e-6, a GELU MLP (SwiGLU for g/14). The features are the
final-normed class token: what the hub model's forward returns (its head is Identity).

Preprocessing, inside the TorchScript module's forward: the FD_DINOv2 detector of NVlabs/edm2
(calculate_metrics.py, DINOv2Detector, its default resize_mode='torch'): float images in [0, 255] at their
own size, resized to 224 x 224 (bicubic, antialias, align_corners False), divided by 255, then ImageNet
mean/std. dgm-eval (Stein et al. 2023) resizes with PIL instead, so our numbers follow edm2's, not dgm-eval's.

Weights: https://dl.fbaipublicfiles.com/dinov2/dinov2_<model>/dinov2_<model>_pretrain.pth (the URL the
official hub code builds; DIFFRELAY_DINOV2_URL replaces the part before /dinov2_<model>/). Meta publishes
no checksum for these files, so a download is verified by structure instead: torch.load(weights_only=True),
then every key and shape must equal the model's. Its sha256 is recorded in the file's META as source_sha256.
Offline, place the official file next to --out under its own name (or pass --weights): it is used as is.
"""

import json
import os
import pickle
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from diffrelay import io, logs
from diffrelay.evaluation import extractor
from diffrelay.errors import UserError

BASE_URL = "https://dl.fbaipublicfiles.com/dinov2"
RESIZE = 224  # edm2's detector resizes every image to this before the model
MEAN = (0.485, 0.456, 0.406)  # ImageNet statistics, as edm2 normalises
STD = (0.229, 0.224, 0.225)
log = logs.get()


@dataclass(frozen=True)
class Shape:
    dim: int
    depth: int
    heads: int
    ffn: str  # "mlp" (S, B, L) or "swiglu" (g: the official "swiglufused")
    patch: int = 14
    grid: int = 37  # the position table covers 518 px: 37 x 37 patches

    @property
    def hidden(self) -> int:
        if self.ffn == "swiglu":
            return (int(4 * self.dim * 2 / 3) + 7) // 8 * 8  # the official SwiGLU width, rounded up to 8
        return 4 * self.dim


MODELS = {"vits14": Shape(384, 12, 6, "mlp"), "vitb14": Shape(768, 12, 12, "mlp"),
          "vitl14": Shape(1024, 24, 16, "mlp"), "vitg14": Shape(1536, 40, 24, "swiglu")}
DEFAULT = "vitl14"  # the model edm2 reports FD_DINOv2 with


def weights_url(model: str) -> str:
    base = os.environ.get("DIFFRELAY_DINOV2_URL", BASE_URL).rstrip("/")
    return f"{base}/dinov2_{model}/{file_name(model)}"


def file_name(model: str) -> str:
    return f"dinov2_{model}_pretrain.pth"


# ---------------------------------------------------------------------------- the network

class PatchEmbed(nn.Module):
    def __init__(self, dim: int, patch: int):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, rows * cols, dim), row-major like the table


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)  # scale 1/sqrt(head dim), as the official attention
        return self.proj(y.transpose(1, 2).reshape(b, n, c))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))  # exact (erf) GELU, nn.GELU's default


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w12 = nn.Linear(dim, 2 * hidden)  # both input projections in one matrix, as the official file stores
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.w12(x).chunk(2, dim=-1)
        return self.w3(F.silu(a) * b)


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class Block(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.norm1 = nn.LayerNorm(s.dim, eps=1e-6)
        self.attn = Attention(s.dim, s.heads)
        self.ls1 = LayerScale(s.dim)
        self.norm2 = nn.LayerNorm(s.dim, eps=1e-6)
        self.mlp = SwiGLU(s.dim, s.hidden) if s.ffn == "swiglu" else Mlp(s.dim, s.hidden)
        self.ls2 = LayerScale(s.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.ls1(self.attn(self.norm1(x)))
        return x + self.ls2(self.mlp(self.norm2(x)))


class Backbone(nn.Module):
    """Images normalised for ImageNet (sides a multiple of the patch) -> normed class token (B, dim).

    Parameter names and shapes are those of the official backbone files, so they load with strict=True."""

    def __init__(self, s: Shape):
        super().__init__()
        self.patch, self.grid, self.dim = s.patch, s.grid, s.dim
        self.patch_embed = PatchEmbed(s.dim, s.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, s.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + s.grid * s.grid, s.dim))
        self.mask_token = nn.Parameter(torch.zeros(1, s.dim))  # training only; kept so the file loads strictly
        self.blocks = nn.ModuleList([Block(s) for _ in range(s.depth)])
        self.norm = nn.LayerNorm(s.dim, eps=1e-6)

    def positions(self, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
        if rows == self.grid and cols == self.grid:
            return self.pos_embed
        table = self.pos_embed.float()
        grid = table[:, 1:].reshape(1, self.grid, self.grid, self.dim).permute(0, 3, 1, 2)
        # The official code passes a scale factor of (n + 0.1) / 37, not a size: the kernel samples at
        # positions set by that factor, so a size would give (slightly) different numbers.
        scale = [(rows + 0.1) / self.grid, (cols + 0.1) / self.grid]
        grid = F.interpolate(grid, scale_factor=scale, mode="bicubic", align_corners=False, antialias=False)
        if grid.shape[2] != rows or grid.shape[3] != cols:
            raise RuntimeError(f"position table resized to {grid.shape[2]}x{grid.shape[3]}, not {rows}x{cols}")
        grid = grid.permute(0, 2, 3, 1).reshape(1, rows * cols, self.dim)
        return torch.cat([table[:, :1], grid], dim=1).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[2], x.shape[3]
        if h % self.patch != 0 or w % self.patch != 0:
            raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {self.patch}")
        tokens = self.patch_embed(x)
        tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1)
        tokens = tokens + self.positions(h // self.patch, w // self.patch, tokens.dtype)
        for block in self.blocks:
            tokens = block(tokens)
        return self.norm(tokens)[:, 0]


class Features(nn.Module):
    """(B, 3, H, W) floats in [0, 255] at the images' own size -> (B, dim) DINOv2 features, edm2's protocol."""

    def __init__(self, s: Shape):
        super().__init__()
        self.vit = Backbone(s)
        self.size, self.mean, self.std = RESIZE, list(MEAN), list(STD)  # attributes: TorchScript reads no globals

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(x.float(), size=(self.size, self.size), mode="bicubic", align_corners=False,
                          antialias=True)
        mean = torch.tensor(self.mean, dtype=x.dtype, device=x.device).reshape(1, 3, 1, 1)
        std = torch.tensor(self.std, dtype=x.dtype, device=x.device).reshape(1, 3, 1, 1)
        return self.vit((x / 255 - mean) / std)


# ---------------------------------------------------------------------------- official weights

def read_weights(f, name, model: str) -> dict:
    """The state dict in an open .pth file, read with weights_only=True (no code runs); UserError otherwise."""
    fix = f"use the official {file_name(model)} from {weights_url(model)}"
    try:
        state = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # torch's message is a page long; keep the line that says what it met (a GLOBAL: code it refused to run).
        skip = ("Weights only load failed", "Check the documentation", "Please file an issue")
        lines = [line.strip() for line in str(e).splitlines() if line.strip() and not line.strip().startswith(skip)]
        reason = lines[0] if lines else type(e).__name__
        if "GLOBAL" in reason:
            raise UserError(f"{name}: refused by torch.load(weights_only=True) ({reason}); {fix}") from e
        raise UserError(f"{name}: not a readable PyTorch weights file ({reason}); {fix}") from e
    except (RuntimeError, EOFError, OSError, ValueError, zipfile.BadZipFile) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{name}: not a readable PyTorch weights file ({first}); {fix}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{name}: holds a {type(state).__name__}, not a flat dict of tensors; {fix}")
    return state


def build(model: str, state: dict, name) -> Features:
    """Our network for `model` with `state` loaded; the first missing, extra or misshapen key is a UserError."""
    s = MODELS[model]
    net = Features(s).eval()
    want = net.vit.state_dict()
    fix = f"expected the official {file_name(model)} from {weights_url(model)}"
    for key, value in want.items():
        if key not in state:
            raise UserError(f"{name}: key {key!r} missing; {fix}")
        if tuple(state[key].shape) != tuple(value.shape):
            raise UserError(f"{name}: key {key!r} has shape {tuple(state[key].shape)}, "
                            f"not {tuple(value.shape)} (DINOv2 {model}); {fix}")
    extra = [key for key in state if key not in want]
    if extra:
        raise UserError(f"{name}: unexpected key {extra[0]!r} ({len(extra)} in all); {fix}")
    net.vit.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return net.requires_grad_(False)


def test_batch(seed: int = 0, size: int = 32) -> torch.Tensor:
    return torch.rand((2, 3, size, size), generator=torch.Generator().manual_seed(seed)) * 255


def convert(f, name, model: str, out: Path) -> Path:
    """Verify the .pth in open file `f`, build the network and write it to `out` as TorchScript, atomically."""
    sha256 = io.sha256_fileobj(f)
    f.seek(0)
    net = build(model, read_weights(f, name, model), name)
    dim = MODELS[model].dim
    x = test_batch()
    with torch.no_grad():
        y = net(x)
    if y.shape != (2, dim) or not torch.isfinite(y).all():
        raise UserError(f"{name}: gives non-finite or misshapen features {tuple(y.shape)} on a test batch; "
                        f"download {weights_url(model)} again")
    with extractor.quiet():
        scripted = torch.jit.script(net)
    meta = {"kind": "dinov2", "model": model, "input": "native", "source_sha256": sha256, "dim": dim}
    with io.atomic_write(out, "w+b") as g, extractor.quiet():
        torch.jit.save(scripted, g, _extra_files={extractor.META: json.dumps(meta)})
        g.flush()
        digest = io.sha256_fileobj(g)
        g.seek(0)
        # Check the temp file before the rename, so a bad file never appears under the final name.
        ext = extractor.load(out, sha256=digest, fileobj=g)
        extractor.check(ext, want_dim=dim)
        with torch.no_grad():
            same = torch.allclose(ext.fn(x), y, rtol=1e-4, atol=1e-4)
        if not same:
            raise UserError(f"{out}: the TorchScript file's features differ from the network's; report this as a bug")
        g.seek(0, os.SEEK_END)
    log.info(f"{out}: DINOv2 {model} written ({dim} features per image; source sha256 {sha256})")
    return out


def _keep(out: Path, model: str) -> Path:
    meta = extractor.read_meta(out)
    if meta.get("kind") != "dinov2" or meta.get("model") != model:
        raise UserError(f"{out}: exists but is not the DINOv2 {model} extractor (found {meta or 'another file'}); "
                        "delete it or choose another --out")
    extractor.check(extractor.load(out), want_dim=MODELS[model].dim)
    log.info(f"{out}: DINOv2 {model} extractor present and valid; kept as is")
    return out


def fetch(model: str, out, weights=None) -> Path:
    """Write the DINOv2 `model` extractor to `out` from `weights` (a .pth file), a .pth placed next to `out`
    under its official name, or a download (to an anonymous temp file, deleted after). A valid one is kept."""
    if model not in MODELS:
        raise UserError(f"--extractor=dinov2-{model}: unknown DINOv2 model; use one of "
                        + ", ".join(f"dinov2-{m}" for m in MODELS))
    out = Path(out)
    if out.exists():
        return _keep(out, model)
    placed = Path(weights) if weights else out.parent / file_name(model)
    if placed.is_file():
        # Placed by hand (offline machines): used as is and never deleted.
        log.info(f"{out}: building DINOv2 {model} from {placed}")
        with open(placed, "rb") as f:
            return convert(f, placed, model, out)
    if weights:
        raise UserError(f"--weights={placed}: file not found; download {weights_url(model)} and give its path")
    url = weights_url(model)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        f = tempfile.TemporaryFile(dir=out.parent)  # no name, so nothing is left behind if we are killed
    except OSError as e:
        raise UserError(f"{out.parent}: cannot write ({e.strerror}); check the folder's permissions") from e
    with f:
        log.info(f"downloading {url} (about {_size_text(model)}) -> {out}")
        extractor.download(url, f, out, place_at=placed)
        return convert(f, url, model, out)


def _size_text(model: str) -> str:
    s = MODELS[model]
    per_block = 4 * s.dim * s.dim + 3 * s.dim * s.hidden if s.ffn == "swiglu" else 12 * s.dim * s.dim
    params = s.depth * per_block + (1 + s.grid * s.grid) * s.dim + 3 * s.patch * s.patch * s.dim
    return f"{4 * params / 1e9:.2f} GB" if params > 2.5e8 else f"{4 * params / 1e6:.0f} MB"


def parse(name: str) -> str:
    """`dinov2` -> the default model; `dinov2-vitb14` -> vitb14."""
    return DEFAULT if name == "dinov2" else name.removeprefix("dinov2-")

