"""EDM's training as published, checked without torch: train.loss_reduction, train.ema_halflife_kimg and
ema_rampup_ratio (or train.ema_decays: [] alone: no EMA), train.lr_schedule inv_sqrt with lr_ref_batches,
train.warmup_kimg and train.augment. Which combinations are refused (check_config, called when a config is read)
and how they enter a run's trajectory (trajectory: each drops out at its default, so runs that never set them keep
their hash).

Imports the base modules and nets only.
"""

import json

from diffrelay import nets

# The values that train as before these keys existed.
DEFAULTS = {"loss_reduction": "mean", "ema_halflife_kimg": None, "warmup_kimg": None, "lr_ref_batches": None,
            "augment": 0.0, "lora": None, "optimizer_args": {}, "prior_loss_weight": 1.0}
# What a run's trajectory leaves out at its default (these keys above, train.lora's added since it existed:
# config.identity.trajectory_of), so that runs from before the key keep their hash: a record without it was made so.
OMITTED = {f"train.{k}": v for k, v in DEFAULTS.items()} | {"train.lora.kind": "lora", "train.lora.quantize_base": None}
AUGMENT_LABELS = 9  # EDM's CIFAR-10 pipe (data/edm_augment.py EDM_CIFAR10.label_dim; EDM train.py:146)


def trajectory(train: dict) -> dict:
    """A trajectory's train section without these keys at their defaults, and without ema_rampup_ratio
    when no half-life reads it."""
    out = {k: v for k, v in train.items() if k not in DEFAULTS or v != DEFAULTS[k]}
    if out.get("ema_halflife_kimg") is None:
        out.pop("ema_rampup_ratio", None)
    return out


def recorded(key: str, value):
    """A trajectory's `value` at `key` (config.lookup's None where the key is left out) as the run trains with it:
    the default of a key left out at its default (a run made with train.lora.kind lora records no kind)."""
    return OMITTED[key] if value is None and key in OMITTED else value


# (model.arch, model.objective) of a paper's recipe -> (its train.loss_reduction, who, where the official code reduces).
PAPER_REDUCTION = {
    **{(arch, "edm"): ("sum", "EDM", "training/training_loop.py:132") for arch in ("ddpmpp", "ncsnpp", "adm")},
    ("edm2", "edm"): ("sum", "edm2", "training/training_loop.py:225"),
    ("adm", "ddpm"): ("mean", "ADM", "guided_diffusion/gaussian_diffusion.py:809 mean_flat"),
}


def paper_notes(d: dict) -> list[str]:
    """Notes, not errors: a papers' network trained with another loss reduction than its paper's. Either trains;
    Adam's steps barely change, but the gradients and logged loss are C x H x W times apart, so Adam's eps,
    train.grad_clip and the fp16 loss scale act at another scale than in the paper."""
    m, mine = d["model"], d["train"]["loss_reduction"]
    paper = PAPER_REDUCTION.get((m["arch"], m["objective"]))
    if paper is None or paper[0] == mine:
        return []
    want, who, where = paper
    return [f"train.loss_reduction is {mine}; {who} trains model.arch {m['arch']} with {want} ({where}): gradients "
            f"and the logged loss are C x H x W times apart from the paper's; set train.loss_reduction: {want} to "
            "train as the paper"]


def check_config(d: dict) -> list[tuple[str, str]]:
    """(key, message) pairs for combinations of these keys that cannot work; empty when all is well."""
    t, s, bad = d["train"], d["sample"], []
    half, decays = t["ema_halflife_kimg"], t["ema_decays"]
    if half is not None and decays:
        bad.append((f"train.ema_halflife_kimg={half}", f"EDM's one EMA replaces those of train.ema_decays={decays}; "
                    "set train.ema_decays: [] (or drop the half-life)"))
    if half is None and not decays and s["ema_decay"] is not None:  # no EMA (diffusers' LoRA scripts keep none)
        bad.append((f"sample.ema_decay={json.dumps(s['ema_decay'])}", "train.ema_decays: [] keeps no EMA, so "
                    "sampling uses the raw weights; set sample.ema_decay: null, or give train.ema_decays those "
                    "decays"))
    if half is not None and s["ema_decay"] is not None:
        bad.append((f"sample.ema_decay={json.dumps(s['ema_decay'])}", f"train.ema_halflife_kimg={half} trains one "
                    "EMA, which is sampled by default; set sample.ema_decay: null"))
    if t["warmup_kimg"] is not None and t["warmup_steps"]:
        bad.append((f"train.warmup_kimg={t['warmup_kimg']}", f"and train.warmup_steps={t['warmup_steps']} are two "
                    "warm-ups; set train.warmup_steps: 0 (EDM's and edm2's warm-up is warmup_kimg), or drop warmup_kimg"))
    ref = t["lr_ref_batches"]
    if t["lr_schedule"] == "inv_sqrt" and ref is None:
        bad.append(("train.lr_schedule=inv_sqrt", "needs train.lr_ref_batches, the step from which the LR falls as "
                    "1/sqrt(step) (edm2: 70000); set it"))
    if t["lr_schedule"] != "inv_sqrt" and ref is not None:
        bad.append((f"train.lr_ref_batches={ref}", f"applies to train.lr_schedule: inv_sqrt only (this run's is "
                    f"{t['lr_schedule']}); set that schedule, or drop lr_ref_batches"))
    if t["augment"] > 0:
        bad += _check_augment(f"train.augment={t['augment']}", d["model"], d["data"])
    if t["sharding"] == "fsdp2":
        bad += _check_fsdp2(d["model"], t)
    if t["activation_checkpointing"] == "offload" and t["compile"]:
        bad.append(("train.activation_checkpointing=offload", "moves saved tensors with autograd hooks, not verified "
                    "under train.compile; set train.compile: false, or activation_checkpointing: true"))
    if t["block_swap"]:
        bad += _check_block_swap(d["model"], t)
    return bad


def _check_block_swap(m: dict, t: dict) -> list[tuple[str, str]]:
    """What runtime/block_swap.py cannot swap."""
    from diffrelay import families

    key, family = f"train.block_swap={t['block_swap']}", families.of_config(m)
    if t["lora"] is None:
        return [(key, "swaps a LoRA run's frozen base, and a full fine-tune trains every weight (they would travel "
                 "with their gradients and optimizer state); set train.lora, or train.block_swap: 0")]
    if family is None or not family.swap_lists:
        name = family.short if family else m["arch"]
        return [(key, f"{name} names no transformer blocks to swap (docs/gpus.md, \"Block swap\": the transformer "
                 "families); set train.block_swap: 0")]
    checks = [(not t["activation_checkpointing"], "train.activation_checkpointing: true (a swapped block runs its "
               "forward again in the backward, so no saved tensor holds its weights)"),
              (t["sharding"] == "fsdp2", "train.sharding: ddp (fully_shard already moves the blocks' weights)"),
              (t["compile"], "train.compile: false (the swap's hooks run between the blocks)")]
    return [(key, f"needs {need}") for bad, need in checks if bad]


def _check_fsdp2(m: dict, t: dict) -> list[tuple[str, str]]:
    """What fully_shard cannot train as diffrelay does under DDP (training/sharding.py)."""
    if t["precision"] == "fp16":  # GradScaler knows no DTensor gradients; torchtitan trains FSDP2 in bf16 too
        return [("train.sharding=fsdp2", "trains in fp32 or bf16 (fp16's gradient scaler does not take sharded "
                 "gradients); set train.precision: bf16")]
    if m["arch"] == "edm2":  # MPConv writes its normalised weight in forward (edm2 training/networks_edm2.py, MPConv.forward)
        return [("train.sharding=fsdp2", "edm2's forced weight normalisation writes the weights in forward, and "
                 "fully_shard's gathered copy of a block is dropped after it; train model.arch edm2 with "
                 "train.sharding: ddp")]
    if t["channels_last"]:  # fully_shard: "FSDP does not support non-contiguous parameters yet" (torch 2.14)
        return [("train.sharding=fsdp2", "fully_shard takes contiguous weights only, and train.channels_last stores "
                 "convolutions' weights channels-last; set train.channels_last: false")]
    return []


def _check_augment(key: str, m: dict, data: dict) -> list[tuple[str, str]]:
    """EDM's pipe gives pixels to a network that takes its 9 augmentation labels."""
    if data["encoder"] != "none":
        return [(key, f"EDM's augmentation pipe transforms pixels, and data.encoder={data['encoder']} trains on "
                 "latents; set train.augment: 0 (data.xflip flips a latent run's images)")]
    if m["objective"] != "edm":
        return [(key, f"EDM's augmentation labels condition EDM's networks, and model.objective is {m['objective']}; "
                 "set model.objective: edm, or train.augment: 0")]
    arch = m["arch"]
    if arch not in nets.EDM_AUGMENT_DIM:
        return [(key, f"model.arch={arch} takes no augmentation labels; use ddpmpp or ncsnpp (or adm with "
                 "model.kwargs.augment_dim: 9), or set train.augment: 0")]
    dim = m["kwargs"].get("augment_dim", nets.EDM_AUGMENT_DIM[arch])
    if dim != AUGMENT_LABELS:
        return [(key, f"gives {AUGMENT_LABELS} augmentation labels to model.arch={arch} with augment_dim {dim}; set "
                 f"model.kwargs.augment_dim: {AUGMENT_LABELS}, or train.augment: 0")]
    return []
