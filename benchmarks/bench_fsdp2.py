"""train.sharding: fsdp2 on the CPU, 2 processes (gloo): `diffrelay train` against a bare fully_shard loop, and the
training state each process holds under ddp and fsdp2 on the same network.

  python benchmarks/bench_fsdp2.py [--steps 30] [--hidden 256] [--depth 8] [--batch 16]

The bare loop is the plainest code doing the same work: the same DiT (diffrelay's, so the arithmetic is the same),
`fully_shard` on each block and the root written out here, EDM's loss, Adam, gradient clipping and one EMA sharded
alike and moved shard by shard, random batches made before the clock starts; no data loader, no per-step seeding,
no logging, no reductions beyond the loss. diffrelay's figure is the steps/s its training log reports after the
first window. Both run twice; the ratio is of the means. Writes benchmarks/results/fsdp2.json.

State bytes: the parameters, gradients, optimizer moments and EMA a process holds after a step (each shard's
bytes), and its peak RSS (ru_maxrss, which includes Python, torch and the activations).
"""

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def model(args) -> dict:
    return {"arch": "dit", "class_conditional": True, "sigma_data": 0.5,
            "kwargs": {"patch": 2, "hidden_size": args.hidden, "depth": args.depth, "num_heads": 4}}


def worker(args) -> None:
    """One process of the bare loop (under torchrun): time `args.steps` steps, report state bytes and peak RSS."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from diffrelay import objectives
    from diffrelay.objectives import edm
    from diffrelay.training import optim

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = objectives.build(model(args), args.resolution, 10, 3)
    ema = optim.EMA(net, [0.999])
    if args.worker == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        for module in (net, *ema.nets):
            for block in reversed(list(module.net.blocks)):
                fully_shard(block, mesh=mesh)
            fully_shard(module, mesh=mesh)
        ema.pairs = []
    else:
        net = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4, foreach=False)
    g = torch.Generator().manual_seed(rank)
    micro = args.batch // world
    batches = [(torch.randn(micro, 3, args.resolution, args.resolution, generator=g),
                torch.randint(0, 10, (micro,), generator=g), torch.randn(micro, generator=g),
                torch.randn(micro, 3, args.resolution, args.resolution, generator=g)) for _ in range(4)]
    raw = net if args.worker == "fsdp2" else net.module
    t0 = None
    for step in range(args.steps + 3):
        if step == 3:  # after the first steps (allocations, lazy init)
            t0 = time.perf_counter()
        images, labels, rnd, noise = batches[step % 4]
        loss = edm.loss(net, images, labels, rnd, noise, -1.2, 1.2, 0.5)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        ema.update(raw, step)
        opt.zero_grad(set_to_none=False)  # kept, so the state bytes below count the gradients
    rate = args.steps / (time.perf_counter() - t0)

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = [local(p) for p in net.parameters()]
    state = {"weights": sum(p.numel() * p.element_size() for p in params),
             "gradients": sum(local(p.grad).numel() * 4 for p in net.parameters() if p.grad is not None),
             "optimizer": sum(local(v).numel() * local(v).element_size() for s in opt.state.values()
                              for v in s.values() if torch.is_tensor(v) and v.dim() > 0),
             "ema": sum(local(p).numel() * 4 for e in ema.nets for p in e.parameters())}
    out = {"rank": rank, "steps_per_s": rate, "state_bytes": state, "state_total": sum(state.values()),
           "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    Path(f"{args.out}.rank{rank}").write_text(json.dumps(out))
    dist.destroy_process_group()


def bare(args, kind: str, tmp: Path) -> list[dict]:
    out = tmp / f"bare-{kind}"
    subprocess.run([BIN / "torchrun", "--standalone", "--nproc-per-node=2", __file__, "--worker", kind, "--out",
                    out, "--steps", str(args.steps), "--hidden", str(args.hidden), "--depth", str(args.depth),
                    "--batch", str(args.batch), "--resolution", str(args.resolution)], check=True,
                   capture_output=True)
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in (0, 1)]


def ours(args, kind: str, tmp: Path, i: int) -> float:
    run = tmp / f"ours-{kind}-{i}"
    cfg = {"run": {"name": "b", "results": str(run), "resources": str(tmp / "resources"), "device": "cpu"},
           "data": {"kind": "shapes", "resolution": args.resolution, "count": 256, "seed": 0},
           "model": model(args),
           "train": {"total_steps": args.steps + 3, "segment_steps": args.steps + 3, "batch_size": args.batch,
                     "nproc_per_node": 2, "lr": 1e-4, "warmup_steps": 0, "log_every": 3, "ema_decays": [0.999],
                     "sharding": kind, "grad_clip": 1.0}}
    path = tmp / f"{kind}-{i}.yaml"
    path.write_text(json.dumps(cfg))
    subprocess.run([BIN / "diffrelay", "prepare", "--config", path], check=True, capture_output=True)
    subprocess.run([BIN / "torchrun", "--standalone", "--nproc-per-node=2", "-m", "diffrelay", "train", "--config",
                    path], check=True, capture_output=True)
    records = [json.loads(x) for x in (run / "b/metrics/train.jsonl").read_text().splitlines()]
    rates = [r["steps_per_s"] for r in records if "steps_per_s" in r][1:]  # after the first window
    return sum(rates) / len(rates)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--resolution", type=int, default=16)
    ap.add_argument("--worker", choices=["fsdp2", "ddp"])
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    import torch

    result = {"settings": vars(args) | {"processes": 2, "threads": 1},
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for kind in ("fsdp2", "ddp"):
            bares = [bare(args, kind, tmp) for _ in range(2)]
            mine = [ours(args, kind, tmp, i) for i in range(2)]
            b = sum(r[0]["steps_per_s"] for r in bares) / 2
            m = sum(mine) / 2
            result[kind] = {"bare_steps_per_s": round(b, 3), "diffrelay_steps_per_s": round(m, 3),
                            "ratio": round(m / b, 3), "runs_bare": [round(r[0]["steps_per_s"], 3) for r in bares],
                            "runs_diffrelay": [round(x, 3) for x in mine],
                            "state_bytes_a_process": bares[0][0]["state_bytes"],
                            "state_total_mib_a_process": round(bares[0][0]["state_total"] / 2**20, 2),
                            "peak_rss_mib_a_process": [round(r["peak_rss_mib"], 1) for r in bares[0]]}
            print(f"{kind}: bare {b:.3f} steps/s, diffrelay {m:.3f} steps/s, ratio {m / b:.3f} (goal >= 0.9); "
                  f"state {result[kind]['state_total_mib_a_process']} MiB a process, "
                  f"peak RSS {result[kind]['peak_rss_mib_a_process']} MiB", flush=True)
    result["state_fsdp2_over_ddp"] = round(result["fsdp2"]["state_total_mib_a_process"]
                                           / result["ddp"]["state_total_mib_a_process"], 3)
    (HERE / "results" / "fsdp2.json").write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(f"fsdp2 state / ddp state a process: {result['state_fsdp2_over_ddp']}")


if __name__ == "__main__":
    sys.exit(main())
