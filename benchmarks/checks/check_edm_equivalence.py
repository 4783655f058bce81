"""Our EDM networks (diffrelay.nets.edm) against NVlabs/edm's training/networks.py, on the same weights.

  python benchmarks/checks/check_edm_equivalence.py --edm-src /tmp/off/edm

--edm-src is a checkout of github.com/NVlabs/edm; its training/networks.py (and the torch_utils and dnnlib it
imports) is imported from there at run time and nothing of it enters the package. For each case the official
network is built with its own initialisation, every parameter (the zero and near-zero initialised ones too) is
then moved by seeded noise so that all of them matter, and its state dict is loaded strictly into ours through
edm.official_keys. Both get the same inputs: x, c_noise = ln(sigma)/4 for sigmas from 0.002 to 80 (EDMPrecond's
noise label), class labels (theirs one-hot, ours integers, the null class K = all-zero row among them) and
augmentation labels.

Cases (max abs difference of the outputs):
  tiny-ddpmpp:        --arch=ddpmpp's kwargs, model_channels 16, channel_mult [1,2], 2 blocks, 16x16x3,
                      attention at 8x8, 10 classes, augment_dim 9
  tiny-ncsnpp:        --arch=ncsnpp's kwargs (fourier, residual encoder, [1,3,3,1]), same sizes
  tiny-song-skip:     SongUNet with the skip encoder and skip decoder (reachable through kwargs), 3 levels
  tiny-adm:           DhariwalUNet, model_channels 64 (attention needs 64 channels a head), channel_mult [1,2],
                      2 blocks, 8x8x3, attention at 8x8 and 4x4, 10 classes, augment_dim 9
each in eval mode with and without augment labels, float32 and float64, and in train mode (dropout 0.1; the same
torch seed before each forward); the gradients of every parameter in train mode too (max over parameters of the
difference relative to the parameter's largest gradient). The load is strict (no missing or unexpected key).
Parameter counts of the full presets, both built on the meta device: DDPM++ and NCSN++ at 32x32x3 (CIFAR-10,
augment_dim 9, unconditional and 10 classes), ADM at 64x64x3 with 1000 classes (augment_dim 0 as in EDM's
ImageNet-64 command, and 9).
Bounds (BOUNDS below, also written to the JSON): the outputs 0 (the same operations in the same order: bit for bit);
the relative gradient differences 2e-5 in float32 and 5e-7 in float64 (EDM's attention backward runs float32
einsums in another order: 1.4e-6 and 3.1e-8 seen, so about 10x that); dropout must change the output (at least
0.1; 0.74-1.61 seen); parameter counts equal. Exit status 1, one line per figure outside its bound, when any is.
Writes benchmarks/results/edm_equivalence.json. Not a test: CI cannot fetch the official sources.
"""

import argparse
import math
import sys
from pathlib import Path

import torch
from official import RESULTS, Gate, write_results
import torch.nn.functional as F

from diffrelay.nets import edm

SONG = {"ddpmpp": dict(embedding_type="positional", channel_mult_noise=1, encoder_type="standard",
                       decoder_type="standard", resample_filter=[1, 1]),
        "ncsnpp": dict(embedding_type="fourier", channel_mult_noise=2, encoder_type="residual",
                       decoder_type="standard", resample_filter=[1, 3, 3, 1])}
SIGMAS = [0.002, 0.01, 0.1, 0.5, 1.0, 5.0, 20.0, 80.0]
# Each figure of every tiny case against its bound. 0 where both sides run the same operations in the same order.
BOUNDS = {"max_abs_diff_float32": 0.0, "max_abs_diff_float32_no_augment": 0.0, "max_abs_diff_train_float32": 0.0,
          "max_abs_diff_float64": 0.0, "max_abs_diff_float64_no_augment": 0.0,
          "max_rel_grad_diff_float32": 2e-5,  # EDM's own attention backward: float32 rounding, 1.4e-6 seen
          "max_rel_grad_diff_float64": 5e-7}  # the same einsums in float32 inside a float64 network: 3.1e-8 seen
MASKS_MATTER = 0.1  # another dropout seed must move the output (0.74-1.61 seen), or the train case compared nothing


def official(src: Path):
    sys.path.insert(0, str(src.resolve()))
    from training import networks  # noqa: PLC0415 -- EDM's training/networks.py, from --edm-src

    return networks


def pair(networks, kind: str, resolution: int, classes: int, kw: dict):
    """(theirs, ours) on the same weights; kind is SongUNet or DhariwalUNet."""
    torch.manual_seed(0)
    theirs = getattr(networks, kind)(img_resolution=resolution, in_channels=3, out_channels=3, label_dim=classes,
                                     **kw)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ours = getattr(edm, kind)(resolution, 3, classes, **kw)
    result = ours.load_state_dict(edm.official_keys(theirs.state_dict()), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return theirs, ours


def inputs(resolution: int, classes: int, augment_dim: int, dtype):
    g = torch.Generator().manual_seed(2)
    n = len(SIGMAS)
    x = torch.randn(n, 3, resolution, resolution, generator=g).to(dtype)
    c_noise = torch.tensor(SIGMAS, dtype=torch.float64).log().to(dtype) / 4
    labels = torch.tensor([0, 3, classes, 7, 9, classes, 1, 5])  # the null class K twice
    onehot = F.one_hot(labels, classes + 1)[:, :classes].to(dtype)
    augment = torch.randn(n, augment_dim, generator=g).to(dtype) if augment_dim else None
    return x, c_noise, labels, onehot, augment


def diff(a, b) -> float:
    return float((a - b).abs().max())


def compare(networks, kind: str, resolution: int, classes: int, kw: dict) -> dict:
    out = {"kind": kind, "resolution": resolution, "label_dim": classes, "kwargs": kw}
    for dtype in (torch.float32, torch.float64):
        theirs, ours = pair(networks, kind, resolution, classes, kw)
        theirs, ours = theirs.to(dtype).eval(), ours.to(dtype).eval()
        x, c_noise, labels, onehot, augment = inputs(resolution, classes, kw.get("augment_dim", 0), dtype)
        name = str(dtype).removeprefix("torch.")
        with torch.no_grad():
            want = theirs(x, c_noise, onehot, augment_labels=augment)
            out[f"max_abs_output_{name}"] = float(want.abs().max())
            out[f"max_abs_diff_{name}"] = diff(ours(x, c_noise, labels, augment_labels=augment), want)
            out[f"max_abs_diff_{name}_no_augment"] = diff(ours(x, c_noise, labels), theirs(x, c_noise, onehot))
        if dtype == torch.float32:  # dropout: the same seed draws the same masks in the same order
            theirs.train(), ours.train()
            with torch.no_grad():
                torch.manual_seed(5)
                want = theirs(x, c_noise, onehot, augment_labels=augment)
                torch.manual_seed(5)
                got = ours(x, c_noise, labels, augment_labels=augment)
                torch.manual_seed(6)
                other = ours(x, c_noise, labels, augment_labels=augment)
            out["max_abs_diff_train_float32"] = diff(got, want)
            out["train_masks_matter"] = diff(other, want)  # another seed: must differ, or dropout did nothing
        # Gradients (train mode, same seed): EDM's attention has its own backward (float32 einsums in another
        # order than autograd's), so these agree to float32 rounding of the attention's gradients, not bitwise.
        theirs.train(), ours.train()
        for net, y in ((theirs, onehot), (ours, labels)):
            torch.manual_seed(7)
            net(x, c_noise, y, augment_labels=augment).square().mean().backward()
        mine = dict(ours.named_parameters())
        out[f"max_rel_grad_diff_{name}"] = max(diff(mine[k].grad, p.grad) / float(p.grad.abs().max())
                                               for k, p in theirs.named_parameters() if p.grad.abs().max() > 0)
    return out


def count(net) -> int:
    return sum(p.numel() for p in net.parameters())


def counts(networks) -> dict:
    presets = {
        "ddpmpp-cifar10-uncond": ("SongUNet", edm.build_ddpmpp, 32, 0, dict(augment_dim=9)),
        "ddpmpp-cifar10-cond": ("SongUNet", edm.build_ddpmpp, 32, 10, dict(augment_dim=9)),
        "ncsnpp-cifar10-uncond": ("SongUNet", edm.build_ncsnpp, 32, 0, dict(augment_dim=9)),
        "ncsnpp-cifar10-cond": ("SongUNet", edm.build_ncsnpp, 32, 10, dict(augment_dim=9)),
        "adm-imagenet64-cond": ("DhariwalUNet", edm.build_adm, 64, 1000, dict(augment_dim=0)),
        "adm-imagenet64-cond-augment9": ("DhariwalUNet", edm.build_adm, 64, 1000, dict(augment_dim=9)),
    }
    arch_kw = {"ddpmpp": SONG["ddpmpp"] | dict(model_channels=128, channel_mult=[2, 2, 2]),
               "ncsnpp": SONG["ncsnpp"] | dict(model_channels=128, channel_mult=[2, 2, 2]),
               "adm": dict(model_channels=192, channel_mult=[1, 2, 3, 4])}  # train.py's --arch presets
    out = {}
    for name, (kind, build, res, classes, kw) in presets.items():
        with torch.device("meta"):
            theirs = getattr(networks, kind)(img_resolution=res, in_channels=3, out_channels=3, label_dim=classes,
                                             **arch_kw[name.split("-")[0]], **kw)
            ours = build(res, 3, classes, **kw)
        out[name] = {"official": count(theirs), "ours": count(ours)}
    return out


def gate(cases: dict) -> Gate:
    g = Gate()
    for name, r in cases.items():
        if name == "parameter-counts":
            for preset, c in r.items():
                g.equal(f"{name}/{preset}", c["ours"], c["official"])
            continue
        for key, bound in BOUNDS.items():
            g.at_most(f"{name}/{key}", r[key], bound)
        g.at_least(f"{name}/train_masks_matter", r["train_masks_matter"], MASKS_MATTER)
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--edm-src", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=RESULTS / "edm_equivalence.json")
    args = ap.parse_args()
    networks = official(args.edm_src)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    tiny = dict(model_channels=16, channel_mult=[1, 2], num_blocks=2, attn_resolutions=[8], dropout=0.1,
                augment_dim=9)
    cases = {
        "tiny-ddpmpp": compare(networks, "SongUNet", 16, 10, tiny | SONG["ddpmpp"]),
        "tiny-ncsnpp": compare(networks, "SongUNet", 16, 10, tiny | SONG["ncsnpp"]),
        "tiny-song-skip": compare(networks, "SongUNet", 16, 10, tiny | SONG["ncsnpp"] | dict(
            channel_mult=[1, 2, 2], encoder_type="skip", decoder_type="skip", attn_resolutions=[8, 4])),
        "tiny-adm": compare(networks, "DhariwalUNet", 8, 10, dict(
            model_channels=64, channel_mult=[1, 2], num_blocks=2, attn_resolutions=[8, 4], dropout=0.1,
            augment_dim=9)),
    }
    for name, r in cases.items():
        diffs = {k.removeprefix("max_abs_diff_"): v for k, v in r.items() if k.startswith(("max_abs_diff", "max_rel"))}
        print(f"{name:16s} " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    cases["parameter-counts"] = counts(networks)
    for name, c in cases["parameter-counts"].items():
        print(f"{name:30s} parameters: official {c['official']:,}, ours {c['ours']:,}")
    g = gate(cases)
    write_results(args.out, "diffrelay nets.edm vs NVlabs/edm training/networks.py, same weights and inputs",
                  sigmas=SIGMAS, c_noise=[math.log(s) / 4 for s in SIGMAS], cases=cases, gate=g.to_json())
    g.finish("check_edm_equivalence")


if __name__ == "__main__":
    main()
