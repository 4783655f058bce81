"""Each train.optimizer's step through diffrelay against the library's own optimizer in a bare loop (issue 68).

  python benchmarks/bench_optimizers.py [--steps 60] [--out PATH]

Two cases, on the CPU, one thread: the tests' tiny SD UNet with diffrelay's LoRA adapter (bench_ema.build: rank 4
on the attention projections; every adapter tensor is below the 4096 elements that the 8-bit and 4-bit optimizers
quantize, so they keep it at full width) and the same UNet trained whole (its large tensors quantized). The gradients of one forward and backward are computed once and set before
every step, so both sides time the optimizer's update alone, on the same gradients:
  bare       the library's class, built with the same arguments (optimizers.kwargs), `.step()` by hand;
  diffrelay  optim.build_optimizer (training/eager.py's step without torch._dynamo's graph breaks) and its
             LambdaLR schedule, stepped as training/train.py steps them (opt.step, sched.step, zero_grad kept out:
             both sides set the same gradients).
The two alternate a step at a time, `--steps` steps each (the first side alternating); medians of the step times
(on a shared 2-core machine the load moves by 15 % within seconds, so whole runs side by side do not compare). Both must end bit for bit equal, which is the
check that diffrelay's steps are the library's; the goal is diffrelay within 5 % of the bare loop. Also written:
the bytes each optimizer's state holds after the run against what `validate` says (optimizers.state_bytes).
Exits 1 when a pair differs in a bit or the time goal is missed. Writes benchmarks/results/optimizers.json.
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_ema import NETS, build  # noqa: E402

from diffrelay import config  # noqa: E402
from diffrelay.nets import footprint  # noqa: E402
from diffrelay.training import optim, optimizers  # noqa: E402

GOAL = 0.05


def settings(name: str):
    train = {"optimizer": name, "lr": 1.0 if name == "prodigy" else 1e-4, "warmup_steps": 0}
    if name == "prodigy":  # the same gradient every step: its step-size estimate d would grow past fp32's range
        train["optimizer_args"] = {"growth_rate": 1.01}
    over = {"train": train}
    if name == "schedulefree_adamw":
        over = {"train": train | {"ema_decays": []}, "sample": {"ema_decay": None}}
    return config.Config(config.validate(over)).train


def state_bytes(opt) -> int:
    def size(v) -> int:
        if type(v) is torch.Tensor:
            return v.numel() * v.element_size() if v.numel() > 1 else 0
        if isinstance(v, torch.Tensor):  # torchao's subclasses: the plain tensors they hold
            return sum(size(getattr(v, k)) for k in v.__tensor_flatten__()[0])
        if isinstance(v, dict):
            return sum(size(x) for x in v.values())
        return 0

    return sum(size(v) for per in opt.state.values() for v in per.values())


def trainable(case: str):
    """(the network, its trainable parameters) of a case, built afresh: the same weights every time."""
    net, params = build(NETS["tiny-sd"])
    if case == "full":
        net.model.requires_grad_(True)
        params = [p for p in net.parameters() if p.requires_grad]
    return net, params


def bench(case: str, name: str, grads, steps: int) -> dict:
    t = settings(name)
    sides = {}
    for side in ("bare", "diffrelay"):
        _, params = trainable(case)
        if side == "bare":
            opt = optimizers.optimizer_class(name)(params, **optimizers.kwargs(t, optimizers.CHOICES[name]))
            if name == "schedulefree_adamw":
                opt.train()
            sched = None
        else:
            opt = optim.build_optimizer(params, t)
            sched = optim.build_schedule(opt, t)
        sides[side] = (params, opt, sched)

    def run(side) -> float:
        params, opt, sched = sides[side]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        t0 = time.perf_counter()
        opt.step()
        if sched is not None:
            sched.step()
        return time.perf_counter() - t0

    run("bare"), run("diffrelay")  # first-use costs (torchao compiles its update)
    times = {"bare": [], "diffrelay": []}
    for i in range(steps):  # one step each in turn, the first side alternating: pairs that share the machine's state
        for side in ("bare", "diffrelay") if i % 2 else ("diffrelay", "bare"):
            times[side].append(run(side))
    same = all(torch.equal(a, b) for a, b in zip(sides["bare"][0], sides["diffrelay"][0], strict=True))
    bare, ours = statistics.median(times["bare"]), statistics.median(times["diffrelay"])
    held = state_bytes(sides["diffrelay"][1])
    holder = torch.nn.Module()
    holder.params = torch.nn.ParameterList(sides["diffrelay"][0])
    said = optimizers.state_bytes(name, footprint.counts(holder))
    row = {"bare_ms": round(bare * 1e3, 4), "diffrelay_ms": round(ours * 1e3, 4), "ratio": round(ours / bare, 4),
           "bitwise_equal": same, "state_bytes": held, "validate_says": said}
    print(f"{case:4s} {name:20s} bare {bare * 1e3:8.3f} ms  diffrelay {ours * 1e3:8.3f} ms  ({ours / bare - 1:+.1%})  "
          f"state {held:,} B (validate {said:,})  bitwise {same}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--out", default=str(HERE / "results" / "optimizers.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = {}
    for case in ("lora", "full"):
        net, params = trainable(case)
        side = NETS["tiny-sd"]["sample_size"]
        torch.manual_seed(1)
        x, t, text = torch.randn(4, 4, side, side), torch.tensor([10, 200, 500, 900]), torch.randn(4, 77, 32)
        with torch.no_grad():  # the adapter's B starts at 0: a gradient through A needs B moved (this copy only)
            moved = [p.add(0.1 * torch.randn_like(p)) for p in params]
        for p, m in zip(params, moved, strict=True):
            p.data = m
        net.model(x, t, encoder_hidden_states=text).sample.square().mean().backward()
        grads = [p.grad.detach().clone() for p in params]
        rows[case] = {"trainable_tensors": len(params), "trainable": sum(p.numel() for p in params),
                      "optimizers": {name: bench(case, name, grads, args.steps)
                                     for name in optimizers.CHOICES}}
    import diffusers

    record = {"what": "each train.optimizer's update (same gradients each step) through optim.build_optimizer and "
                      "its schedule vs the library's class in a bare loop; tiny SD UNet, LoRA rank 4 and whole; CPU, "
                      "1 thread",
              "machine": {"cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                          "torch": torch.__version__, "diffusers": diffusers.__version__, "threads": 1},
              "steps": args.steps, "goal_ratio": 1 + GOAL, "cases": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    bad = [f"{c} {n}" for c, case in rows.items() for n, r in case["optimizers"].items()
           if not r["bitwise_equal"] or r["ratio"] > 1 + GOAL]
    if bad:
        raise SystemExit(f"not bit for bit the library's, or more than {GOAL:.0%} slower: {', '.join(bad)}")


if __name__ == "__main__":
    main()
