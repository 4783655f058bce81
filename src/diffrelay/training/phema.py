"""Post-hoc EMA (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of Diffusion Models").

Training keeps power-function EMAs of the weights (train.phema.profiles, each a relative width sigma_rel)
and writes both every train.phema.every steps to <run>/phema/step_XXXXXXX.safetensors. Afterwards
`diffrelay phema` builds the EMA of any other width at a stored step as a least-squares combination of
the stored averages, and writes it as an ordinary snapshot (ema weights only):

  diffrelay phema --run-dir results/demo --sigma-rel 0.08 --until-step 1200 \\
      --out results/demo/snapshots/phema/step_0001200_ema0.08.safetensors

A profile is a function of the training time tau (here in optimizer steps): the EMA at time t weighs the
weights of time tau by p(tau) = (gamma + 1) tau^gamma / t^(gamma + 1) on 0 < tau <= t, and its standard
deviation divided by t is sigma_rel.
"""

import re
from pathlib import Path

import torch

from diffrelay import config, logs
from diffrelay.training import checkpoint, optim, sharded_checkpoint
from diffrelay.training.profiles import MAX_ERROR, MAX_SIGMA_REL, beta, error, sigma_to_gamma, solve
from diffrelay.errors import UserError

FORMAT = "diffrelay-phema/1"
FILE = re.compile(r"^step_(\d{7})\.safetensors\Z")
WHAT, FIX = "post-hoc EMA file", "move it out of phema/ to reconstruct from the others, or retrain from an earlier checkpoint"


# ---------------------------------------------------------------------------------------------
# The math of power-function profiles


# ---------------------------------------------------------------------------------------------
# Training: the running averages


class PowerEMA:
    """One power-function EMA of the weights per sigma_rel, updated after every optimizer step."""

    def __init__(self, net: torch.nn.Module, sigma_rels):
        self.sigma_rels = [float(s) for s in sigma_rels]
        self.gammas = [sigma_to_gamma(s) for s in self.sigma_rels]
        self.nets = [optim.average_copy(net) for _ in self.sigma_rels]
        self.pairs = [optim.Pairs(avg, net) for avg in self.nets]  # what each update moves, found once

    @torch.no_grad()
    def update(self, net: torch.nn.Module, step: int) -> None:
        """After the update of `step` (0-based), i.e. the (step + 1)-th average."""
        for gamma, avg in zip(self.gammas, optim.pairs_for(self.pairs, self.nets, net)):
            avg.lerp(1 - beta(gamma, step + 1))

    def state_dict(self) -> dict:
        return {"sigma_rel": list(self.sigma_rels), "nets": [avg.state_dict() for avg in self.nets]}

    def load_state_dict(self, state: dict, source) -> None:
        self.check_state(state, source)
        for avg, s in zip(self.nets, state["nets"], strict=True):
            avg.load_state_dict(s)

    def check_state(self, state: dict | None, source) -> None:
        """A checkpoint's post-hoc EMA record against this run's profiles: one line where they differ."""
        if state is None:
            raise UserError(f"{source}: has no post-hoc EMA state (made with train.phema off); "
                            "start a new run.name to train with train.phema")
        if [float(s) for s in state["sigma_rel"]] != self.sigma_rels:
            raise UserError(f"{source}: keeps post-hoc EMA profiles {state['sigma_rel']}, the config "
                            f"train.phema.profiles={self.sigma_rels}; use the same profiles or a new run.name")

    def save(self, path, meta: dict, sharded: bool = False) -> Path | None:
        """Both averages in one verified file; `meta` as a snapshot's (step, model, image_shape, ...). Every process
        calls it; rank 0 writes. Sharded (train.sharding: fsdp2), the averages are gathered first."""
        from diffrelay.runtime import distributed
        from diffrelay.training import sharding

        if not (sharded or distributed.is_main()):
            return None
        tensors = {f"p{i}.{k}": v for i, avg in enumerate(self.nets) for k, v in avg.state_dict().items()}
        tensors = sharding.full(tensors) if sharded else tensors
        meta = {**meta, "format": FORMAT, "sigma_rel": self.sigma_rels, "gamma": self.gammas}
        return checkpoint.write_signed(path, tensors, meta) if distributed.is_main() else None


def file_path(run_dir, step: int) -> Path:
    return Path(run_dir) / "phema" / f"{checkpoint.step_name(step)}.safetensors"


# ---------------------------------------------------------------------------------------------
# Reconstruction


def stored_steps(run_dir) -> list[int]:
    folder = Path(run_dir) / "phema"
    found = [int(m.group(1)) for p in folder.iterdir() if (m := FILE.match(p.name))] if folder.is_dir() else []
    return sorted(found)


def restore(run_dir, step: int) -> Path | None:
    """Write phema/step_X again from the checkpoint of that step, which holds the same profiles (a deleted
    or lost last file need not mean retraining). None when there is no such checkpoint."""
    ckpt = Path(run_dir) / "checkpoints" / checkpoint.step_name(step)
    if not checkpoint.is_complete(ckpt):
        return None
    state, meta = checkpoint.load_checkpoint(ckpt)
    if not state.get("phema"):
        return None
    sigma_rels = [float(s) for s in state["phema"]["sigma_rel"]]
    if "sharding" in state:  # train.sharding: fsdp2: the profiles are in the shards, read whole here
        whole = sharded_checkpoint.read_whole(ckpt)
        tensors = {f"p{k[len('phema'):]}": v for k, v in whole.items() if k.startswith("phema")}
    else:
        tensors = {f"p{i}.{k}": v for i, net in enumerate(state["phema"]["nets"]) for k, v in net.items()}
    keep = {k: v for k, v in meta.items() if k not in ("diverged",)}
    path = checkpoint.write_signed(file_path(run_dir, step), tensors, {
        **keep, "format": FORMAT, "sigma_rel": sigma_rels, "gamma": [sigma_to_gamma(s) for s in sigma_rels]})
    logs.get().info(f"{path}: stored again from {ckpt}")
    return path


def read(path) -> tuple[dict, dict]:
    return checkpoint.read_signed(path, FORMAT, WHAT, FIX)


def plan(run_dir, until_step: int, sigma_rel: float) -> tuple[list[tuple[Path, list[float]]], float]:
    """(file, one coefficient per profile in it) for the files of steps <= until_step, from their records."""
    last = file_path(run_dir, until_step)
    if until_step not in stored_steps(run_dir) and not restore(run_dir, until_step):
        raise UserError(f"{last}: post-hoc EMA file not found, and no checkpoint of that step holds the profiles; "
                        "reconstruct at a step that train.phema.every stored (see the phema/ folder) or train to "
                        "that step first")
    steps = [s for s in stored_steps(run_dir) if 0 < s <= until_step]
    metas = [(file_path(run_dir, s), checkpoint.read_signed_meta(file_path(run_dir, s), FORMAT, WHAT, FIX))
             for s in steps]
    want = config.run_hash(metas[-1][1])
    for path, meta in metas:
        if not config.is_same_run(meta, want) or int(meta.get("step", -1)) != int(FILE.match(path.name).group(1)):
            raise UserError(f"{path}: from another training run (trajectory or step differs from {last}); "
                            "move it out of the phema/ folder")
    flat = [(i, meta["step"], g) for i, (_, meta) in enumerate(metas) for g in meta["gamma"]]
    args = [f[1] for f in flat], [f[2] for f in flat], until_step, sigma_to_gamma(sigma_rel)
    x = solve(*args)
    err = error(*args, x)
    if err > MAX_ERROR:
        raise UserError(f"--sigma-rel {sigma_rel:g}: the stored profiles ({', '.join(f'{g:g}' for g in metas[-1][1]['sigma_rel'])}"
                        f" at {len(steps)} steps) rebuild it {err:.0%} off (more than {MAX_ERROR:.0%}); choose a width "
                        "nearer the stored ones, or store profiles closer to it (train.phema.profiles)")
    coefs = [[] for _ in metas]
    for (i, _, _), c in zip(flat, x):
        coefs[i].append(float(c))
    return [(path, c) for (path, _), c in zip(metas, coefs)], err


def reconstruct(run_dir, sigma_rel: float, until_step: int, out) -> Path:
    """Write the EMA of width sigma_rel at until_step as a snapshot file (ema weights only)."""
    combined, meta = {}, None
    files, err = plan(run_dir, until_step, sigma_rel)
    for path, coefs in files:
        tensors, meta = read(path)
        for i, c in enumerate(coefs):
            prefix = f"p{i}."
            for k, v in tensors.items():
                if not k.startswith(prefix):
                    continue
                name = k[len(prefix):]
                if v.is_floating_point():  # float64 sums: the coefficients have both signs and can be large
                    combined[name] = combined.get(name, 0) + c * v.double()
                else:
                    combined[name] = v  # integer buffers: the latest file's
    dtypes = {k[3:]: v.dtype for k, v in tensors.items() if k.startswith("p0.")}
    ema = {k: v.to(dtypes[k]) for k, v in combined.items()}
    # error: relative L2 distance of the rebuilt profile from the asked one (profiles.error).
    info = {"sigma_rel": float(sigma_rel), "gamma": sigma_to_gamma(sigma_rel), "step": until_step,
            "error": round(err, 6)}
    snap_meta = {k: v for k, v in meta.items() if k not in ("format", "sigma_rel", "gamma")} | {"phema": info}
    return checkpoint.save_snapshot(out, ema, {}, snap_meta)


def is_phema_snapshot(path) -> bool:
    try:
        return "phema" in checkpoint.read_signed_meta(path, checkpoint.SNAPSHOT_FORMAT, "snapshot")
    except UserError:
        return False


def main(args) -> int:
    from diffrelay import io

    log = logs.setup()
    if not 0 < args.sigma_rel < MAX_SIGMA_REL:
        raise UserError(f"--sigma-rel {args.sigma_rel}: must be between 0 and {MAX_SIGMA_REL:.4f} (exclusive); "
                        "edm2's good values are about 0.05 to 0.15")
    run_dir = Path(args.run_dir)
    until = args.until_step if args.until_step is not None else max(stored_steps(run_dir), default=0)
    if until <= 0:
        raise UserError(f"{run_dir / 'phema'}: no post-hoc EMA files; train with train.phema.every > 0 first")
    name = f"{checkpoint.step_name(until)}_ema{args.sigma_rel:g}.safetensors"  # the workflow's name
    out = args.out or run_dir / "snapshots" / "phema" / name
    io.check_file_target(out, is_phema_snapshot, "a post-hoc EMA snapshot written by `diffrelay phema`")
    reconstruct(run_dir, args.sigma_rel, until, out)
    log.info(f"wrote {out} (sigma_rel {args.sigma_rel:g} at step {until})")
    return 0
