"""The EMA update of a LoRA run, per training step: the walk of every parameter pair it did before (restated below,
as training/optim.py had it) against optim.EMA.update, which moves the trainable tensors it listed once (optim.Pairs).

  python benchmarks/bench_ema.py [--updates 200] [--repeat 5] [--out PATH]

Two diffusers UNet2DConditionModels with diffrelay's LoRA adapter (pretrained.lora.attach, rank 4, the attention
projections diffusers' scripts adapt) and one EMA (train.ema_decays [0.999]), on the CPU, one thread:
  tiny-sd   the tests' tiny SD UNet (tests/pipelines.py UNET: 2 levels, 16/32 channels)
  sd15-thin Stable Diffusion 1.5's layout (4 levels, 2 layers a block, its block types, channels 1:2:4:4: the same
            686 base tensors) with 16/32/64/64 channels, so a step costs little beside the walk
Both ways run alternately `--repeat` times, `--updates` updates each; medians. Both must end bit for bit equal.
Beside them, one training step of the same network (forward, backward, AdamW over the adapter; batch 4, 77 tokens)
gives the EMA's share of a step. Writes benchmarks/results/ema.json.
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from diffrelay.pretrained import lora
from diffrelay.training import optim

HERE = Path(__file__).resolve().parent
DECAY = 0.999
NETS = {
    "tiny-sd": {"block_out_channels": [16, 32], "layers_per_block": 1, "attention_head_dim": 8, "norm_num_groups": 8,
                "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D"],
                "up_block_types": ["CrossAttnUpBlock2D", "UpBlock2D"], "sample_size": 8},
    "sd15-thin": {"block_out_channels": [16, 32, 64, 64], "layers_per_block": 2, "attention_head_dim": 8,
                  "norm_num_groups": 8, "sample_size": 16,
                  "down_block_types": ["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                  "up_block_types": ["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3},
}


@torch.no_grad()
def walk_update(avgs, net, step: int) -> None:
    """optim.EMA.update with lerp_towards as they were: every parameter pair of the network walked each step to find
    the ones the average holds itself (not shared: trainable), and every buffer."""
    for avg in avgs:
        d = min(DECAY, (1 + step) / (10 + step))
        pairs = [(a, p.detach()) for a, p in zip(avg.parameters(), net.parameters(), strict=True) if a is not p]
        if pairs:
            torch._foreach_lerp_(*map(list, zip(*pairs)), 1 - d)
        buffers = list(avg.buffers())
        if buffers:
            torch._foreach_copy_(buffers, list(net.buffers()))


def build(unet_kwargs: dict):
    """An objective-like wrapper (.model, as pretrained.weights.text_net reads) of a UNet with the LoRA adapter."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.model = UNet2DConditionModel(**(unet_kwargs | {"in_channels": 4, "out_channels": 4,
                                                          "cross_attention_dim": 32}))
    spec = {"rank": 4, "alpha": 4.0, "dropout": 0.0, "target_modules": list(lora.TARGETS)}
    return holder, lora.attach(holder, spec, 0)


def time_updates(update, updates: int) -> float:
    t0 = time.perf_counter()
    for step in range(updates):
        update(step)
    return (time.perf_counter() - t0) / updates


def bench(name: str, unet_kwargs: dict, updates: int, repeat: int) -> dict:
    net, trainable = build(unet_kwargs)
    old, new = optim.EMA(net, [DECAY]), optim.EMA(net, [DECAY])
    with torch.no_grad():  # the adapter's B starts at 0: give the averages something to move towards
        for p in trainable:
            p.add_(torch.randn_like(p))
    times = {"walk": [], "listed": []}
    for _ in range(repeat):
        times["walk"].append(time_updates(lambda s: walk_update(old.nets, net, s), updates))
        times["listed"].append(time_updates(lambda s: new.update(net, s), updates))
    same = all(torch.equal(a, b) for a, b in zip(old.nets[0].state_dict().values(), new.nets[0].state_dict().values()))
    # One training step without its EMA update: forward, backward and AdamW over the adapter.
    side = unet_kwargs["sample_size"]
    x, t, text = torch.randn(4, 4, side, side), torch.tensor([10, 200, 500, 900]), torch.randn(4, 77, 32)
    opt = torch.optim.AdamW(trainable, lr=1e-4, foreach=False)

    def train_step(_):
        net.model(x, t, encoder_hidden_states=text).sample.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    train_step(0)  # first-use costs
    step_s = statistics.median(time_updates(train_step, 5) for _ in range(3))
    walk, listed = statistics.median(times["walk"]), statistics.median(times["listed"])
    row = {"tensors": len(list(net.parameters())), "trainable": len(trainable),
           "buffers": len(list(net.buffers())), "ema_update_ms": {"walk": round(walk * 1e3, 4),
                                                                  "listed": round(listed * 1e3, 4)},
           "speedup": round(walk / listed, 1), "train_step_ms_without_ema": round(step_s * 1e3, 2),
           "ema_share_of_step": {"walk": round(walk / (step_s + walk), 4), "listed": round(listed / (step_s + listed), 4)},
           "bitwise_equal": same}
    print(f"{name:10s} {row['tensors']:4d} tensors ({row['trainable']} trainable): EMA update {walk * 1e3:.3f} ms "
          f"walked, {listed * 1e3:.3f} ms listed ({row['speedup']}x); step {step_s * 1e3:.1f} ms, EMA share "
          f"{row['ema_share_of_step']['walk']:.1%} -> {row['ema_share_of_step']['listed']:.1%}; bitwise equal {same}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--updates", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "ema.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = {name: bench(name, kwargs, args.updates, args.repeat) for name, kwargs in NETS.items()}
    if not all(r["bitwise_equal"] for r in rows.values()):
        raise SystemExit("the listed update is not bit for bit the walked one")
    import diffusers

    record = {"what": "optim.EMA.update of a LoRA UNet, one EMA, per step: the walk of every parameter pair "
                      "(before) vs the trainable tensors listed once (optim.Pairs)",
              "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                          "torch": torch.__version__, "diffusers": diffusers.__version__, "threads": 1},
              "updates": args.updates, "repeat": args.repeat, "nets": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
