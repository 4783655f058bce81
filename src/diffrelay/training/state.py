"""The training state a checkpoint holds: network, EMA and post-hoc EMA, optimizer, schedule, loss scaler,
data order and the divergence guard's counters; built, resumed and saved as one object."""

import math
from dataclasses import dataclass

import numpy as np
import torch

from diffrelay import logs
from diffrelay.data import loader, subsets
from diffrelay.data.order import BucketOrder, DataOrder, PairedOrder
from diffrelay import objectives
from diffrelay.nets import registry
from diffrelay.pretrained import folder, lora, weights
from diffrelay.runtime import block_swap, speed
from diffrelay.errors import UserError
from diffrelay.runtime import distributed
from diffrelay.training import fused_backward, optim, optimizers, phema, sharded_checkpoint, sharding


@dataclass
class TrainState:
    net: torch.nn.Module  # the raw module: EMA, saving and attribute reads use it, never the DDP wrapper
    ema: optim.EMA
    pema: phema.PowerEMA | None  # post-hoc EMA profiles (train.phema), None when off
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    order: DataOrder
    skipped_total: int = 0  # updates skipped for a non-finite loss or gradient, over the whole run
    consecutive: int = 0  # of those, in a row up to now: the divergence guard
    lora: dict | None = None  # train.lora's spec: the net's and EMAs' state is the adapter's tensors only
    sharded: bool = False  # train.sharding: fsdp2: parameters, gradients, optimizer state and averages sharded
    optimizer: str = "adam"  # train.optimizer
    swap: block_swap.BlockSwap | None = None  # train.block_swap's, None when off

    @classmethod
    def build(cls, cfg, data, device) -> "TrainState":
        t = cfg.train
        torch.manual_seed(cfg.run.seed)  # initial weights depend on the seed only, never on the rank
        channels, side, _ = data.shape  # the images, or their latents
        text = getattr(data, "text", None)  # a text run's TextSource: the network is built for its dims
        net = objectives.build(cfg.to_dict()["model"], side, data.num_classes, channels,
                               text=text.dims if text else None)
        # Sharded, the network and its averages stay in the CPU's memory until fully_shard moves each block's shard
        # to the device (FSDP2's _move_states_to_device, block by block): the whole never has to fit one GPU.
        # With train.block_swap the network waits on the host until the swapped blocks' frozen weights are parked
        # there (block_swap.py), so they never reach the GPU whole.
        net = net if t.sharding == "fsdp2" or t.block_swap else net.to(device)
        if cfg.model.pretrained is not None:  # step 0 starts from the pipeline's weights; a resume loads over them
            weights.load_initial(net, cfg.to_dict()["model"]["pretrained"])
        # The adapter on the pipeline's weights; the EMAs copy the frozen base too (it stays equal to the net's).
        spec = cfg.to_dict()["train"]["lora"]
        if spec is not None:  # a quantized frozen base (train.lora.quantize_base), before peft wraps its layers
            lora.quantize(net, spec.get("quantize_base"), t.precision)
        params = net.parameters() if spec is None else lora.attach(net, spec, cfg.run.seed)
        if t.activation_checkpointing:
            registry.enable_checkpointing(net, cfg.model.arch)
        swap = None
        if t.block_swap:
            text_net = getattr(net, "net", net)  # the objective's wrapper of a families.network.TextNet (weights.text_net)
            blocks = block_swap.swap_blocks(text_net.model, text_net.family.swap_lists, t.block_swap)
            swap = block_swap.BlockSwap(blocks, device)
            net = net.to(device)
        net = speed.to_memory_format(net, t.channels_last)  # before the EMA copies, so they match
        ema = optim.EMA(net, t.ema_decays, t.ema_halflife_kimg, t.ema_rampup_ratio, t.batch_size)
        if swap is not None:  # after the EMAs' copies: they share the frozen base and carry no hooks
            swap.hook()
            logs.get().info("train.block_swap: the frozen weights of the last %d blocks (%.3f GB) wait on the host",
                            len(blocks), swap.frozen_bytes() / 1e9)
        pema = phema.PowerEMA(net, t.phema.profiles) if t.phema.every else None
        sharded = t.sharding == "fsdp2"
        if sharded:  # the network and every average alike; the optimizer then holds the sharded parameters
            for module in [net, *ema.nets, *(pema.nets if pema else [])]:
                sharding.shard(module, t.precision, device)
            params = [p for p in net.parameters() if p.requires_grad]
            ema.pairs, pema_pairs = [], pema.pairs if pema else []
            pema_pairs.clear()  # found again on the sharded parameters at the first update (optim.pairs_for)
        fused = speed.use_fused(t.fused_optimizer, device) and t.optimizer in optimizers.TORCH_ADAM
        if t.fused_backward:  # one optimizer a parameter, stepped from its gradient hook (fused_backward.py)
            opt = fused_backward.PerParameter(params, lambda one: optim.build_optimizer(one, t, fused=fused))
        else:
            opt = optim.build_optimizer(params, t, fused=fused)
        return cls(net=net, ema=ema, pema=pema, opt=opt, sched=optim.build_schedule(opt, t),
                   scaler=torch.amp.GradScaler(device.type, init_scale=_first_scale(t, data.shape),
                                               enabled=t.precision == "fp16"),
                   order=_order(cfg.run.seed, data, t.batch_size, cfg.to_dict()["data"].get("subsets")),
                   lora=spec, sharded=sharded,
                   optimizer=t.optimizer, swap=swap)

    def load(self, state: dict, meta: dict, path) -> None:
        made = (state.get("sharding") or {}).get("kind", "ddp")
        if made != ("fsdp2" if self.sharded else "ddp"):
            raise UserError(f"{path}: written with train.sharding: {made}; this run has "
                            f"{'fsdp2' if self.sharded else 'ddp'}; resume it with train.sharding: {made} "
                            "(a run keeps its sharding; the process count may change)")
        if self.pema:
            self.pema.check_state(state.get("phema"), path)
        why = lora.spec_difference(lora.enabled(meta.get("config")), self.lora) if self.lora else None
        if why:  # (--init from another adapter kind, rank or target_modules: its tensors are not this adapter's)
            raise UserError(f"{path}: {why}")
        if self.sharded:  # None: saved before any update, when the optimizer held no state (a fresh one)
            tensors, _ = self._sharded_tensors(state["optimizer_groups"] is not None)
            sharded_checkpoint.load(path, tensors)  # in place: the parameters' and averages' shards
            if state["optimizer_groups"] is not None:
                sharded_checkpoint.load_optimizer(self.net, self.opt, tensors, state["optimizer_groups"])
        elif self.lora:  # the base is the pipeline's, loaded by build
            for module, weights_ in zip([self.net, *self.ema.nets], [state["net"], *state["ema"]], strict=True):
                lora.load(module, weights_, path)
        else:
            self.net.load_state_dict(state["net"])
            self.ema.load_state_dict(state["ema"])
        if self.pema and not self.sharded:
            self.pema.load_state_dict(state["phema"], path)
        if not self.sharded:
            optim.load_optimizer_state(self.opt, state["optimizer"])
        self.sched.load_state_dict(state["schedule"])
        self.scaler.load_state_dict(state["scaler"])
        loader.check_draws(path, meta)
        self.order.load_state_dict(state["order"])
        self.skipped_total = int(state["skipped"])
        # The divergence guard counts across segments and retries, or a short segment would reset it.
        self.consecutive = int(state.get("consecutive_skipped", 0))

    def state_dict(self, step: int) -> dict:
        state = {"net": self.weights(self.net), "ema": [self.weights(e) for e in self.ema.nets],
                 "optimizer": optimizers.plain_state(self.opt.state_dict()),
                 "schedule": self.sched.state_dict(), "scaler": self.scaler.state_dict(),
                 "order": self.order.state_dict(), "skipped": self.skipped_total,
                 "consecutive_skipped": self.consecutive, "step": step}
        if self.pema:  # absent when off, so such checkpoints are byte for byte what they were before
            state["phema"] = self.pema.state_dict()
        return state

    def save(self, path, step: int, meta: dict) -> None:
        """The checkpoint at `step`. Every process calls it: sharded, each writes its shards; else rank 0 writes
        the one state.pt, as before sharding existed."""
        from diffrelay.training import checkpoint

        if self.sharded:
            # An optimizer that has not stepped (every update so far skipped) holds no state, and torch's
            # get_optimizer_state_dict would make it by a step: it is saved as none instead.
            tensors, groups = self._sharded_tensors(bool(self.opt.state))
            rest = {"schedule": self.sched.state_dict(), "scaler": self.scaler.state_dict(),
                    "order": self.order.state_dict(), "skipped": self.skipped_total,
                    "consecutive_skipped": self.consecutive, "step": step,
                    "optimizer_groups": groups, "sharding": {"kind": "fsdp2", "world": distributed.world()}}
            if self.pema:
                rest["phema"] = {"sigma_rel": list(self.pema.sigma_rels)}
            sharded_checkpoint.save(path, tensors, rest, meta, checkpoint.CHECKPOINT_FORMAT,
                                    checkpoint.is_checkpoint_folder)
        elif distributed.is_main():
            checkpoint.save_checkpoint(path, self.state_dict(step), meta)

    def _sharded_tensors(self, optimizer: bool) -> tuple[dict, list | None]:
        """({name: this process's shard}, the optimizer's param_groups) of everything a sharded checkpoint holds;
        the tensors are the live ones (loading writes into them). The optimizer's state is keyed by parameter name
        (sharded_checkpoint.optimizer_state), so it reshards with the parameters; without `optimizer`, none
        (groups None)."""
        tensors = {f"net.{k}": v for k, v in self.weights(self.net).items()}
        for i, avg in enumerate(self.ema.nets):
            tensors |= {f"ema{i}.{k}": v for k, v in self.weights(avg).items()}
        for i, avg in enumerate(self.pema.nets if self.pema else []):
            tensors |= {f"phema{i}.{k}": v for k, v in avg.state_dict().items()}
        if not optimizer:
            return tensors, None
        moments, groups = sharded_checkpoint.optimizer_state(self.net, self.opt)
        return tensors | moments, groups

    def unscaled_grad_norm(self, clip: float) -> torch.Tensor:
        """After the backward pass: fp16's gradients unscaled, clipped to the global norm `clip` (0: not), and that
        norm; under train.fused_backward the norm of the gradients its hooks stepped (clipping is refused there)."""
        if isinstance(self.opt, fused_backward.PerParameter):
            return self.opt.grad_norm()
        self.scaler.unscale_(self.opt)
        return torch.nn.utils.clip_grad_norm_(self.net.parameters(), clip if clip > 0 else math.inf)

    def skip_update(self, step: int, log) -> None:
        """A non-finite loss or gradient: the update is skipped and counted (the divergence guard). Under
        train.fused_backward the parameters stepped during the backward pass, so there is nothing to skip: one line,
        and no checkpoint of these weights is written (the last one holds finite ones)."""
        if isinstance(self.opt, fused_backward.PerParameter):
            raise UserError(f"step {step}: non-finite loss or gradient under train.fused_backward, which updates each "
                            "parameter during the backward pass, so the update cannot be skipped; the last checkpoint "
                            "is unchanged: resume it with a lower train.lr or with train.fused_backward: false")
        self.scaler.update()  # fp16: lowers the scale; the update itself is skipped
        self.skipped_total, self.consecutive = self.skipped_total + 1, self.consecutive + 1
        log.warning(f"step {step}: non-finite loss or gradient; update skipped ({self.consecutive} in a row)")

    @property
    def raw_is_not_the_modules(self) -> bool:
        return optimizers.has_eval_weights(self.optimizer)

    def eval_weights(self) -> dict:
        """The network's weights as snapshots hold them: the trained ones, or schedule-free's evaluation weights x
        (optimizers.eval_weights), by name (schedule-free trains under ddp only: optimizers.check_config)."""
        named = self.weights(self.net)
        if not self.raw_is_not_the_modules:
            return named
        by_id = optimizers.eval_weights(self.opt, {n: p for n, p in self.net.named_parameters()})
        return {k: by_id.get(k, v) for k, v in named.items()}

    def weights(self, module) -> dict:
        """A network's state dict as checkpoints and snapshots hold it: a LoRA run's adapter only."""
        return lora.only(module.state_dict()) if self.lora else module.state_dict()

    def snapshot(self, path, meta: dict, cfg) -> None:
        """Every EMA, so any of train.ema_decays can be sampled (sample.ema_decay); one decay keeps the file as
        it was, and none (train.ema_decays: []) holds the raw weights only, which sampling and export then read
        (checkpoint.keeps_no_ema). A LoRA run also writes its EMA's (sample.ema_decay's, else the first) and its raw
        adapter in diffusers' format, <run>/lora/<step>/, the ones sample.weights scores under the name diffusers' LoRA
        scripts write (lora.file_names); without an EMA the raw one alone, under that name.
        Every process calls it; rank 0 writes. Sharded, the weights are gathered first, a tensor at a time.
        """
        from diffrelay.training import checkpoint

        if not (self.sharded or distributed.is_main()):
            return
        whole = sharding.full if self.sharded else dict
        emas = [whole(self.weights(e)) for e in self.ema.nets]
        raw = whole(self.eval_weights())
        if not distributed.is_main():
            return
        checkpoint.save_snapshot(path, emas[0] if emas else {}, raw, meta, emas[1:])
        if self.lora:
            pipe = folder.read(cfg.to_dict()["model"]["pretrained"])
            # the weights the run samples and scores (sample.weights) where load_lora_weights(folder) looks
            s, decays = cfg.to_dict()["sample"], [float(x) for x in cfg.to_dict()["train"]["ema_decays"]]
            names = lora.file_names(s["weights"], bool(self.ema.nets))
            want = s["ema_decay"][0] if isinstance(s["ema_decay"], list) else s["ema_decay"]  # its EMA: the first's
            i = decays.index(float(want)) if want is not None and float(want) in decays else 0
            kinds = {"ema": (self.ema.nets[i], emas[i]) if self.ema.nets else None, "raw": (self.net, raw)}
            files = {names[k]: kinds[k][0] for k in names}
            # the tensors to write: the gathered ones where the modules hold shards, the evaluation weights where the
            # module holds the trained ones (schedule-free); else the modules' own
            whole_states = self.sharded or self.raw_is_not_the_modules
            states = {names[k]: kinds[k][1] for k in names} if whole_states else None
            lora.export(path.parent.parent / "lora" / path.name.split(".")[0], files, pipe.cls, pipe.net, states)


def _first_scale(t, shape) -> float:
    """fp16's first loss scale. A sum over C x H x W makes the gradients that much larger than the mean's, so
    starting at torch's 2^16 skipped edm2-XS's first 14 steps (measured on an H200; 20 in a row stop a run):
    start lower by the nearest power of two, where the mean's first steps start."""
    elements = math.prod(shape)
    return 2.0**16 / 2 ** math.ceil(math.log2(elements)) if t.loss_reduction == "sum" else 2.0**16


def _order(seed: int, data, global_batch: int, subset_settings=None) -> DataOrder:
    """The data order: each global batch from one bucket in a bucketed dataset (data.buckets), else the shuffled
    stream of every row; each row as many times an epoch as its subset's repeats (data.subsets); half instance, half
    regularisation rows with is_reg subsets (prior preservation)."""
    of_row = getattr(data, "subsets", None)
    repeats = subsets.repeats(subset_settings, of_row)
    reg = subsets.regularisation(subset_settings, of_row)
    if reg is not None:
        return PairedOrder(seed, np.flatnonzero(~reg), np.flatnonzero(reg), global_batch, repeats=repeats)
    if data.buckets is None:
        return DataOrder(seed, data.count, global_batch, repeats=repeats)
    return BucketOrder(seed, data.buckets.members(), global_batch, repeats=repeats)
