"""Training memory of the seed users' pipelines, full fine-tuning against LoRA, before any weight is downloaded
(issue 40, item 5): what `diffrelay validate` prints for such a run, computed here from each network's published
config alone.

  python benchmarks/pretrained_memory.py            # writes benchmarks/results/pretrained_memory.json

Each network is built as training builds it (objectives.build, the family's arch and text widths) on the meta
device (no memory, no weights), from the config.json of its diffusers folder on the Hub (configs(): the families' published rows, each with its
repository; the published parameter count beside it), and counted by nets.footprint: fp32 weights and gradients,
AdamW's two moments and one EMA copy (train.ema_decays: one decay), the training state diffrelay holds; and each
train.optimizer's state alone (optimizer_gb: training.optimizers.state_bytes, what validate prints for it). The LoRA
rows attach train.lora's family defaults (rank 4, each family's lora_targets) with peft on the meta network: only the
adapter gets gradients, moments and an EMA (the frozen base is shared, training.optim.EMA). Activations are not in
these figures: `diffrelay validate` measures them per run (resolution, batch, precision, checkpointing). The full
rows also give a process's state under train.sharding: fsdp2 on 8 and 16 GPUs (config.memory.sharded_state: the
state divided by the processes, plus the gathered bf16 weights of the two largest blocks).
"""

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE / "checks"))  # official.py

GB = 1e9


def configs() -> dict:
    """The families' published rows (families/<family>.py `published`): each network's config.json in its diffusers
    folder (less _class_name/_diffusers_version and the keys diffrelay sets from the text encoders and latents:
    sample_size, in_channels and the text widths, given in `text`), its objective and its published parameter
    count: SDXL's UNet 2.6 B (SDXL paper, Table 1), SD3-medium's transformer 2 B (its model card), HunyuanDiT 1.5 B
    (its model card), PixArt-Sigma 0.6 B (its paper), SD3.5 Large 8.1 B and Medium 2.5 B (their model cards),
    FLUX.1-dev 12 B (its model card; schnell is the same network less the guidance embedder)."""
    from diffrelay import families

    return {name: {**spec, "arch": f.arch, "targets": list(f.lora_targets)}
            for f in families.FAMILIES for name, spec in f.published.items()}


def model_section(spec: dict) -> dict:
    from diffrelay import config

    m = config.validate({})["model"]
    return {**m, "arch": spec["arch"], "kwargs": dict(spec["kwargs"]), "objective": spec["objective"],
            "class_conditional": False}


def measure(name: str, spec: dict) -> dict:
    from diffrelay import objectives
    from diffrelay.config.memory import sharded_state
    from diffrelay.nets import footprint, registry
    from diffrelay.pretrained import lora
    from diffrelay.training import optimizers

    channels, side = spec["latent"]
    out = {"config": spec["repo"], "published_params": spec["published"]}
    for kind in ("full", "lora"):
        with registry.on_device("meta"):
            net = objectives.build(model_section(spec), side, 0, channels, text=spec["text"])
            if kind == "lora":
                lora.attach(net, {"rank": 4, "alpha": 4, "dropout": 0.0, "target_modules": spec["targets"]}, 0)
        n = footprint.counts(net)
        state = footprint.state_bytes(n["params"], n["trainable"], None, 1, n["bytes_per_param"],
                                      n["buffer_bytes"])
        out[kind] = {"params": n["params"], "trainable": n["trainable"],
                     **{k: round(v / GB, 2) for k, v in state.items()},
                     "total_gb": round(sum(state.values()) / GB, 2),
                     # each train.optimizer's state alone, as validate counts it (training.optimizers.state_bytes)
                     "optimizer_gb": {o: round(optimizers.state_bytes(o, n) / GB, 3) for o in optimizers.CHOICES}}
        if kind == "full":  # train.sharding: fsdp2 (config.memory.sharded_state): the state / N + two gathered blocks
            def build():
                with registry.on_device("meta"):
                    return objectives.build(model_section(spec), side, 0, channels, text=spec["text"])

            for gpus in (8, 16):
                share, gathered = sharded_state(state, gpus, build, "bf16")
                out[kind][f"fsdp2_{gpus}_gpus_total_gb"] = round(sum(share.values()) / GB, 2)
                out[kind][f"fsdp2_{gpus}_gpus_gathered_gb"] = round(gathered / GB, 2)
    return out


def main() -> None:
    t0 = time.perf_counter()
    results = {name: measure(name, spec) for name, spec in configs().items()}
    print(f"{'pipeline':24} {'params':>14} {'full: state GB':>15} {'fsdp2 x8':>9} {'fsdp2 x16':>10} "
          f"{'LoRA: trainable':>16} {'state GB':>9}")
    for name, r in results.items():
        f = r["full"]
        print(f"{name:24} {f['params']:>14,} {f['total_gb']:>15.1f} {f['fsdp2_8_gpus_total_gb']:>9.1f} "
              f"{f['fsdp2_16_gpus_total_gb']:>10.1f} {r['lora']['trainable']:>16,} {r['lora']['total_gb']:>9.1f}")
    out = HERE / "results" / "pretrained_memory.json"
    from official import write_results  # atomic, with torch, machine and date

    write_results(out, "training state (fp32 weights, gradients, AdamW moments, one EMA) of each pipeline's network, "
                  "full and LoRA rank 4, from its published config on the meta device; activations not included; "
                  "full under train.sharding fsdp2 on 8 and 16 GPUs: the state / N plus two blocks' gathered bf16 "
                  "weights, a process",
                  seconds=round(time.perf_counter() - t0, 1), results=results)


if __name__ == "__main__":
    main()
