"""train.sharding: fsdp2 on one lent GPU (issue 55's GPU measurements), in one process, with torch alone:

  PYTHONPATH=src python3 benchmarks/gpu_fsdp2.py --out-dir "$OUT" [--budget 420]

1. DiT-XL/2 (diffrelay's, 675 M parameters) on 32x32x4 latents, bf16 autocast, batch 32, Adam and one EMA: steps/s and
   peak memory under DDP (a world of one) and under fsdp2 (training/sharding.shard: every block, then the root;
   MixedPrecisionPolicy bf16/fp32), the EMA moved shard by shard. On one GPU fsdp2 shards nothing: this is its
   overhead (the hooks, the copies into gathered buffers), not its saving.
2. The largest DiT (width 1152, depth doubled from 28) that trains one step under fsdp2 with activation checkpointing
   on this GPU, batch 8: the parameter count of the last that fit and of the first that did not.

Each figure is written to --out-dir/gpu_fsdp2.json as soon as it is measured; nothing starts past --budget seconds.
Exits 2 with one line where there is no CUDA device.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


SIZE = {"hidden": 1152, "heads": 16, "per_depth": 1}  # --cpu-check: a DiT of width 64 and 1/14 the depth


def build(depth: int):
    from diffrelay.nets.dit import DiT

    return DiT(32, 4, 1000, patch=2, depth=max(depth // SIZE["per_depth"], 1), hidden_size=SIZE["hidden"],
               num_heads=SIZE["heads"], out_channels=8)


def step_loop(net, ema, device, batch: int, steps: int) -> dict:
    opt = torch.optim.Adam([p for p in net.parameters() if p.requires_grad], lr=1e-4, fused=True)
    x = torch.randn(batch, 4, 32, 32, device=device)
    labels = torch.randint(0, 1000, (batch,), device=device)
    noise = torch.randn_like(x)
    sigma = torch.rand(batch, device=device)
    times = []
    for i in range(steps):
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = net(x + noise * sigma.view(-1, 1, 1, 1), sigma.log() / 4, labels)
            loss = (out - x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema.update(net, i)
        sync(device)
        times.append(time.perf_counter() - t0)
    steady = times[3:] or times
    return {"steps_per_s": round(len(steady) / sum(steady), 3), "peak_gib": peak(device)}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak(device) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device.type == "cuda" else None


def fresh(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def made(depth: int, device, how: str, checkpointing: bool = False):
    """(network, its EMA) as training makes them: DDP around a world of one, or fully_shard on both alike."""
    from diffrelay.training import optim, sharding

    torch.manual_seed(0)
    net = build(depth)  # on the CPU: fsdp2 moves each block's shard to the device (training/state.py)
    net.checkpointing = checkpointing
    if how == "ddp":
        net = net.to(device)
        ema = optim.EMA(net, [0.9999])
        return torch.nn.parallel.DistributedDataParallel(net, device_ids=[0] if device.type == "cuda" else None), \
            _Raw(ema, net)
    ema = optim.EMA(net, [0.9999])
    for module in (net, *ema.nets):
        sharding.shard(module, "bf16", device)
    ema.pairs = []  # found again on the sharded parameters
    return net, ema


class _Raw:
    """The EMA of DDP's inner network: updated from the module training holds, never through the wrapper."""

    def __init__(self, ema, net):
        self.ema, self.net = ema, net

    def update(self, _, step):
        self.ema.update(self.net, step)


def _params(depth: int) -> int:
    """Parameters of the DiT of `depth` blocks, counted on the meta device."""
    with torch.device("meta"):
        return sum(p.numel() for p in build(depth).parameters())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--budget", type=float, default=420)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--cpu-check", action="store_true", help="a 2-block run on the CPU: the script's own check")
    args = ap.parse_args()
    if args.cpu_check:
        SIZE.update(hidden=64, heads=4, per_depth=14)
    elif not torch.cuda.is_available():
        print("gpu_fsdp2: no CUDA device; run it on a GPU machine", file=sys.stderr)
        return 2
    start, out = time.time(), Path(args.out_dir) / "gpu_fsdp2.json"
    result = {"device": "cpu" if args.cpu_check else torch.cuda.get_device_name(0), "torch": torch.__version__}

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")

    from diffrelay.runtime import distributed

    device = distributed.pick_device("cpu" if args.cpu_check else "cuda")
    distributed.init(device)
    try:
        result["ditxl2_ddp"] = step_loop(*made(28, device, "ddp"), device, 32, args.steps)
        fresh(device)
        save()
        result["ditxl2_fsdp2"] = step_loop(*made(28, device, "fsdp2"), device, 32, args.steps)
        result["fsdp2_over_ddp_speed"] = round(result["ditxl2_fsdp2"]["steps_per_s"]
                                               / result["ditxl2_ddp"]["steps_per_s"], 3)
        save()
        print(json.dumps(result), flush=True)
        depth = 28
        while time.time() - start < args.budget and depth <= 28 * 64:
            fresh(device)
            try:
                net, ema = made(depth, device, "fsdp2", checkpointing=True)
                step_loop(net, ema, device, 8, 2)
                result["largest_fsdp2_checkpointing"] = {"depth": depth, "peak_gib": peak(device),
                                                         "params": _params(depth)}
                save()
                del net, ema
                depth *= 2
            except torch.OutOfMemoryError:
                result["first_out_of_memory"] = {"depth": depth, "params": _params(depth)}
                break
        save()
    finally:
        distributed.teardown()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
