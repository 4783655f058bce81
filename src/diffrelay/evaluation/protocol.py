"""What the evaluation of a run consists of: which extractors, against which references, over which seed
sets, and the optional second pass that scores the best checkpoints again with many images.

Plain Python (no torch), so the Snakefile, `validate` and `report` share one reading of the config.

Names of one evaluation (a sample folder and its score file): `step_0000400` plus a variant suffix,
  _ema0.08 a post-hoc EMA reconstruction of that width (sample.phema; none: the training's EMA)
  _decay0.9999  which of train.ema_decays's EMAs is sampled (sample.ema_decay; none: the first)
  _n50000  the second ("final") pass with fid.final.num_images images (none: sample.num_images)
  _g1.5    classifier-free guidance scale (none: 1)
  _s2      seed set 2 of sample.seed_sets (none: set 0), seeds first_seed + 2 x images + i
  _p1      a text run's prompt file 1 of sample.prompts (none: the first); _ph its held-out captions
           (sample.held_out_captions: the held-out FID's images beside the prompt files')
  _1216x832  the image size, width x height in pixels, of sample.sizes (none: the data.resolution square)
in that order, e.g. step_0000400_n50000_g1.5_s2 or step_0001200_ema0.08_s1_1216x832.
"""

import re
from pathlib import Path

VARIANT = r"(_ema[0-9.e-]+)?(_decay[0-9.e-]+)?(_n\d+)?(_g[0-9.e+-]+)?(_s\d+)?(_p\d+|_ph)?(_\d+x\d+)?"
HELD_OUT = -1  # variant_prompts of _ph: one image per held-out caption, not a prompt file
_VARIANT = re.compile(rf"^{VARIANT}\Z")
STEP_STEM = re.compile(rf"^step_(\d{{7}})({VARIANT})\Z")

# Extractors diffrelay can fetch or build, by the name a config uses; the value is the file's stem under
# <run.resources>/extractors/ (random's carries the run's seed).
# fid.metrics (scores.py); the papers' tables print them in this order: FID, sFID, IS, precision, recall.
METRICS = ("fid", "sfid", "is", "precision", "recall", "kid", "fd_dinov2")
DINOV2_MODELS = ("vits14", "vitb14", "vitl14", "vitg14")
BUILTIN = {"inception": "inception-2015-12-05", "random": "random-seed{seed}", "dinov2": "dinov2-vitl14",
           **{f"dinov2-{m}": f"dinov2-{m}" for m in DINOV2_MODELS}}


# ---------------------------------------------------------------------------------------------
# Variants


def variant(count: int | None = None, guidance: float = 1.0, seed_set: int = 0, ema: float | None = None,
            decay: float | None = None, prompts: int = 0, size: tuple[int, int] | None = None) -> str:
    """The suffix of one evaluation's names; "" for the training's first EMA, first pass, guidance 1, seed set 0,
    a text run's first prompt file (sample.prompts k > 0 adds _p<k>) and the data.resolution square (a size of
    sample.sizes, (width, height), adds _<width>x<height>)."""
    return ((f"_ema{float(ema):g}" if ema is not None else "") + (f"_decay{float(decay):g}" if decay is not None else "")
            + (f"_n{count}" if count else "")
            + ("" if float(guidance) == 1 else f"_g{float(guidance):g}") + (f"_s{seed_set}" if seed_set else "")
            + ("_ph" if prompts == HELD_OUT else f"_p{prompts}" if prompts else "")
            + (f"_{int(size[0])}x{int(size[1])}" if size is not None else ""))


def _groups(suffix: str):
    m = _VARIANT.match(suffix)
    if not m:
        raise ValueError(f"{suffix!r}: not an evaluation variant like _n50000_g1.5_s2")
    return m.groups()


def parse_variant(suffix: str) -> tuple[int | None, float, int]:
    """(count or None, guidance, seed set) of a variant suffix; ValueError if it is not one."""
    _, _, count, guidance, seed_set, _, _ = _groups(suffix)
    return (int(count[2:]) if count else None, float(guidance[2:]) if guidance else 1.0,
            int(seed_set[2:]) if seed_set else 0)


def variant_ema(suffix: str) -> float | None:
    """sigma_rel of a post-hoc EMA variant (_ema0.08...), None for the training's own EMA."""
    ema = _groups(suffix)[0]
    return float(ema[4:]) if ema else None


def variant_prompts(suffix: str) -> int:
    """Which of sample.prompts's files a text run's variant samples (_p1 ...), 0 for the first, HELD_OUT for its
    held-out captions (_ph)."""
    k = _groups(suffix)[5]
    return HELD_OUT if k == "_ph" else int(k[2:]) if k else 0


def variant_size(suffix: str) -> tuple[int, int] | None:
    """(width, height) of a variant of sample.sizes (_1216x832), None for the data.resolution square."""
    size = _groups(suffix)[6]
    return None if not size else tuple(int(x) for x in size[1:].split("x"))


def sizes(d: dict) -> list[tuple[int, int] | None]:
    """The image sizes each evaluation samples (sample.sizes), each as its variant names it: None for the
    data.resolution square (so runs without sample.sizes, and the square's folders, keep their names), else
    (width, height) in pixels."""
    want, side = d["sample"].get("sizes"), d["data"]["resolution"]
    if not want:
        return [None]
    return [None if (int(w), int(h)) == (side, side) else (int(w), int(h)) for w, h in want]


def size_name(size) -> str:
    """'1216x832' of (width, height); '' of None (the square)."""
    return "" if size is None else f"{int(size[0])}x{int(size[1])}"


def prompt_files(sample: dict) -> list[str]:
    """sample.prompts as a list of files ([] without prompts)."""
    p = sample.get("prompts")
    return [] if p is None else [p] if isinstance(p, str) else list(p)


def variant_decay(suffix: str) -> float | None:
    """The EMA decay a variant samples (_decay0.9999), None for the first of train.ema_decays."""
    decay = _groups(suffix)[1]
    return float(decay[6:]) if decay else None


def ema_decays(d: dict) -> list[float | None]:
    """The EMAs the evaluation samples (sample.ema_decay, one or a list), each as its variant names it: None for
    the first of train.ema_decays (so runs that never set it keep their names), else the decay. A run with
    train.ema_halflife_kimg has one EMA (ema_decays []), and it is the first."""
    want = d["sample"].get("ema_decay")
    want = want if isinstance(want, list) else [want]
    first = float(d["train"]["ema_decays"][0]) if d["train"]["ema_decays"] else None
    return [None if x is None or float(x) == first else float(x) for x in want]


def first_seed(first: int, num_images: int, seed_set: int) -> int:
    """Seed of image 0 of a seed set: sets are disjoint, consecutive ranges of num_images seeds."""
    return first + seed_set * num_images


def guidance_scales(sample: dict) -> list[float]:
    g = sample["guidance"]
    return [float(x) for x in (g if isinstance(g, (list, tuple)) else [g])]


# ---------------------------------------------------------------------------------------------
# Extractors and references


def extractor_names(fid: dict) -> list[str]:
    """The extractors as the config names them, primary (the one that picks the best checkpoint) first."""
    if fid.get("extractors"):
        return list(fid["extractors"])
    return [fid.get("extractor") or "random"]


def extractor_key(name: str, seed: int) -> str:
    """A file-name-safe key of an extractor: the fetched file's stem, or a custom file's stem."""
    if name in BUILTIN:
        return BUILTIN[name].format(seed=seed)
    return re.sub(r"[^A-Za-z0-9._-]", "_", Path(name).stem) or "extractor"


def extractor_file(name: str, seed: int, resources: str) -> str:
    """Where an extractor's TorchScript file is: fetched into resources/, or the user's own path."""
    if name in BUILTIN:
        return f"{resources}/extractors/{extractor_key(name, seed)}.pt"
    return str(Path(name).expanduser())


def reference_file(fid: dict, name: str) -> str | None:
    """fid.reference for one extractor: a file made elsewhere, or None (the dataset's own statistics)."""
    ref = fid.get("reference")
    if isinstance(ref, dict):
        ref = ref.get(name)
    return None if ref is None else str(Path(ref).expanduser())


def check_config(d: dict) -> list[tuple[str, str]]:
    """Rules across keys for the evaluation sections: (key, message) pairs, empty when all is well."""
    from diffrelay.data.order import MAX_SEED

    bad, f, s = check_val_loss(d), d["fid"], d["sample"]
    names = extractor_names(f)
    keys = [extractor_key(n, d["run"]["seed"]) for n in names]
    if len(set(keys)) < len(keys):
        dup = next(n for n, k in zip(names, keys) if keys.count(k) > 1)
        bad.append((f"fid.extractors={dup}", "named twice (or two files share a name); list each extractor once"))
    ref = f.get("reference")
    if isinstance(ref, str) and len(names) > 1:
        bad.append((f"fid.reference={ref}", f"one file for {len(names)} extractors; give one per extractor, e.g. "
                    f"{{{names[0]}: {ref}}} (the others then use the dataset's statistics)"))
    if isinstance(ref, dict):
        for key in ref:
            if key not in names:
                bad.append((f"fid.reference.{key}", f"not one of the extractors ({', '.join(names)}); "
                            "key each file by an extractor's name as fid.extractors writes it"))
    bad += _check_metrics(f, names)
    final = f["final"]
    if final["best"] and len(prompt_files(s)) > 1:
        bad.append(("fid.final.best", "the second pass scores one prompt file; with several in sample.prompts, set "
                    "it to 0 or give one file"))
    if final["best"] and len(sizes(d)) > 1:
        bad.append(("fid.final.best", "the second pass scores one image size; with several in sample.sizes, set it "
                    "to 0 or give one size"))
    if final["best"] and final["num_images"] <= s["num_images"]:
        bad.append((f"fid.final.num_images={final['num_images']}", f"not more than sample.num_images="
                    f"{s['num_images']}; the second pass exists to score the best checkpoints with more images"))
    most = max(s["num_images"], final["num_images"] if final["best"] else 0)
    if s["first_seed"] + s["seed_sets"] * most > MAX_SEED:
        bad.append((f"sample.first_seed={s['first_seed']}", f"plus {s['seed_sets']} seed set(s) of {most} images "
                    f"passes the largest seed {MAX_SEED}; use a smaller one"))
    return bad


def check_val_loss(cfg: dict) -> list[tuple[str, str]]:
    """(key, problem) when fid.metrics or fid.best_by asks for val_loss (sampling/val_loss.py) and the dataset
    holds nothing out."""
    fid, data = cfg["fid"], cfg["data"]
    wanted = "val_loss" in (fid.get("metrics") or []) or fid.get("best_by") == "val_loss"
    if not wanted:
        return []
    if fid.get("best_by") == "val_loss" and "val_loss" not in (fid.get("metrics") or []):
        return [("fid.best_by=val_loss", "needs val_loss in fid.metrics, which computes it")]
    if data.get("captions", "none") == "none" or not (data.get("val_fraction") or data.get("val_path")):
        return [("fid.metrics: val_loss", "needs a held-out split of a captioned dataset (data.captions with "
                 "data.val_fraction > 0 or data.val_path); hold images out with data.val_fraction (or "
                 "data.val_path) and rerun `diffrelay prepare`, or drop val_loss from fid.metrics")]
    return []


def _check_metrics(f: dict, names: list[str]) -> list[tuple[str, str]]:
    wanted, by = f.get("metrics"), f["best_by"]
    # The scores of a model of their own are computed when the model is named (fid.pick_model, fid.classifier)
    own = {"pick_score": "pick_model", "class_accuracy": "classifier"}
    if by in own and not f.get(own[by]):
        return [(f"fid.best_by={by}", f"needs fid.{own[by]}, the model that computes it; set it, or pick another "
                 "best_by")]
    if by not in ("fid", "clip_score", "val_loss", *own) and by not in (wanted or []):  # text.py's, val_loss's rules
        return [(f"fid.best_by={by}", f"not among the metrics each result holds (fid.metrics="
                 f"{','.join(wanted) if wanted else 'null'}); add {by} to fid.metrics, or pick another best_by")]
    if not wanted:
        return []
    key, bad = f"fid.metrics={','.join(wanted)}", []
    for name in names:
        need = "fd_dinov2" if name.startswith("dinov2") else "fid"
        if need not in wanted:
            bad.append((key, f"has no {need} for the extractor {name}; add {need}, or drop {name} from fid.extractors"))
    if "fd_dinov2" in wanted and not any(n.startswith("dinov2") for n in names):
        bad.append((key, "fd_dinov2 needs a DINOv2 extractor; add dinov2 to fid.extractors, or drop fd_dinov2"))
    inception = [n for n in names if n == "inception" or n not in BUILTIN]  # a path may be an Inception file
    if {"sfid", "is"} & set(wanted) and not inception:
        bad.append((key, "sfid and is come from clean-fid's Inception; add inception to fid.extractors, or drop them"))
    if "sfid" in wanted and inception and all(reference_file(f, n) is None for n in inception):
        bad.append((key, "sfid needs ADM's spatial statistics: give fid.reference for inception as an ADM reference "
                    "batch with mu_s and sigma_s (e.g. VIRTUAL_imagenet256_labeled.npz), or drop sfid"))
    return bad


# ---------------------------------------------------------------------------------------------
# The second pass


def rank(results: list[dict], best: int) -> list[dict]:
    """The `best` (step, guidance, EMA decay) evaluations with the lowest primary score, averaged over seed sets.

    results: score records of the first pass, each with step, guidance, decay (None: the first EMA) and the
    primary metric's value. A pick names its decay only when it is not the first, as its variant does."""
    by_pair: dict[tuple, list[float]] = {}
    for r in results:
        by_pair.setdefault((r["step"], r["guidance"], r.get("decay")), []).append(r["fid"])
    mean = {k: sum(v) / len(v) for k, v in by_pair.items() if all(x == x for x in v)}  # NaN scores never win
    order = sorted(mean, key=lambda k: (mean[k], k[0], k[1], -1 if k[2] is None else k[2]))
    return [{"step": k[0], "guidance": k[1], "score": mean[k]} | ({} if k[2] is None else {"decay": k[2]})
            for k in order[:best]]


def first_pass_results(score_files) -> list[dict]:
    """step, guidance, seed set, metric and primary score of each first-pass result file."""
    from diffrelay import io
    from diffrelay.errors import UserError

    out = []
    for path in map(Path, score_files):
        m = STEP_STEM.match(path.stem)
        count, guidance, seed_set = parse_variant(m.group(2)) if m else (None, 1.0, 0)
        if not m or count is not None or variant_ema(m.group(2)) is not None:
            continue  # not a score of the first pass (the second pass, or a post-hoc EMA at the end)
        rec = io.read_json(path)
        fid = rec.get("fid") if isinstance(rec, dict) else None
        if isinstance(fid, bool) or not isinstance(fid, (int, float)):
            raise UserError(f"{path}: fid={fid!r}: missing or not a number; score that folder again (diffrelay fid)")
        out.append({"step": int(m.group(1)), "guidance": guidance, "seed_set": seed_set,
                    "decay": variant_decay(m.group(2)), "metric": rec.get("metric"), "fid": float(fid)})
    return out


SELECTED_KEYS = ("best", "metric", "selected")


def main_select_best(args) -> int:
    """`diffrelay select-best`: rank the first-pass scores listed by the segments' collect files."""
    from diffrelay import io, logs

    log = logs.setup()
    io.check_file_target(args.out, lambda p: io.is_json_object(p, SELECTED_KEYS, exact=True),
                         "a selection written by `diffrelay select-best`")
    files = [f for seg in args.segments for f in io.read_json(seg)["scores"]]
    results = first_pass_results(files)
    metrics = sorted({r["metric"] for r in results if r["metric"]})
    selected = rank(results, args.best)
    nan = dict.fromkeys(f"step {r['step']}" + ("" if r["guidance"] == 1 else f" guidance {r['guidance']:g}")
                        for r in results if r["fid"] != r["fid"])
    if nan:  # a NaN score never wins (rank): say which, once
        log.warning(f"second pass: {', '.join(nan)} left out of the ranking: {', '.join(metrics) or 'the score'} "
                    "is NaN (broken samples; check the training loss)")
    io.write_json(args.out, dict(zip(SELECTED_KEYS, (args.best, metrics, selected))))
    for s in selected:
        ema = f", EMA decay {s['decay']:g}" if "decay" in s else ""
        log.info(f"second pass: step {s['step']}, guidance {s['guidance']:g}{ema} ({', '.join(metrics)} {s['score']:.4g})")
    return 0
