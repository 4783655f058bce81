"""`diffrelay export`: a complete diffusers pipeline folder holding a model.pretrained run's weights.

The folder is the run's pipeline folder (model.pretrained) with its network replaced by a snapshot's weights
(EMA, raw, or a post-hoc EMA snapshot from `diffrelay phema`; a run with train.ema_decays: [] has its raw weights
only, which `--weights ema` then reads), written by diffusers' own save_pretrained, so
DiffusionPipeline.from_pretrained(folder) loads it. A LoRA run's adapter is merged into the base first (diffusers'
fuse_lora, then unload_lora; pretrained.lora.fuse with peft's merge for PixArt and HunyuanDiT): save_pretrained of a network with a live adapter would write peft's base_layer/lora_*
keys, which from_pretrained does not read (it initialises those weights anew, with only a warning).

Every other part is copied byte for byte. The folder is written beside its target and renamed into place; an
existing folder is replaced only when an earlier export wrote it (its diffrelay_export.json).
"""

import shutil
from pathlib import Path

from diffrelay import config, io
from diffrelay.errors import UserError

MARK = "diffrelay_export.json"  # what the export wrote, from which snapshot; marks the folder as ours


def main(args) -> int:
    cfg = config.load(args.config)
    where = ", ".join(map(str, args.config))
    model_cfg = cfg.to_dict()["model"]
    if model_cfg.get("pretrained") is None:
        raise UserError(f"{where}: model.pretrained is not set: export writes a diffusers pipeline folder, so it "
                        "needs the run's pipeline; sample the snapshot with `diffrelay sample` instead")
    out = Path(args.out)
    weights, decay, why = scored(args, cfg.to_dict(), where)
    if getattr(args, "lora_format", "diffusers") == "comfyui":  # the adapter alone, in kohya's keys
        return _comfyui(args, cfg.to_dict(), out, where, weights, decay, why)
    # Refused before any work: a folder (or file) this command did not write.
    io.check_replaceable(out, _ours, "a folder `diffrelay export` wrote", "choose another --out or move it aside")
    say(args.snapshot, weights, decay, why)
    record = export(args.snapshot, model_cfg, out, weights, decay)
    print(f"diffrelay: wrote {out} ({record['network']}: {record['weights']} weights of {args.snapshot}); load it "
          f"with DiffusionPipeline.from_pretrained({str(out)!r})")
    return 0


def scored(args, d: dict, where: str) -> tuple[str, float | None, str]:
    """(weights, EMA decay, where they come from) of an export: --weights and --ema-decay, else the weights the run
    samples and scores, so picks its best checkpoint by (sample.weights; sample.ema_decay, its first where a list).
    The LoRA recipes sample the raw adapter: an EMA export by default would be weights no score was made of."""
    s = d["sample"]
    weights, why = (args.weights, "--weights") if args.weights else (s["weights"], f"sample.weights of {where}")
    decay = args.ema_decay
    if decay is not None and weights == "raw":
        raise UserError(f"--ema-decay={decay:g}: the raw weights are exported ({why}), which have no EMA; add "
                        "--weights ema to export that EMA, or drop --ema-decay")
    if decay is None and weights == "ema":
        want = s.get("ema_decay")
        decay = want[0] if isinstance(want, list) else want
        why += " and sample.ema_decay" if decay is not None and not args.weights else ""
    return weights, decay, why


def say(snapshot, weights: str, decay: float | None, why: str) -> None:
    """One line before any work: which weights of the snapshot are exported, and why those."""
    from diffrelay.training import checkpoint

    meta = checkpoint.read_signed_meta(snapshot, checkpoint.SNAPSHOT_FORMAT, "snapshot")
    read = checkpoint.weights_of(meta, weights)
    kind = "raw" if read == "raw" else "EMA" if decay is None else f"EMA {decay:g}"
    why = why if read == weights else f"{why}; the run kept no EMA (train.ema_decays: [])"
    print(f"diffrelay: exporting the {kind} weights ({why}) of {snapshot}, step {meta.get('step')}")


def _comfyui(args, d: dict, out: Path, where: str, weights: str, decay, why: str) -> int:
    from diffrelay.pretrained import comfyui
    from diffrelay.training import checkpoint

    comfyui.check(d["model"], d["train"]["lora"], out, where)
    say(args.snapshot, weights, decay, why)
    net, meta = checkpoint.load_snapshot(args.snapshot, weights, model_cfg=d["model"], decay=decay)
    record = {"snapshot": str(Path(args.snapshot).resolve()), "step": meta.get("step"),
              "weights": checkpoint.weights_of(meta, weights) + ("" if decay is None else f" {decay}")}
    print(comfyui.write(net, d["train"]["lora"], out, record))
    return 0


def _ours(path: Path) -> bool:
    return path.is_dir() and (path / MARK).is_file()


def export(snapshot, model_cfg: dict, out: Path, weights: str = "ema", decay: float | None = None) -> dict:
    """Write the pipeline folder `out`; its record (also `out`/diffrelay_export.json)."""
    import torch

    from diffrelay.pretrained import folder
    from diffrelay.pretrained import weights as base_weights
    from diffrelay.training import checkpoint

    net, meta = checkpoint.load_snapshot(snapshot, weights, model_cfg=model_cfg, decay=decay)
    weights = checkpoint.weights_of(meta, weights)  # what was read: raw where the run kept no EMA
    pipe = folder.read(model_cfg["pretrained"])
    model = base_weights.text_net(net)
    lora = bool(getattr(model, "peft_config", None))
    if lora:  # into the base weights, then the adapter layers go: plain diffusers keys
        from diffrelay.pretrained import lora as lora_adapter

        lora_adapter.fuse(model)
    record = {"snapshot": str(Path(snapshot).resolve()), "snapshot_sha256": io.sha256_file(Path(snapshot)),
              "step": meta.get("step"), "weights": weights if decay is None else f"{weights} {decay}",
              "network": pipe.net, "lora_fused": lora, "pipeline": str(pipe.root),
              "pipeline_sha256": folder.manifest(pipe)}
    with io.atomic_dir(out, _ours) as tmp:
        shutil.copy2(pipe.root / "model_index.json", tmp / "model_index.json")
        for part in sorted(p.name for p in pipe.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            if part != pipe.net:  # every other part as it is: vae, text encoders, tokenizers, scheduler, ...
                shutil.copytree(pipe.root / part, tmp / part)
        with torch.no_grad():
            model.to(torch.float32).save_pretrained(tmp / pipe.net, safe_serialization=True)
        io.write_json(tmp / MARK, record)
    return record
