"""Checks that need the file system, run before any job: at Snakemake's parse time and by every stage.

The schema can say a path is a string; only a look at the disk can say that it is a folder of images,
that a class index exists, or that a run folder was made from this very config. Found late, each of
these costs a deleted dataset or hours of retraining; found here, it costs one line.
"""

import json
import os
import re
import time
from pathlib import Path

from diffrelay import config, families, io, nets
from diffrelay.config import inputs
from diffrelay.config.inputs import count_images  # noqa: F401 (preflight.count_images, as before)
from diffrelay.evaluation import protocol
from diffrelay.errors import UserError

RUN_FORMAT = "diffrelay-run/1"
RUN_FILE = "run.json"


# ---------------------------------------------------------------------------------------------
# Inputs


def num_classes(cfg) -> int:
    """Classes the dataset will have: exact for shapes or a prepared dataset, else from the folder's top level."""
    d = cfg.data
    if d.labels == "none":
        return 0
    if d.kind == "shapes":
        from diffrelay.data.datasets import SHAPE_NAMES

        return len(SHAPE_NAMES)
    prepared = config.run_dir(cfg) / "dataset" / "dataset.json"
    try:
        return int(io.read_json(prepared)["num_classes"])
    except (UserError, KeyError, TypeError, ValueError):
        pass
    from diffrelay.data.datasets import EXTENSIONS

    entries = [e for e in os.scandir(Path(d.path).expanduser()) if not e.name.startswith(".")]
    if any(e.is_file() and e.name.lower().endswith(EXTENSIONS) for e in entries):
        return 0  # images at the top level: prepare labels nothing (datasets.folder_labels)
    tops = sum(1 for e in entries if e.is_dir())
    return tops if tops >= 2 else 0


def check_inputs(cfg, source: str) -> None:
    s = cfg.sample
    inputs.check(cfg, source)  # data.path, data.val_path and the image counts the later stages need
    if isinstance(s.guide, str):  # a step (int) is this run's snapshot, which the workflow waits for
        try:
            io.check_regular_file(Path(s.guide).expanduser(), 1 << 40, "file", "give the path of a snapshot "
                                  "(.safetensors), e.g. results/<run>/snapshots/step_0001000.safetensors, or null")
        except UserError as e:
            raise UserError(f"{source}: sample.guide={e}") from e
    elif s.guide is not None and s.snapshot is None:  # a step: it must be one this run writes a snapshot at
        steps = run_snapshot_steps(cfg)
        if s.guide not in steps:
            raise UserError(f"{source}: sample.guide={s.guide}: this run writes no snapshot at that step; use one of "
                            f"{steps[:8]} (segment ends and train.snapshot_every), or a snapshot file")
    if s.snapshot is not None:
        check_evaluated_snapshot(cfg, source)
    fid = cfg.to_dict()["fid"]
    key = "fid.extractors" if fid.get("extractors") else "fid.extractor"
    for name in protocol.extractor_names(fid):
        if name not in protocol.BUILTIN:
            try:
                io.check_regular_file(Path(name).expanduser(), 1 << 34, "file", "give an existing TorchScript "
                                      f"file, or one of {', '.join(protocol.BUILTIN)}")
            except UserError as e:
                raise UserError(f"{source}: {key}={e}") from e
        ref = protocol.reference_file(fid, name)
        if ref is not None:
            try:
                io.check_regular_file(Path(ref), 1 << 34, "file",
                                      "give an .npz with mu and sigma, or null to use the dataset's statistics")
            except UserError as e:
                raise UserError(f"{source}: fid.reference={e}") from e
            # The file as its scoring job will read it (headers, declared sizes, the metrics asked for), before any
            # job: an ADM batch against fid.metrics, a file made elsewhere as its mu and sigma.
            from diffrelay.evaluation import metrics as stats
            from diffrelay.evaluation import scores

            from diffrelay.evaluation.fid import is_statistics_file

            wanted, side = set(fid.get("metrics") or ()), cfg.data.resolution
            try:
                if scores.is_adm(ref) and name in protocol.BUILTIN and name != "inception":
                    raise UserError(f"{ref}: an ADM reference batch holds Inception statistics, and the extractor "
                                    f"is {name}; give it only for inception (fid.reference: {{inception: ...}})")
                if wanted and scores.is_adm(ref):
                    scores.check_adm_file(ref, wanted, (side, side), f"data.resolution={side} images")
                elif wanted & scores.NEED_REFERENCE_FEATURES and not is_statistics_file(ref):
                    raise UserError(f"{ref}: holds mu and sigma only, so no "
                                    f"{', '.join(sorted(wanted & scores.NEED_REFERENCE_FEATURES))}; use an ADM "
                                    "batch with arr_0 or the dataset's own statistics, or drop them from fid.metrics")
                elif not is_statistics_file(ref):
                    stats.load_foreign_ref(ref)
            except UserError as e:
                raise UserError(f"{source}: fid.reference: {e}") from e
    classes = num_classes(cfg)
    if cfg.model.class_conditional and not classes:
        raise UserError(f"{source}: model.class_conditional=true: the dataset has no classes (images must sit in "
                        "two or more first-level subfolders); set it to false or sort the images into folders")
    if isinstance(s.class_labels, int) and cfg.model.class_conditional and s.class_labels >= classes:
        raise UserError(f"{source}: sample.class_labels={s.class_labels}: no such class; the dataset has {classes} "
                        f"classes, use 0..{classes - 1} or balanced")


def evaluated_snapshot_meta(cfg, source: str) -> dict:
    """The record of sample.snapshot (header only, no torch): the file a run that trains nothing evaluates."""
    path = Path(cfg.sample.snapshot).expanduser()
    fix = "give a snapshot (.safetensors) that `diffrelay import` or training wrote, or null to train"
    try:
        io.check_regular_file(path, 1 << 40, "snapshot", fix)
        meta = io.signed_header(path, "snapshot", fix)[1]
    except UserError as e:
        raise UserError(f"{source}: sample.snapshot={e}") from e
    if meta.get("format") != io.SNAPSHOT_FORMAT:
        raise UserError(f"{source}: sample.snapshot={path}: format={meta.get('format')!r}, not a snapshot; {fix}")
    return meta


def check_evaluated_snapshot(cfg, source: str) -> None:
    """sample.snapshot fits this config: its network, image shape and class count, the EMAs and guidance asked for;
    nothing asks for training; and the run folder is not a trained run's (its samples and report would mix)."""
    s, path = cfg.sample, cfg.sample.snapshot
    meta = evaluated_snapshot_meta(cfg, source)
    recorded, wanted = meta.get("model") if isinstance(meta.get("model"), dict) else {}, cfg.to_dict()["model"]
    key = nets.same_network(recorded, wanted)
    if key is not None:
        raise UserError(f"{source}: sample.snapshot={path}: made for model.{key}={recorded.get(key)!r}, the config "
                        f"has {wanted.get(key)!r}; set the config's model section to the snapshot's")
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UserError(f"{source}: sample.snapshot={path}: records step {step!r}, not a step number; re-create it "
                        "(diffrelay import --step N)")
    channels, side = net_geometry(cfg, source)
    if list(meta.get("image_shape", [])) != [channels, side, side]:
        raise UserError(f"{source}: sample.snapshot={path}: images of shape {meta.get('image_shape')}, the config "
                        f"makes {[channels, side, side]} (data.resolution, data.encoder); set data.resolution and "
                        "data.encoder to the snapshot's")
    classes = num_classes(cfg) if cfg.model.class_conditional else 0
    if meta.get("num_classes") != classes:
        raise UserError(f"{source}: sample.snapshot={path}: {meta.get('num_classes')} classes, the dataset has "
                        f"{classes}; use the dataset it was trained on (the class count fixes what the labels mean)")
    train = (meta.get("config") or {}).get("train") or {}
    decays = [] if "imported" in meta else [float(d) for d in train.get("ema_decays") or []]
    asked = s.ema_decay if isinstance(s.ema_decay, list) else [] if s.ema_decay is None else [s.ema_decay]
    missing = [d for d in asked if float(d) not in decays]
    guided = any(g != 1 for g in protocol.guidance_scales(cfg.to_dict()["sample"])) and s.guide is None
    trained = run_dir_has_training(config.run_dir(cfg))
    for bad, why in ((s.phema, "sample.phema needs this run's training"), (isinstance(s.guide, int),
                     "sample.guide names a step of this run's training; give a snapshot file"),
                     ("imported" in meta and s.weights == "raw", "an imported snapshot holds one set of weights, "
                      "its EMA; use sample.weights: ema"),
                     (missing, f"sample.ema_decay {missing}: the file holds the EMAs {decays or 'of one decay'}; "
                      "set sample.ema_decay to one of those, or null"),
                     (guided and not train.get("label_dropout"), "guidance needs a network trained with label dropout "
                      "and its record has train.label_dropout 0; set it as the checkpoint was trained (DiT, SiT: 0.1) "
                      "before diffrelay import, or sample.guidance: 1"),
                     (trained, f"{config.run_dir(cfg)} holds a trained run, whose samples and report this evaluation "
                      "would mix with its own; give it its own run.name")):
        if bad:
            raise UserError(f"{source}: sample.snapshot={path} trains nothing: {why}")


def trained_steps(cfg) -> list[int]:
    """Steps of the complete segment checkpoints the run folder already has (same trajectory): they stay
    segment ends whatever train.segment_steps says now (config.segment_ends). The workflow plans with these."""
    folder, want, steps = config.run_dir(cfg) / "checkpoints", config.trajectory_hash(cfg), []
    for p in folder.glob("step_*") if folder.is_dir() else []:
        m = re.fullmatch(r"step_(\d{7})", p.name)
        try:
            complete = (p / "manifest.json").is_file()
            same = config.is_same_run(json.loads((p / "meta.json").read_text()), want)
        except (OSError, ValueError):
            continue
        if m and complete and same:
            steps.append(int(m.group(1)))
    return steps


def run_snapshot_steps(cfg) -> list[int]:
    """Every step a training run writes a snapshot at, as the workflow plans it (sample.guide may name one)."""
    ends = config.segment_ends(cfg, done=trained_steps(cfg))
    return sorted({s for start, end in zip([0] + ends, ends) for s in config.snapshot_steps(cfg, start, end)})


def run_dir_has_training(run_dir: Path) -> bool:
    return any((run_dir / name).is_dir() and any((run_dir / name).iterdir()) for name in ("checkpoints", "trained"))


# ---------------------------------------------------------------------------------------------
# The run folder's record of what it was made from


def _recorded(run_dir: Path) -> tuple[dict, Path] | None:
    """(trajectory, file) the run folder was made from: run.json, or for older folders the newest checkpoint."""
    record = run_dir / RUN_FILE
    if record.is_file():
        d = io.read_json(record)
        if not isinstance(d, dict) or d.get("format") != RUN_FORMAT or not isinstance(d.get("trajectory"), dict):
            raise UserError(f"{record}: not a {RUN_FORMAT} file; restore it, or use a new run.name")
        return d["trajectory"], record
    if not (run_dir / "checkpoints").is_dir():  # a new run: no need to import torch (about 1.3 s per snakemake call)
        return None
    from diffrelay.training.checkpoint import list_checkpoints

    for _, path in reversed(list_checkpoints(run_dir / "checkpoints")):
        try:
            return config.trajectory(io.read_json(path / "meta.json")["config"]), path / "meta.json"
        except (UserError, KeyError, TypeError):
            continue
    return None


def check_run_folder(cfg, source: str) -> None:
    """Refuse a config whose weights-changing settings differ from those the run folder was made from."""
    run_dir = config.run_dir(cfg)
    found = _recorded(run_dir)
    if found is None:
        return
    recorded, where = found
    # A key the record lacks (added to diffrelay later) counts as its default.
    defaults = config.trajectory(config.validate({}))
    ours = config.trajectory(cfg)
    # A record written before inapplicable keys were set aside holds them as given: set aside here too.
    recorded = config.applicable(_with_defaults(recorded, defaults))
    config.check_same_files(recorded, ours, source, f"{run_dir} ({where.name})")  # names the file: its key has dots
    key = config.first_difference(recorded, ours)
    if key:
        from diffrelay.training import settings  # a key left out at its default shows its default, not None

        was, now = (settings.recorded(key, config.lookup(t, key)) for t in (recorded, ours))
        raise UserError(f"{source}: {key}={now!r}, but {run_dir} was made with {key}={was!r} ({where.name}); "
                        f"to start a different run use a new run.name (nothing is deleted), or set {key} back to "
                        f"{was!r}")


def _with_defaults(recorded: dict, defaults: dict) -> dict:
    out = dict(defaults)
    for k, v in recorded.items():
        out[k] = _with_defaults(v, defaults[k]) if isinstance(v, dict) and isinstance(defaults.get(k), dict) else v
    return out


def write_run_record(cfg) -> None:
    """Record what the run folder is made from, once; later stages and parses compare against it."""
    record = config.run_dir(cfg) / RUN_FILE
    if not record.exists():
        io.write_json(record, {"format": RUN_FORMAT, "trajectory": config.trajectory(cfg), "created": time.time()})


def net_geometry(cfg, source: str = "config") -> tuple[int, int]:
    """(channels, side) of what the network sees: the images, or their latents (data.encoder)."""
    from diffrelay.data import encoders

    d = cfg.data
    if not encoders.is_latent(d.encoder):
        return 3, d.resolution
    try:
        channels, factor = encoders.geometry(d.encoder, d.encoder_path)
    except UserError as e:
        raise UserError(f"{source}: {e}") from e
    if d.resolution % factor:
        raise UserError(f"{source}: data.resolution={d.resolution}: data.encoder={d.encoder} down-samples by "
                        f"{factor}, which does not divide it; use a multiple of {factor}")
    return channels, d.resolution // factor


def check_latent(cfg, source: str) -> None:
    """The encoder's geometry fits the resolution, and the network fits the latents (nets/checks.py)."""
    if cfg.data.encoder == "none":
        return
    from diffrelay.data import encoders

    path = cfg.data.encoder_path  # the SD-VAE's weights, by their header (fetched ones are checked when fetched)
    weights = encoders.weights_file(Path(path).expanduser()) if path and cfg.data.encoder in encoders.SD_VAE else None
    why = io.safetensors_problem(weights) if weights is not None and weights.exists() else None
    if why:
        raise UserError(f"{source}: data.encoder_path: {weights}: {why}; {encoders.FIX}")
    latent_model(cfg, net_geometry(cfg, source)[1], source)


def latent_model(cfg, side: int, source: str) -> None:
    """The network fits `side` x `side` latents (config load checks a pixel run's network against the images)."""
    from diffrelay.nets import checks

    bad = checks.check_model(cfg.to_dict()["model"], side)
    if bad:
        key, why = bad[0]
        raise UserError(f"{source}: {key}: {why} (the network sees {side}x{side} latents)")


def bucket_sizes(cfg, sizes, source: str, key: str = "data.buckets.step") -> None:
    """Every bucket size (width, height in pixels) is one the network takes: a multiple of the encoder's factor
    times the network's down-sampling; DiT's and SiT's position tables take one size only."""
    from diffrelay.nets import checks

    factor = cfg.data.resolution // net_geometry(cfg, source)[1]  # the encoder's (1 for pixels)
    down = checks.downsampling(cfg.to_dict()["model"])
    if down is None:
        raise UserError(f"{source}: data.buckets: model.arch={cfg.model.arch} has position tables of one size "
                        "(data.resolution's square), so it cannot train other shapes; set data.buckets null")
    kw = cfg.to_dict()["model"]["kwargs"]
    family = families.of_config(cfg.to_dict()["model"])
    table = family.position_table(kw) if family else None  # SD3 crops its table (pos_embed_max_size)
    for w, h in sizes:
        if table and max(w, h) // (factor * down) > table:
            raise UserError(f"{source}: data.buckets: bucket {w}x{h} is {max(w, h) // (factor * down)} patches long, "
                            f"more than the {family.short} transformer's position table (pos_embed_max_size={table}); lower "
                            "data.buckets.max_aspect or data.resolution")
        if w % (factor * down) or h % (factor * down):
            raise UserError(f"{source}: {key}={cfg.data.buckets.step}: bucket {w}x{h} is not a multiple of "
                            f"{factor * down} (the encoder's factor {factor} x the network's down-sampling {down}); "
                            f"use a step that is a multiple of {factor * down}")


def dataset_buckets(cfg, data, source: str) -> None:
    """A bucketed dataset (data.buckets) at training: every bucket fills a global batch, the network takes its size."""
    if (cfg.data.buckets is None) != (data.buckets is None):
        made, want = ("with", "without") if data.buckets is not None else ("without", "with")
        raise UserError(f"{data.path}: prepared {made} data.buckets and {source} trains {want} them; set data.buckets "
                        "as the dataset was made, or prepare it again into a new folder")
    if data.buckets is not None:
        from diffrelay.data import bucketed

        bucketed.check_batches(data, cfg.train.batch_size, source)
        bucket_sizes(cfg, data.buckets.sizes, source)


def check_buckets(cfg, source: str) -> None:
    """data.buckets: the step gives buckets the network takes (before prepare decodes anything)."""
    if getattr(cfg.data, "buckets", None) is None:
        return
    from diffrelay.data import buckets

    b = cfg.data.buckets
    if cfg.data.kind != "folder" or cfg.data.crop != "center":
        raise UserError(f"{source}: data.buckets: needs a folder of images (data.kind folder) cut with data.crop "
                        f"center (this config: {cfg.data.kind}, {cfg.data.crop}); set those, or data.buckets null")
    try:
        buckets.check_settings({"step": b.step, "max_aspect": b.max_aspect}, cfg.data.resolution)
    except UserError as e:
        raise UserError(f"{source}: {e}") from e
    bucket_sizes(cfg, buckets.sizes(cfg.data.resolution, b.step, b.max_aspect), source)


def check_sizes(cfg, source: str) -> None:
    """sample.sizes of a latent run (a pixel run's are config.rules') and the sizes prompt files give their entries
    (width, height) against the network's whole down-sampling and position tables (nets/checks.py), before any job.
    A prompt file that cannot be read is said when it is sampled, naming its line."""
    from diffrelay.data import prompts
    from diffrelay.nets import checks

    d = cfg.to_dict()
    wanted = [tuple(x) for x in d["sample"].get("sizes") or []]
    given = []
    for f in protocol.prompt_files(d["sample"]) if cfg.data.captions != "none" else []:
        try:
            given += [(f, k, e) for k, e in enumerate(prompts.read(f), 1) if e.width is not None]
        except UserError:
            continue
    if not wanted and not given:
        return
    vae = cfg.data.resolution // net_geometry(cfg, source)[1]  # the encoder's factor (1 for pixels)
    bad = checks.check_sizes(d["model"], wanted, vae, cfg.data.resolution) if vae > 1 else []
    if bad:
        raise UserError(f"{source}: {bad[0][0]}: {bad[0][1]}")
    for f, k, e in given:
        bad = checks.check_sizes(d["model"], [(e.width, e.height)], vae, cfg.data.resolution)
        if bad:
            raise UserError(f"{f}: entry {k}: width {e.width}, height {e.height}: {bad[0][1]}")


def check(cfg, source: str, credentials: bool = True) -> None:
    """Everything that can be checked before any job starts; `credentials`: also the trackers' (only where the
    track jobs run: the Snakefile's main process and `diffrelay validate`, not a job's parse on a node)."""
    from diffrelay.tracking import settings as tracking  # light: neither wandb nor mlflow

    # Here, not in config.validate: credentials matter where the track jobs run (the submit host), not on the
    # nodes that train.
    bad = tracking.check_config(cfg.to_dict()) if credentials else []
    if bad:
        raise UserError(f"{source}: {bad[0][0]}: {bad[0][1]}")
    check_latent(cfg, source)
    check_sizes(cfg, source)
    check_buckets(cfg, source)
    check_inputs(cfg, source)
    from diffrelay.data import texts  # the tokenizers against the run's own prompts and captions (text/tokens.py)
    texts.check_tokenizers(cfg.to_dict())
    check_run_folder(cfg, source)
