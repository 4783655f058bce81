"""Our edm2 UNet (diffrelay.nets.edm2) against NVlabs/edm2's training/networks_edm2.py, on the same weights.

  python benchmarks/checks/check_edm2_equivalence.py --edm2-src /tmp/off/edm2

--edm2-src is a checkout of github.com/NVlabs/edm2 (its dnnlib, torch_utils and training packages are imported
from there at run time; nothing of it enters the package; it needs click and psutil). For each case edm2's
Precond is built with its own initialisation, every parameter (the zero-initialised gains too) is then moved by
seeded noise so that all of them matter, and its state dict is loaded strictly into ours through
edm2.official_keys. Both get the same inputs; labels are one-hot rows for edm2 and integers for ours, the null
class K (edm2's zero row) among them.

Cases (max abs difference; edm2's code runs in float32 only, float64 compares our float64 module with it):
  tiny-cond:    model_channels 16, channel_mult [1, 2], 1 block a level, attention at 8x8 (8 channels a head),
                16x16x4 input, 10 classes, dropout 0.1
  tiny-3level:  channel_mult [1, 2, 2], 2 blocks a level, attention at 16x16 and 4x4, 16x16x3 input, 5 classes,
                channel_mult_noise 2, channel_mult_emb 3
  tiny-uncond:  as tiny-cond without classes, 8x8x4 input
each in eval mode (edm2's unet(c_in x, c_noise, one-hot) against F; edm2's Precond (D, logvar) against
diffrelay's Denoiser around F and F.logvar), and in train mode
with the same dropout seed: outputs, logvar, gradients of a squared-sum loss, the weights after the forced weight
normalisation, a second training step, and ours with activation checkpointing on. idempotence: how many weight
elements a further normalisation of already normalised weights moves.
  loss:             edm2's EDM2Loss (P_mean -0.4, P_std 1.0, sigma_data 0.5, train mode), averaged, against
                    diffrelay's own training loss (objectives.edm.loss with uncertainty, as objectives.loss calls
                    it for edm2) on our network with the same draws
  parameter counts: XS..XXL at 64x64x4 with 1000 classes (edm2's ImageNet-512 latents), meta device, Precond
                    (UNet + logvar head) and UNet alone; state-dict names and shapes compared too
Bounds (BOUNDS below, also written to the JSON): 0 for every float32 figure and the loss (the same operations in
the same order: bit for bit); the float64 figures, ours in float64 against edm2's float32, about 10x the float32
rounding seen (outputs 4.0e-6, logvar 1.1e-6, gradients 1.4e-3 of gradients up to 1.5e4, weights 6.8e-7);
parameter counts, state-dict names and shapes equal. Exit status 1, one line per figure outside its bound.
Writes benchmarks/results/edm2_equivalence.json. Not a test: CI cannot fetch the official sources.
"""

import argparse
import sys
from pathlib import Path

import torch
from official import RESULTS, Gate, write_results
import torch.nn.functional as F

from diffrelay.nets import edm2, memory
from diffrelay.objectives import edm as edm_objective
from diffrelay.objectives.edm import Denoiser

PRESET_NAMES = {"xs": "XS", "s": "S", "m": "M", "l": "L", "xl": "XL", "xxl": "XXL"}
CASES = {
    "tiny-cond": dict(resolution=16, channels=4, classes=10, model_channels=16, channel_mult=[1, 2], num_blocks=1,
                      attn_resolutions=[8], channels_per_head=8, dropout=0.1),
    "tiny-3level": dict(resolution=16, channels=3, classes=5, model_channels=8, channel_mult=[1, 2, 2],
                        num_blocks=2, attn_resolutions=[16, 4], channels_per_head=4, dropout=0.2,
                        channel_mult_noise=2, channel_mult_emb=3),
    "tiny-uncond": dict(resolution=8, channels=4, classes=0, model_channels=16, channel_mult=[1, 2], num_blocks=1,
                        attn_resolutions=[8], channels_per_head=8, dropout=0.1),
}


def official(src: Path):
    sys.path.insert(0, str(src.resolve()))
    from training import networks_edm2, training_loop  # noqa: PLC0415 -- edm2's, from --edm2-src

    return networks_edm2, training_loop


def diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def pair(net_mod, case: dict, dtype=torch.float32):
    kw = {k: v for k, v in case.items() if k not in ("resolution", "channels", "classes")}
    torch.manual_seed(0)
    theirs = net_mod.Precond(case["resolution"], case["channels"], case["classes"], use_fp16=False, **kw)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    ours = edm2.build(case["resolution"], case["channels"], case["classes"], **kw)
    ours.load_state_dict(edm2.official_keys(theirs.state_dict()), strict=True)
    return theirs, ours.to(dtype)  # edm2's stays float32: its normalize refuses float64


def inputs(case: dict):
    """x, sigma, integer labels (ours), one-hot labels (edm2's), x_in = c_in x and c_noise, float32."""
    g = torch.Generator().manual_seed(2)
    n, k = 6, case["classes"]
    x = torch.randn(n, case["channels"], case["resolution"], case["resolution"], generator=g)
    sigma = torch.tensor([0.002, 0.05, 0.5, 1.0, 8.0, 80.0])
    labels = torch.tensor([0, 3, k, k - 1, k, 1]) if k else None  # the null class K twice
    onehot = F.one_hot(labels, k + 1)[:, :k].float() if k else None
    return x, sigma, labels, onehot, x / (0.25 + sigma.reshape(-1, 1, 1, 1) ** 2).sqrt(), sigma.log() / 4


def official_float64(net_mod) -> str:
    """What edm2's own code says when asked to run in float64."""
    try:
        net_mod.UNet(8, 4, 0, model_channels=8, channel_mult=[1]).double()(
            torch.zeros(1, 4, 8, 8, dtype=torch.float64), torch.zeros(1, dtype=torch.float64), None)
    except RuntimeError as e:
        return f"{type(e).__name__}: {e}"
    return "runs"


def eval_case(net_mod, case: dict, dtype) -> dict:
    theirs, ours = pair(net_mod, case, dtype)
    theirs.eval(), ours.eval()
    x, sigma, labels, onehot, x_in, c_noise = inputs(case)
    with torch.no_grad():
        want, got = theirs.unet(x_in, c_noise, onehot), ours(x_in.to(dtype), c_noise.to(dtype), labels)
        d_want, lv_want = theirs(x, sigma, onehot, return_logvar=True)
        x, sigma = x.to(dtype), sigma.to(dtype)
        d_got, lv_got = Denoiser(ours, 0.5)(x, sigma, labels), ours.logvar(sigma.log() / 4)
    return {"max_abs_output": float(want.abs().max()), "unet_max_abs_diff": diff(got, want),
            "precond_D_max_abs_diff": diff(d_got, d_want), "logvar_max_abs_diff": diff(lv_got, lv_want),
            "logvar_shape": list(lv_got.shape)}


def train_step(net, call, seed: int):
    """One training forward and backward of call(net) under a torch seed (the dropout masks)."""
    net.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out, lv = call(net)
    (out.square().sum() + lv.square().sum()).backward()
    return out.detach(), lv.detach()


def train_case(net_mod, case: dict, dtype, checkpointing: bool = False) -> dict:
    theirs, ours = pair(net_mod, case, dtype)
    theirs.train(), ours.train()
    if checkpointing:
        assert memory.enable(ours) > 0
    _, _, labels, onehot, x_in, c_noise = inputs(case)

    def run_theirs(net):
        return net.unet(x_in, c_noise, onehot), net.logvar_linear(net.logvar_fourier(c_noise))

    def run_ours(net):
        return net(x_in.to(dtype), c_noise.to(dtype), labels), net.logvar(c_noise.to(dtype))

    out = {}
    for step in (1, 2):  # the second step starts from weights the first one normalised
        want, lv_want = train_step(theirs, run_theirs, seed=10 + step)
        got, lv_got = train_step(ours, run_ours, seed=10 + step)
        theirs_state = edm2.official_keys(theirs.state_dict())
        grads = {k.removeprefix("unet."): p.grad for k, p in theirs.named_parameters()}
        out[f"step{step}"] = {
            "output_max_abs_diff": diff(got, want), "logvar_max_abs_diff": diff(lv_got.flatten(), lv_want.flatten()),
            "grad_max_abs_diff": max(diff(p.grad, grads[k]) for k, p in ours.named_parameters()),
            "max_abs_grad": max(float(g.abs().max()) for g in grads.values()),
            "weights_after_max_abs_diff": max(diff(v, theirs_state[k]) for k, v in ours.state_dict().items())}
    return out


def idempotence(net_mod, case: dict) -> dict:
    """After one training forward every weight is normalised; how much does normalising it again move?"""
    theirs, _ = pair(net_mod, case)
    theirs.train()
    x, sigma, _, onehot, _, _ = inputs(case)
    with torch.no_grad():
        theirs(x, sigma, onehot, return_logvar=True)
    changed = total = 0
    worst = 0.0
    for name, p in theirs.named_parameters():
        if p.ndim >= 2:  # MPConv weights
            p = p.detach()
            again = edm2.normalize(p)
            changed += int((again != p).sum())
            total += p.numel()
            worst = max(worst, float(((again - p).abs() / p.abs().clamp_min(1e-30)).max()))
    return {"weight_elements": total, "moved_by_a_second_normalisation": changed, "max_relative_move": worst,
            "bitwise_idempotent": changed == 0}


def loss_case(net_mod, loop_mod, case: dict) -> dict:
    """edm2's EDM2Loss against diffrelay's own loss function (not a restatement of it) on the same draws."""
    theirs, ours = pair(net_mod, case)
    theirs.train(), ours.train()
    x, _, labels, onehot, _, _ = inputs(case)
    p_mean, p_std, sd = -0.4, 1.0, 0.5
    torch.manual_seed(5)
    want = loop_mod.EDM2Loss(P_mean=p_mean, P_std=p_std, sigma_data=sd)(theirs, x, onehot).detach()
    torch.manual_seed(5)  # the same draws in the same order: ln sigma, the noise, then dropout
    rnd, noise = torch.randn([x.shape[0], 1, 1, 1]), torch.randn_like(x)
    # objectives.loss calls this for model.arch edm2: uncertainty on. It returns the mean over every element;
    # edm2's training loop sums EDM2Loss's elements, which objectives.loss matches with loss_reduction sum.
    got = edm_objective.loss(Denoiser(ours, sd), x, labels, rnd.flatten(), noise, p_mean, p_std, sd,
                             uncertainty=True).detach()
    return {"loss_official_mean": float(want.mean()), "loss_ours": float(got),
            "abs_diff": abs(float(got.double() - want.mean().double()))}


def counts(net_mod) -> dict:
    out = {}
    for preset, name in PRESET_NAMES.items():
        with torch.device("meta"):
            theirs = net_mod.Precond(64, 4, 1000, model_channels=edm2.PRESETS[preset]["model_channels"])
            ours = edm2.build(64, 4, 1000, preset=preset)
        theirs_state = edm2.official_keys(theirs.state_dict())
        ours_state = ours.state_dict()
        out[name] = {
            "official": sum(p.numel() for p in theirs.parameters()), "ours": sum(p.numel() for p in ours.parameters()),
            "official_unet": sum(p.numel() for p in theirs.unet.parameters()),
            "ours_unet": sum(p.numel() for n, p in ours.named_parameters() if not n.startswith("logvar_")),
            "state_dict_same_names_and_shapes": theirs_state.keys() == ours_state.keys()
            and all(theirs_state[k].shape == ours_state[k].shape for k in ours_state)}
    return out


# Bounds per figure. float32: the same operations in the same order, bit for bit. float64: ours in float64 against
# edm2's float32 (its normalize refuses float64), so float32 rounding; about 10x what was seen.
BOUNDS = {"eval_float32": {"unet_max_abs_diff": 0.0, "precond_D_max_abs_diff": 0.0, "logvar_max_abs_diff": 0.0},
          "eval_float64": {"unet_max_abs_diff": 3e-5, "precond_D_max_abs_diff": 2e-5,  # 2.7e-6, 1.5e-6 seen
                           "logvar_max_abs_diff": 2e-5},  # 1.1e-6 seen
          "train_float32": {"output_max_abs_diff": 0.0, "logvar_max_abs_diff": 0.0, "grad_max_abs_diff": 0.0,
                            "weights_after_max_abs_diff": 0.0},
          "train_float64": {"output_max_abs_diff": 4e-5, "logvar_max_abs_diff": 1e-5,  # 4.0e-6, 9.2e-7 seen
                            "grad_max_abs_diff": 1.5e-2,  # 1.4e-3 seen, of gradients up to 1.5e4
                            "weights_after_max_abs_diff": 7e-6},  # 6.8e-7 seen
          "train_float32_checkpointing": {"output_max_abs_diff": 0.0, "logvar_max_abs_diff": 0.0,
                                          "grad_max_abs_diff": 0.0, "weights_after_max_abs_diff": 0.0}}
LOSS_BOUND = 0.0  # the same elements averaged the same way


def gate(cases: dict) -> Gate:
    g = Gate()
    for name in CASES:
        for mode, bounds in BOUNDS.items():
            r = cases[name][mode]
            for step, d in (r.items() if "step1" in r else [("", r)]):
                for key, bound in bounds.items():
                    g.at_most("/".join(filter(None, (name, mode, step, key))), d[key], bound)
    g.at_most("loss/abs_diff", cases["loss"]["abs_diff"], LOSS_BOUND)
    for preset, c in cases["parameter-counts"].items():
        g.equal(f"parameter-counts/{preset}", c["ours"], c["official"])
        g.equal(f"parameter-counts/{preset}/unet", c["ours_unet"], c["official_unet"])
        g.equal(f"parameter-counts/{preset}/state_dict_same_names_and_shapes", c["state_dict_same_names_and_shapes"],
                True)
    return g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--edm2-src", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=RESULTS / "edm2_equivalence.json")
    args = ap.parse_args()
    net_mod, loop_mod = official(args.edm2_src)
    cases = {}
    for name, case in CASES.items():
        cases[name] = {
            "eval_float32": eval_case(net_mod, case, torch.float32),
            "eval_float64": eval_case(net_mod, case, torch.float64),
            "train_float32": train_case(net_mod, case, torch.float32),
            "train_float64": train_case(net_mod, case, torch.float64),
            "train_float32_checkpointing": train_case(net_mod, case, torch.float32, checkpointing=True),
            "idempotence": idempotence(net_mod, case)}
    cases["official_in_float64"] = official_float64(net_mod)
    cases["loss"] = loss_case(net_mod, loop_mod, CASES["tiny-cond"])
    cases["parameter-counts"] = counts(net_mod)
    for name in CASES:
        for mode, r in cases[name].items():
            steps = [d for d in r.values() if isinstance(d, dict)] or [r]
            diffs = [v for d in steps for k, v in d.items() if k.endswith("diff")]
            if diffs:
                print(f"{name:12s} {mode:28s} max diff {max(diffs):.3g}")
        print(f"{name:12s} idempotence: {cases[name]['idempotence']}")
    print(f"loss: |objectives.edm.loss - mean EDM2Loss| = {cases['loss']['abs_diff']:.3g} "
          f"(EDM2Loss mean {cases['loss']['loss_official_mean']:.6g})")
    for name, c in cases["parameter-counts"].items():
        print(f"{name:4s} parameters: official {c['official']:,}, ours {c['ours']:,} (UNet {c['official_unet']:,} "
              f"/ {c['ours_unet']:,}), same state-dict names and shapes: {c['state_dict_same_names_and_shapes']}")
    g = gate(cases)
    write_results(args.out, "diffrelay nets.edm2 vs NVlabs/edm2 training/networks_edm2.py, same weights and inputs",
                  cases=cases, gate=g.to_json())
    g.finish("check_edm2_equivalence")


if __name__ == "__main__":
    main()
