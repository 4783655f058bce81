"""Everything ADM's evaluator takes from Inception-V3, from one pass through clean-fid's TorchScript file.

ADM's evaluator (guided-diffusion evaluations/evaluator.py) reads three things from the TF graph of
inception-2015-12-05: pool_3 (2048 values: FID, precision, recall), mixed_6/conv sliced to its first 7
channels (17 x 17 x 7 = 2023 values: sFID), and softmax(pool_3 @ W) with W the weight of
softmax/logits/MatMul and no bias (1008 classes: the Inception Score). clean-fid's TorchScript port of the
same graph (NVIDIA's inception-2015-12-05.pt) holds the same layers under `layers` (conv, conv_1, ...,
mixed_6 with its `conv` branch, ..., mixed_10, pool2) and the classifier under `output`. `Heads` runs the
trunk once, layer by layer, and keeps all three.

The pool features must be clean-fid's own (so FID is unchanged): `Heads.verify` checks them, on a test
batch, against clean-fid's InceptionV3W on the same file, and the class probabilities against the file's
own forward; a file where either differs is refused in one line.

Two details that matter for the numbers:
- legacy_tensorflow mode resizes inside, as the TorchScript's forward does (TF1's bilinear resize, which
  samples source pixel i * in / out, not the half-pixel centres of torch's interpolate); `tf_resize`
  restates it with the same operations, so the pool features are equal bit for bit.
- TF lays the spatial features out as (H, W, C) before flattening, so they are flattened in that order:
  sFID is not invariant to how the 2023 values are ordered once mu_s and sigma_s come from ADM's file.
"""

import torch
from torch.nn import functional as F

from diffrelay.errors import UserError

SIZE = 299  # the graph's input side
SPATIAL_CHANNELS = 7  # evaluator.py: spatial[..., :7]
SPATIAL_LAYER = "mixed_6"  # mixed_6/conv:0 is the output of this block's `conv` branch
TOLERANCE = 1e-5  # relative; what verify accepts between two computations of the same features


def tf_resize(x: torch.Tensor, size: int = SIZE) -> torch.Tensor:
    """TF1's ResizeBilinear(align_corners=False) to size x size, then (x - 128) / 128: the TorchScript file's
    own preprocessing. An affine grid shifted by 1/in - 1/out puts output pixel j on source j * in / out."""
    b, c, h, w = x.shape
    one = torch.ones((), device=x.device)
    theta = torch.zeros((2, 3), device=x.device)
    theta[0, 0] = theta[1, 1] = 1
    theta[0, 2] = one / w - one / size
    theta[1, 2] = one / h - one / size
    grid = F.affine_grid(theta.to(x.dtype).unsqueeze(0).repeat(b, 1, 1), [b, c, size, size], False)
    x = F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)
    return (x - 128) / 128


class Heads:
    """(B, 3, H, W) images in [0, 255] -> {"pool": (B, 2048), "spatial": (B, 2023), "probs": (B, 1008)}.

    `base` is the loaded TorchScript file; resize_inside as clean-fid's InceptionV3W: False for clean mode
    (images arrive at 299 x 299), True for legacy_tensorflow (images at their own size)."""

    def __init__(self, base, resize_inside: bool, path):
        self.base, self.resize_inside, self.path = base, resize_inside, path
        layers = list(base.layers.named_children()) if hasattr(base, "layers") else []
        names = [n for n, _ in layers]
        block = dict(layers).get(SPATIAL_LAYER)
        branch = dict(block.named_children()).get("conv") if block is not None else None
        output = dict(base.output.named_parameters()) if hasattr(base, "output") else {}
        if branch is None or output.get("weight") is None or output["weight"].ndim != 2:
            raise UserError(f"{path}: not clean-fid's Inception file (no layers.{SPATIAL_LAYER}.conv or output "
                            "weight), so it gives no sFID or Inception Score; fetch inception-2015-12-05.pt or drop "
                            "sfid and is from fid.metrics")
        self.layers, self.at = [m for _, m in layers], names.index(SPATIAL_LAYER)
        self.branch, self.weight, self.bias = branch, output["weight"], output.get("bias")

    def __call__(self, img: torch.Tensor) -> dict:
        x = tf_resize(img) if self.resize_inside else (img - 128) / 128
        spatial = None
        for i, layer in enumerate(self.layers):
            if i == self.at:  # the branch again, by itself: 1x1 convolutions, about 1 % of the pass
                spatial = self.branch(x)[:, :SPATIAL_CHANNELS].permute(0, 2, 3, 1).flatten(1)
            x = layer(x)
        pool = x.reshape(len(x), -1)
        return {"pool": pool, "spatial": spatial, "probs": self.probs(pool)}

    def probs(self, pool: torch.Tensor, bias: bool = False) -> torch.Tensor:
        """evaluator.py _create_softmax_graph: softmax(pool_3 @ W) without the bias, in float32."""
        return torch.softmax(F.linear(pool, self.weight, self.bias if bias else None), dim=1)

    def verify(self, clean_fid_fn, device) -> None:
        """On a seeded test batch: the pool features equal clean-fid's `clean_fid_fn` (InceptionV3W on the same
        file, same mode), and softmax(pool @ W) is what the file's own forward returns (its no_output_bias
        option where it has one). Otherwise one line of UserError."""
        g = torch.Generator().manual_seed(0)
        x = (torch.rand((2, 3, SIZE, SIZE), generator=g) * 255).to(device)
        native = (torch.rand((2, 3, 64, 64), generator=g) * 255).to(device)
        with torch.no_grad():
            mine = self(native if self.resize_inside else x)
            theirs = clean_fid_fn(native if self.resize_inside else x)
            # The file's forward resizes whatever it gets; its pool features feed both sides of this check.
            pool = self.base(native, return_features=True).reshape(2, -1)
            if "no_output_bias" in [a.name for a in self.base.forward.schema.arguments]:
                probs, own = self.base(native, no_output_bias=True), self.probs(pool)
            else:
                probs, own = self.base(native), self.probs(pool, bias=True)
        for name, a, b in (("pool features", mine["pool"], theirs), ("class probabilities", own, probs)):
            if a.shape != b.shape or (a - b).abs().max() > TOLERANCE * max(float(b.abs().max()), 1e-12):
                diff = "shapes differ" if a.shape != b.shape else f"max difference {float((a - b).abs().max()):.3g}"
                raise UserError(f"{self.path}: its {name} taken layer by layer differ from clean-fid's ({diff}); "
                                "this file gives no sFID or Inception Score: drop sfid and is from fid.metrics")
        want = SPATIAL_CHANNELS * 17 * 17
        if mine["spatial"].shape[1] != want:
            raise UserError(f"{self.path}: {SPATIAL_LAYER}.conv gives {mine['spatial'].shape[1]} spatial values per "
                            f"image, not ADM's {want}; this file gives no sFID: drop sfid from fid.metrics")
