"""`diffrelay prepare`: build the dataset folder once; rerunning with the same inputs does nothing.

Example:
  diffrelay prepare --config config/config.yaml            # -> results/<run>/dataset/
  diffrelay launch --standalone --nproc-per-node 8 -m diffrelay prepare --config latent.yaml   # 8 GPUs encode

A pixel dataset is made by one process (rank 0 under torchrun) with data.workers decoding processes. A latent
dataset is encoded by every rank, each its own chunks, resumable after a kill (data/encoding.py). A captioned one
with data.text_encoders and data.text_cache gets its captions' embeddings too, encoded the same way by every rank
(text/cache.py); its pixels, when it has no latents, are decoded by rank 0 while the other ranks encode captions.
"""

import contextlib
import hashlib
import json
import os
import shlex
import time
from pathlib import Path

from diffrelay import config, io, logs
from diffrelay.config import preflight
from diffrelay.data import buckets, datasets, encoders, encoding, sources
from diffrelay.errors import UserError
from diffrelay.runtime import claims, distributed, parallel
from diffrelay.text import cache
from diffrelay.text import encoders as text_encoders

WORK, CURRENT, FAILED = 2, 1, -1  # rank 0's verdict after planning, sent to every rank
RELAUNCHED = "DIFFRELAY_PREPARE_RELAUNCHED"


def main(args) -> int:
    log = logs.setup()
    cfg = config.load(args.config)
    encoded = encoders.is_latent(cfg.data.encoder) or wants_text(cfg.data)
    if args.relaunch and encoded and not os.environ.get(RELAUNCHED):
        relaunch(args)  # does not return
    out = Path(args.out) if args.out else config.run_dir(cfg) / "dataset"
    if not encoded:
        return prepare_pixels(args, cfg, out) if distributed.env_rank() == 0 else 0
    device = distributed.pick_device(cfg.run.device)  # cuda:LOCAL_RANK when there is a GPU
    if distributed.env_world() > 1:
        distributed.init(device, timeout_minutes=encoding.GROUP_MINUTES)
    try:
        return prepare_encoded(args, cfg, out, device, log)
    finally:
        distributed.teardown()


def wants_text(data) -> bool:
    """prepare caches the captions' embeddings: a captioned dataset with text encoders and data.text_cache."""
    return getattr(data, "captions", "none") != "none" and bool(data.text_encoders) and data.text_cache


def with_text(plan, data):
    """The plan with its text encoders' records; what the embeddings are (not where the folders lie) and their
    storage dtype join the fingerprint. Unchanged without a cache: such runs keep their fingerprints."""
    if not wants_text(data):
        return plan
    import dataclasses

    recs = text_encoders.records(data.text_encoders)
    part = {"dataset": plan.fingerprint, "text": text_encoders.fingerprint_part(recs), "dtype": data.text_dtype}
    fp = hashlib.sha256(json.dumps(part, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return dataclasses.replace(plan, text=tuple(recs), fingerprint=fp)


def is_current(out: Path, plan) -> bool:
    """The dataset is made from this plan, its text cache included."""
    if not datasets.is_current(out, plan):
        return False
    try:
        return not plan.text or cache.open(out) is not None
    except UserError:
        return False


def relaunch(args) -> None:
    """Become `<launcher> prepare <the same arguments>`: the workflow's way to encode on several ranks (the
    process is replaced, so nothing is left behind it)."""
    argv = shlex.split(args.relaunch) + ["prepare"] + [a for c in args.config for a in ("--config", c)]
    argv += (["--out", args.out] if args.out else []) + (["--workers", str(args.workers)] if args.workers is not None
                                                          else [])
    logs.get().info(f"prepare: encoding under {args.relaunch}")
    os.execvpe(argv[0], argv, os.environ | {RELAUNCHED: "1"})


def checks(args, cfg, out: Path) -> None:
    """Before any work: a wrong --out must fail at once, not after an hour of decoding, and delete nothing."""
    preflight.check_run_folder(cfg, ", ".join(args.config))
    preflight.check_buckets(cfg, ", ".join(args.config))  # bucket sizes the network cannot take: before decoding
    io.check_replaceable(out, datasets.is_dataset_folder, f"a dataset folder (no {datasets.FORMAT} dataset.json)",
                         "give --out a new or empty folder, or a dataset folder made by `diffrelay prepare`")


def prepare_pixels(args, cfg, out: Path) -> int:
    log, t0 = logs.get(), time.time()
    checks(args, cfg, out)
    # Fingerprint first (cheap checks, then hashing a folder's files): an unchanged source means no work.
    plan = datasets.plan(cfg.data, batch=cfg.train.batch_size)
    unchanged(args, cfg, out, plan)
    if datasets.is_current(out, plan):
        log.info(f"prepare: {out} is up to date (fingerprint {plan.fingerprint[:12]})")
        return 0
    # No "building..." line here: a bad file found while building must stay the only line on stderr.
    # atomic_dir: a killed prepare leaves only a hidden temp folder, never a dataset that looks complete.
    with io.atomic_dir(out, owned=datasets.is_dataset_folder) as tmp:
        info = datasets.build(plan, tmp, workers=workers(args, cfg))
    done(cfg, out, plan, info, t0)
    return 0


def prepare_encoded(args, cfg, out: Path, device, log) -> int:
    """A latent dataset, or a captioned one whose captions' embeddings are cached, on every rank."""
    rank, world, t0 = distributed.rank(), distributed.world(), time.time()
    latent = encoders.is_latent(cfg.data.encoder)
    work, text_work = encoding.work_dir(out), cache.work_dir(out)
    verdict, error, plan = WORK, None, None
    made = [w for w in (work, text_work) if not w.exists()]  # a refusal removes these, never an earlier one's
    if rank == 0:  # plans alone (fetching the weights, hashing the files); the others wait at from_main
        try:
            checks(args, cfg, out)
            if latent:
                preflight.net_geometry(cfg, ", ".join(args.config))  # the factor must divide the resolution
            plan = with_text(datasets.plan(cfg.data, encoders.resolve(cfg.data, cfg.run.resources) if latent
                                           else None, cfg.train.batch_size), cfg.data)
            unchanged(args, cfg, out, plan)
            if is_current(out, plan):
                log.info(f"prepare: {out} is up to date (fingerprint {plan.fingerprint[:12]})")
                for w, remove in ((work, encoding.remove_work), (text_work, cache.remove_work)):
                    if claims.claim(w, shared=False):  # a kill after the dataset was renamed into place left it;
                        remove(w)  # one that another prepare holds is that one's work
                verdict = CURRENT
            else:
                if latent:
                    claim_work(work, out)
                    encoding.write_plan(work, plan, device.type)
                if plan.text:
                    claim_work(text_work, out)
                    cache.write_plan(text_work, plan.texts, plan.text, cfg.data.text_dtype)
        except UserError as e:
            verdict, error = FAILED, e
    verdict = distributed.from_main(verdict, "planning the dataset")
    if verdict == FAILED:
        if error is not None:
            remove_made(made)
            raise error
        return 0  # rank 0 prints the one line and fails the launch
    if verdict == CURRENT:
        return 0
    text = cache.read_plan(text_work) if wants_text(cfg.data) else None
    try:
        # The text encoders load first: a bad one is said before any image is decoded or VAE-encoded.
        loaded = cache.load_encoders(text[1], device) if text is not None else None
        if loaded and rank == 0:  # captions the encoders cut: one line for the run (data.prompts.say_cut)
            from diffrelay.data import prompts

            prompts.say_cut(loaded, text[0], "captions")
        with contextlib.ExitStack() as stack:
            # atomic_dir: a killed prepare leaves only a hidden temp folder; made when rank 0 first writes into it.
            tmp = stack.enter_context(io.atomic_dir(out, owned=datasets.is_dataset_folder)) \
                if rank == 0 and not latent else None
            if latent:
                plan = encoding.read_plan(work)
                enc = encoders.load(plan.latent["encoder"], None if plan.latent["path"] is None else
                                    Path(plan.latent["path"]), plan.latent["norm"] or "dit", device)
                local = max(1, distributed.env_local_world())
                encoding.encode_chunks(plan, work, max(1, workers(args, cfg) // local), enc, device, rank, world)
                del enc
            elif rank == 0:
                # Rank 0 decodes the pixels while the others encode captions, then encodes its own chunks.
                # Spawned decoders: gloo's threads may run here (runtime/parallel.py).
                try:
                    info = datasets.build(plan, tmp, workers=workers(args, cfg), start="spawn")
                except UserError as e:  # a bad image: every rank hears it below, none waits at the barrier for it
                    error = e
            if text is not None and error is None:
                cache.build(*text[:2], text_work, rank, world, device, text[2], loaded)
            del loaded
            if distributed.from_main(FAILED if error is not None else WORK, "building the dataset") == FAILED:
                if error is not None:
                    remove_made(made)  # every rank is past its chunks: none writes into them now
                    raise error
                return 0  # rank 0 prints the one line and fails the launch
            distributed.barrier()  # every chunk is written
            if rank != 0:
                return 0
            if latent:
                tmp = stack.enter_context(io.atomic_dir(out, owned=datasets.is_dataset_folder))
                labels, rels, skipped = encoding.join(plan, work, tmp)
                info = datasets.finish(plan, tmp, labels, rels, skipped,
                                       {"encoded_on": encoded_on(device, world)}, workers=workers(args, cfg))
            if text is not None:
                cache.join(text_work, tmp, *text[:2], text[2], device)
    except UserError:
        if world == 1:  # alone, nothing else writes into them; under torchrun, see "building the dataset"
            remove_made(made)
        raise
    encoding.remove_work(work)
    cache.remove_work(text_work)
    claims.release(work)
    claims.release(text_work)
    done(cfg, out, plan, info, t0)
    return 0


def claim_work(work: Path, out: Path) -> None:
    """Hold prepare's work folder until this process ends (runtime/claims.py): a second prepare into the same
    --out would otherwise delete this one's chunks (write_plan keeps only its own plan's) or overwrite its plan,
    and its end would delete them all (remove_work)."""
    try:
        work.mkdir(parents=True, exist_ok=True)
    except OSError:
        return  # write_plan says why, in one line
    if not claims.claim(work, shared=False):
        raise UserError(f"{out}: another `diffrelay prepare` is making it (it holds {work}); wait for it to "
                        "finish, or give another --out")


def remove_made(made: list) -> None:
    """A refused prepare removes the work folders it made (their chunks and plan only: remove_work), and no
    other: one a killed prepare left is kept for the next run to resume from."""
    for w in made:
        claims.release(w)
        (encoding.remove_work if w.name.endswith(".encoding") else cache.remove_work)(w)


def encoded_on(device, processes: int) -> dict:
    """Where the latents were computed: a GPU's and a CPU's differ in rounding (not part of the fingerprint)."""
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return {"device": device.type, "name": name, "processes": processes, "torch": torch.__version__}


def is_runs(cfg, out: Path) -> bool:
    """`out` is the run's own dataset folder (the workflow's), not one given elsewhere by hand."""
    return out.resolve().parent == config.run_dir(cfg).resolve()


def unchanged(args, cfg, out: Path, plan) -> None:
    """A source changed since the run's checkpoints were trained on it is said, with what changed, before it is
    prepared anew (training then refuses to continue the run on it: data/sources.py)."""
    if is_runs(cfg, out):
        sources.warn_if_changed(config.run_dir(cfg), plan, f"{', '.join(args.config)}: "
                                + (f"data.path={cfg.data.path}" if cfg.data.kind == "folder" else "data"))


def done(cfg, out: Path, plan, info: dict, t0: float) -> None:
    if is_runs(cfg, out):
        preflight.write_run_record(cfg)
        sources.write(config.run_dir(cfg), plan)
    logs.get().info(f"prepare: wrote {info['count']} images from {plan.source}, {info['num_classes']} classes, "
                    f"{len(info['skipped'])} skipped, in {logs.fmt_duration(time.time() - t0)} -> {out}")
    for line in buckets.report(plan) if plan.buckets else []:  # each bucket's images and crop (data.buckets)
        logs.get().info(f"prepare: {line.strip()}")


def workers(args, cfg) -> int:
    """Decoding processes: --workers, else data.workers; 0 means one per core this job may use. Under torchrun
    the ranks of a node share them."""
    n = args.workers if args.workers is not None else cfg.data.workers
    return n or parallel.cores()
