"""`diffrelay validate`'s memory lines: the run's training memory per process as YAML comments, and one warning
line on stderr when it exceeds the GPUs' memory. The config's side (micro-batch, precision, EMAs, the training
loss); the measuring is nets.footprint's (docs/gpus.md#training-memory-diffrelay-validate)."""

import contextlib
import sys

import torch

from diffrelay import config
from diffrelay.config import preflight


def micro_batch(cfg: config.Config) -> int:
    """Images one process runs through forward and backward at once: train.batch_size over processes
    (nproc_per_node x nnodes) and grad_accum, as the training loop splits it (config checks it divides)."""
    t = cfg.train
    return max(t.batch_size // (t.nproc_per_node * t.nnodes * t.grad_accum), 1)


def ema_copies(cfg: config.Config) -> int:
    """Copies of the network the EMAs hold: one per train.ema_decays (one for ema_halflife_kimg), one per
    post-hoc EMA profile when train.phema.every > 0 (training/state.py builds both)."""
    t = cfg.train
    return (1 if t.ema_halflife_kimg is not None else len(t.ema_decays)) + (len(t.phema.profiles) if t.phema.every else 0)


def _builder(cfg: config.Config, classes: int, text):
    """The network as training builds it (objectives.build, checkpointing enabled as configured)."""
    from diffrelay import objectives
    from diffrelay.nets import registry

    channels, side = preflight.net_geometry(cfg)

    def build():
        net = objectives.build(cfg.to_dict()["model"], side, classes, channels, text=text)
        if cfg.to_dict()["train"]["lora"] is not None:  # the base frozen: gradients and moments of the adapter only
            from diffrelay.pretrained import lora

            lora.attach(net, cfg.to_dict()["train"]["lora"], cfg.run.seed)
        if cfg.train.activation_checkpointing:
            registry.enable_checkpointing(net, cfg.model.arch)
        return net

    def run(net, n):
        """The training loss of n images at the draws 0 (objectives.loss, what the training loop calls)."""
        from diffrelay.nets.registry import random_text

        images = torch.zeros(n, channels, side, side)
        labels = torch.zeros(n, dtype=torch.long) if classes else None
        if text:
            cond = random_text(text, n, images.device)
            cond.labels, labels = labels, cond
        aug = torch.zeros(n, 9) if cfg.train.augment > 0 else None
        return objectives.loss(cfg, net, images, labels, torch.zeros(n), torch.zeros_like(images), aug)

    return build, run


def _counts(build, params: int) -> dict:
    """footprint.counts of the network built on the meta device; on the CPU for a small network that refuses
    meta; else `params` (the network check's count), all trainable, without buffers."""
    from diffrelay.nets import footprint, registry

    for device in ("meta", "cpu") if params <= footprint.CPU_MAX_PARAMS else ("meta",):
        try:
            with registry.on_device(device), contextlib.redirect_stdout(sys.stderr):
                return footprint.counts(build())
        except (Exception, SystemExit):  # noqa: BLE001 -- the network check reported it already, or it needs the CPU
            pass
    return {"params": params, "trainable": params, "bytes_per_param": 4, "buffer_bytes": 0, "factored": params,
            "small": 0, "largest": params}


def lines(cfg: config.Config, params: int, classes: int, text=None,
          gpu_memory_gib: float | None = None) -> tuple[list, str | None]:
    """(the `# memory:` lines, the warning or None) of the run as configured; `params`: the network check's count."""
    from diffrelay.nets import footprint, registry
    from diffrelay.objectives import ddpm

    t, batch = cfg.train, micro_batch(cfg)
    build, run = _builder(cfg, classes, text)
    n = _counts(build, params)
    emas = ema_copies(cfg)
    from diffrelay.training import optimizers

    args = cfg.to_dict()["train"]["optimizer_args"]
    state = footprint.state_bytes(n["params"], n["trainable"], optimizers.state_bytes(t.optimizer, n, args), emas,
                                  n["bytes_per_param"], n["buffer_bytes"])
    if t.fused_backward:  # each gradient freed once its parameter stepped: about the largest one at a time
        state["gradients"] = n["largest"] * n["bytes_per_param"]
    amp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
    if cfg.model.objective == "ddpm":
        # Its tables are made with NumPy (no fake tensors) and cached per device: made here, on the real CPU, the
        # fake pass uses them, and the cache never holds fake tensors.
        ddpm.make_tables("cpu", ddpm.Options.of(getattr(cfg.model, "ddpm", None)))
    _, side = preflight.net_geometry(cfg)
    small = n["params"] * side ** 2 <= registry.CPU_CHECK_MAX_PARAM_PIXELS  # as the network check decides
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the YAML; a user's network may print
        act, how = footprint.activation_bytes(build, run, batch, amp, cpu=n["params"] <= footprint.CPU_MAX_PARAMS,
                                              cpu_first=small)
    processes = t.nproc_per_node * t.nnodes
    unsharded = sum(state.values())
    sharded_note = ""
    if t.sharding == "fsdp2":
        if n["trainable"] < n["params"]:  # LoRA: each sharded average holds its own shard of the frozen base
            state["ema"] = emas * (n["params"] * n["bytes_per_param"] + n["buffer_bytes"])
        built = state["weights"] + state["ema"]  # whole, in the CPU's memory, before fully_shard (training/state.py)
        state, gathered = sharded_state(state, processes, build, t.precision)
        sharded_note = (f", fsdp2: the state / {processes} process(es) plus {gathered / 2**30:.3g} GiB of two "
                        f"blocks' gathered weights; each process first builds the network and its averages whole in "
                        f"the CPU's memory ({built / 2**30:.3g} GiB)")
    base = _frozen_base(build, n) if cfg.to_dict()["train"]["lora"] is not None else None
    chosen = (cfg.to_dict()["train"]["lora"] or {}).get("quantize_base")
    if base is not None and chosen in base:  # the quantized base replaces the fp32 one in the weights
        state["weights"] += base[chosen] - base[None]
    capacity, against = footprint.gpu_memory(cfg.run.device, cfg.run.gpus, gpu_memory_gib)
    blocks = []  # each swappable block's frozen bytes, where the swap is on or a card's size is asked about
    if base is not None and (t.block_swap or capacity is not None):
        blocks = _block_bytes(build, base[chosen] / base[None] if base[None] else 1.0)
    if t.block_swap and blocks:
        state["weights"] -= swap_saving(blocks, t.block_swap)
    est = footprint.Estimate(state, act, how)
    setting = (f"{t.precision}{' autocast' if amp else ''}, {batch} image(s) a process and micro-batch "
               f"(train.batch_size {t.batch_size} / ({processes} process(es) x grad_accum {t.grad_accum})), "
               f"activation checkpointing {_checkpointing(t.activation_checkpointing)}{sharded_note}"
               f"{', fused backward: the largest gradient alone held' if t.fused_backward else ''}")
    fixes = ["lower train.batch_size or raise train.grad_accum or train.nproc_per_node"]
    fixes += [] if t.activation_checkpointing else ["set train.activation_checkpointing: true"]
    fixes += [] if amp else ["train.precision: bf16"]
    if capacity is not None and capacity > (act or 0):  # the processes over which sharding would hold the state
        need = -(-unsharded // (capacity - (act or 0)))
        if t.sharding == "ddp" or need > processes:
            fixes += [f"train.sharding: fsdp2 over at least {max(need, 2)} processes (the state / processes)"]
    if t.optimizer in optimizers.TORCH_ADAM:  # the same moments in 8 bits (training/optimizers.py)
        fixes += [f"train.optimizer: adamw8bit (its state {footprint.gib(optimizers.state_bytes('adamw8bit', n))} "
                  f"against {footprint.gib(state['optimizer'])})"]
    if base is not None and chosen is None and len(base) > 1:
        fixes += ["train.lora.quantize_base: int8 (the frozen base's linear weights in 1 byte)"]
    if capacity is not None and blocks and est.total > capacity:  # the fewest swapped blocks that would fit
        need = next((k for k in range(t.block_swap + 1, len(blocks) + 1)
                     if est.total - swap_saving(blocks, k) + swap_saving(blocks, t.block_swap) <= capacity), None)
        if need:
            fixes += [f"train.block_swap: {need} (with train.activation_checkpointing)"]
    out, warning = footprint.lines(est, n, emas, t.optimizer, setting, capacity, against, ", or ".join(fixes),
                                   None if t.optimizer in optimizers.TORCH_ADAM else optimizers.CHOICES[t.optimizer].state)
    if capacity is not None and t.sharding == "ddp":  # (fsdp2 trains torch's Adam(W) only: optimizers.check_config)
        out.append(_by_optimizer(cfg.to_dict(), n, est, capacity))
    if base is not None:
        out.insert(1, "# memory: frozen base by train.lora.quantize_base: " + ", ".join(
            f"{kind or 'null (fp32)'} {footprint.gib(size)}" for kind, size in base.items()) + f" (this run: {chosen})")
    if t.block_swap and blocks:
        swapped = blocks[len(blocks) - t.block_swap:]
        out.insert(2, f"# memory: train.block_swap {t.block_swap} of {len(blocks)} blocks: "
                      f"{footprint.gib(sum(swapped))} of frozen weights wait in pinned host memory, "
                      f"{footprint.gib(swap_saving(blocks, t.block_swap))} of them off the GPU at its peak (two "
                      f"swapped blocks resident at once)")
    return out, warning


def swap_saving(blocks: list, k: int) -> int:
    """The frozen bytes train.block_swap: k keeps off the GPU at the training peak: the last k blocks' (`blocks`, each
    block's frozen bytes in the order they run), less the two largest of them, resident while one runs and the next
    is copied in (runtime/block_swap.py)."""
    swapped = sorted(blocks[len(blocks) - k:]) if k else []
    return int(sum(swapped[:-2]))


def _block_bytes(build, scale: float) -> list:
    """Each swappable block's frozen bytes (the family's swap_lists, in the order they run), fp32 bytes x `scale`
    (the quantized base's share); [] for a network that refuses meta or a family with none."""
    from diffrelay.nets import registry
    from diffrelay.runtime import block_swap

    try:
        with registry.on_device("meta"), contextlib.redirect_stdout(sys.stderr):
            text_net = getattr(build(), "net", None)  # the objective's wrapper of a families.network.TextNet
            blocks = block_swap.all_blocks(text_net.model, text_net.family.swap_lists)
    except (Exception, SystemExit):  # noqa: BLE001 -- no breakdown
        return []
    return [int(sum(p.numel() * p.element_size() for p in b.parameters() if not p.requires_grad) * scale)
            for b in blocks]


def _checkpointing(setting) -> str:
    if setting == "offload":
        return ("offload (the saved block inputs counted here wait in pinned host memory; the GPU holds one block's "
                "recomputed activations at a time instead, not measured)")
    return "on" if setting else "off"


def _by_optimizer(d: dict, n: dict, est, capacity: int) -> str:
    """The `# memory:` line of the total under each train.optimizer this config could take (the rest as set; those its
    other keys rule out left out: schedule-free where an EMA is kept), and which fit `capacity`."""
    from diffrelay.nets import footprint
    from diffrelay.training import optimizers

    totals = {}
    for name in optimizers.CHOICES:
        args = d["train"]["optimizer_args"] if name == d["train"]["optimizer"] else {}
        if optimizers.check_config({**d, "train": d["train"] | {"optimizer": name, "optimizer_args": args}}):
            continue
        totals[name] = est.total - est.state["optimizer"] + optimizers.state_bytes(name, n, args)
    fit = [name for name, total in totals.items() if total <= capacity]
    return (f"# memory: total by train.optimizer (the rest as set): "
            f"{', '.join(f'{k} {footprint.gib(v)}' for k, v in totals.items())}; "
            f"fit {footprint.gib(capacity)}: {', '.join(fit) or 'none'}")


# Bytes a weight takes under each train.lora.quantize_base (torchao's weight-only int8 and float8: one byte, and a
# float32 scale per output row, counted below; bitsandbytes' nf4: half a byte, and an 8-bit scale per block of 64
# with double quantization, 0.516 bytes).
QUANTIZED_BYTES = {"int8": 1, "fp8": 1, "nf4": 0.5 + 1 / 64}


def _frozen_base(build, n: dict) -> dict | None:
    """{quantize_base: the frozen weights' bytes} of a LoRA run (None: the fp32 base as counted), from the network
    built on the meta device: only the frozen nn.Linear weights (the base layers peft wraps too) are quantized."""
    from diffrelay.nets import registry

    try:
        with registry.on_device("meta"), contextlib.redirect_stdout(sys.stderr):
            linear = [m for m in build().modules() if isinstance(m, torch.nn.Linear) and not m.weight.requires_grad]
    except (Exception, SystemExit):  # noqa: BLE001 -- a network that refuses meta: no breakdown
        return None
    weights, rows = sum(m.weight.numel() for m in linear), sum(m.weight.shape[0] for m in linear)
    fp32 = (n["params"] - n["trainable"]) * n["bytes_per_param"]
    return {None: fp32} | {kind: int(fp32 - weights * n["bytes_per_param"] + weights * size + rows * 4)
                           for kind, size in QUANTIZED_BYTES.items()}


def sharded_state(state: dict, processes: int, build, precision: str) -> tuple[dict, int]:
    """(each part of the training state a process holds under fsdp2: 1/processes of it, plus `gathered`, the full
    weights of the two largest units, which FSDP2 holds while one runs and the next is prefetched; those bytes).
    Gathered weights are in the computing dtype (bf16 under train.precision: bf16, training/sharding.policy)."""
    from diffrelay.nets import registry
    from diffrelay.training import sharding

    share = {k: -(-v // processes) for k, v in state.items()}
    try:
        with registry.on_device("meta"), contextlib.redirect_stdout(sys.stderr):
            net = build()
            size, seen, sizes = 2 if precision == "bf16" else None, set(), []
            for unit in sharding.units(net):  # deepest first: a unit's own weights, less those of units inside it
                own = [p for p in unit.parameters() if id(p) not in seen]
                seen.update(id(p) for p in own)
                sizes.append(sum(p.numel() * (size or p.element_size()) for p in own))
            sizes.sort(reverse=True)
    except (Exception, SystemExit):  # noqa: BLE001 -- a network that refuses meta: its largest block unknown
        sizes = []
    gathered = sum(sizes[:2]) if processes > 1 else 0  # one process: the shard is the whole; nothing gathered
    return share | {"gathered": gathered}, gathered


def show(cfg: config.Config, params: int, classes: int, text=None, gpu_memory_gib: float | None = None) -> None:
    """Print the lines on stdout (YAML comments) and the warning, if any, as one line on stderr."""
    out, warning = lines(cfg, params, classes, text, gpu_memory_gib)
    for line in out:
        print(line)
    if warning:
        print(f"diffrelay: warning: {warning}", file=sys.stderr, flush=True)
