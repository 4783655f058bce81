"""FID/KID with clean-fid: reference statistics of a dataset, and scores of image folders in a clean subprocess.

Examples:
  diffrelay fid-ref --dataset results/demo/dataset --extractor resources/extractors/random-seed0.pt \\
      --cache-dir resources/fid-ref --out results/demo/fid/reference_random-seed0.npz
  diffrelay fid --images results/demo/samples/step_0000400 --ref results/demo/fid/reference_random-seed0.npz \\
      --extractor resources/extractors/random-seed0.pt --out results/demo/metrics/fid/step_0000400.json

`diffrelay fid` re-runs itself with --in-process as a fresh child through `run_clean`, whose environment
has no torchrun variables: scoring can never join, or wait for, a training process group.
"""

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import numpy as np

from diffrelay import io, logs
from diffrelay.evaluation import features, refsize
from diffrelay.evaluation.metrics import distances, frechet, kernel_distance, statistics  # noqa: F401 (used here and by callers)
from diffrelay.runtime import distributed, parallel
from diffrelay.errors import UserError

FORMAT = "diffrelay-fid-ref/1"
# KID draws subsets of at most 1000 rows (clean-fid's max_subset_size), so 10k reference rows are plenty,
# and they bound the file: 10k x 2048 float32 = 80 MB for Inception.
MAX_FEATURES = 10_000
ARRAYS = ("mu", "sigma", "features", "settings")
log = logs.get()


def _device(want: str = "auto"):
    """The scoring device (run.device: auto, cuda or cpu), in full fp32: PyTorch's default lets cuDNN
    convolutions run in TF32, which would make GPU features differ from the reference's by more than
    rounding."""
    from diffrelay.runtime import speed

    device = distributed.pick_device(want)
    speed.set_backends(device, tf32=False)
    return device


def load_reference(path) -> dict:
    """Statistics from `diffrelay fid-ref` (verified by its digest), or a file made elsewhere
    (EDM/ADM/clean-fid `.npz` with mu and sigma; settings["foreign"] is then true)."""
    from diffrelay.evaluation import metrics

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: reference statistics not found; rerun `diffrelay fid-ref` or fix fid.reference")
    try:
        with zipfile.ZipFile(path) as z:
            ours = "digest.npy" in z.namelist()
    except (OSError, zipfile.BadZipFile):
        ours = False
    return load_ref(path) if ours else metrics.load_foreign_ref(path)


def check_reference(ref: dict, path, extractor_sha256: str, mode: str) -> None:
    """Our own statistics must come from this extractor and mode; a foreign file's feature count is
    checked against the extractor in `score`."""
    if not ref["settings"].get("foreign"):
        check_ref(ref, path, extractor_sha256, mode)


# ---------------------------------------------------------------------------- the statistics file

def _digest(arrays: dict) -> str:
    h = hashlib.sha256()
    for k in ARRAYS:
        a = np.ascontiguousarray(arrays[k])
        h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def save_ref(path, mu, sigma, feats, settings: dict) -> None:
    """Write mu, sigma, features and settings atomically, with a sha256 of them all inside (`digest`)."""
    arrays = {"mu": mu, "sigma": sigma, "features": feats, "settings": np.array(json.dumps(settings, sort_keys=True))}
    with io.atomic_write(path) as f:
        np.savez(f, digest=np.array(_digest(arrays)), **arrays)


def load_ref(path) -> dict:
    """Arrays and settings of a statistics file; UserError naming it if it is missing, damaged or altered."""
    path = Path(path)
    fix = "rerun `diffrelay fid-ref` to rebuild it"
    if not path.is_file():
        raise UserError(f"{path}: reference statistics not found; {fix}")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in (*ARRAYS, "digest")}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as e:
        raise UserError(f"{path}: unreadable reference statistics ({type(e).__name__}: {e}); {fix}") from e
    if str(arrays.pop("digest")) != _digest(arrays):
        raise UserError(f"{path}: digest mismatch: the statistics were altered or damaged after writing; {fix}")
    ref = {k: arrays[k] for k in ("mu", "sigma", "features")}
    ref["settings"] = json.loads(str(arrays["settings"]))
    if ref["settings"].get("format") != FORMAT:
        raise UserError(f"{path}: format={ref['settings'].get('format')}: not {FORMAT}; {fix}")
    from diffrelay.evaluation import metrics

    metrics.check_statistics(ref["mu"], ref["sigma"], path, fix)
    return ref


def extractor_sha256(path) -> str:
    if not Path(path).is_file():
        raise UserError(f"{path}: extractor file not found; run `diffrelay fetch-extractor --out {path}`")
    return io.sha256_file(path)


def check_ref(ref: dict, path, extractor_sha256: str, mode: str) -> None:
    """The statistics must come from the same extractor file and mode as the images about to be scored."""
    s = ref["settings"]
    if s["extractor_sha256"] != extractor_sha256:
        raise UserError(f"{path}: extractor_sha256={s['extractor_sha256'][:12]}... ({s['extractor']}): made with "
                        f"another extractor than this one ({extractor_sha256[:12]}...); rerun fid-ref with it")
    if s["mode"] != mode:
        raise UserError(f"{path}: mode={s['mode']}: scoring asked for mode={mode}; use --mode {s['mode']} "
                        "or rerun fid-ref with this mode")


# ---------------------------------------------------------------------------- diffrelay fid-ref

def make_ref(dataset, extractor_path, out, *, mode="clean", num=0, batch_size=64, cache_dir=None,
             workers=1, device="auto") -> Path:
    """Reference statistics of a prepared dataset's images.npy, computed once per (fingerprint, extractor, mode,
    count) in cache_dir; equal to clean-fid's statistics of the same images saved as PNG files."""
    from diffrelay.data import datasets
    from diffrelay.evaluation import extractor

    dataset, out = Path(dataset), Path(out)
    prepared = datasets.open_prepared(dataset)
    held_out = datasets.open_val(dataset) if prepared.captions is not None else None
    if held_out is not None:  # a text run's FID is against its held-out images (the validation FID), never trained on
        log.info(f"{dataset}: a captioned dataset with a held-out split; reference statistics of its {held_out.count} "
                 "held-out images (val/)")
        dataset, prepared = dataset / "val", dataclasses.replace(held_out, fingerprint=held_out.fingerprint + "/val")
        if num > prepared.count:  # fid.ref_images counts the whole dataset's; the split holds what it holds
            log.info(f"--num={num}: all {prepared.count} held-out images instead")
            num = 0
    if prepared.images is None:
        raise UserError(f"{dataset}: a latent dataset made with data.keep_images false holds no images to take "
                        "reference statistics of; give fid.reference (statistics made elsewhere), or prepare it "
                        "again with data.keep_images true")
    fingerprint, count = prepared.fingerprint, prepared.count
    if count < 2:
        raise UserError(f"{dataset}: {count} images; reference statistics need at least 2")
    if num > count:
        raise UserError(f"--num={num}: {dataset} has only {count} images; use at most that or 0 (all)")
    index = np.arange(count)
    if num:
        # A seeded subset, not the first `num`: a dataset stored class by class would bias the reference.
        index = np.sort(np.random.default_rng(0).choice(count, num, replace=False))
    sha = extractor_sha256(extractor_path)
    device = _device(device)

    cached = None
    if cache_dir:
        # The device type is part of the key: GPU and CPU features of the same images differ in rounding.
        cached = Path(cache_dir) / f"{fingerprint[:16]}-{sha[:16]}-{mode}-{device.type}-{len(index)}.npz"
        if cached.is_file():
            try:
                check_ref(load_ref(cached), cached, sha, mode)
            except UserError as e:
                log.warning(f"ignoring cached statistics: {e}; recomputing")
            else:
                _copy(cached, out)
                log.info(f"{out}: reused cached statistics {cached}")
                return out

    t0 = time.time()
    ext = extractor.load(extractor_path, mode, device, sha256=sha)
    views = [features.view_of(ext, mode)]
    [feats] = features.features(features.array_images(prepared.images, index, views), [ext], mode, batch_size,
                                device, workers)
    mu, sigma = statistics(feats)
    if refsize.singular(len(index), feats.shape[1]):  # scores.md says it too (each score's num_ref, feature_dim)
        log.warning(f"{dataset}: {refsize.note(len(index), int(feats.shape[1]), ext.label)}")
    if len(feats) > MAX_FEATURES:
        feats = feats[np.sort(np.random.default_rng(0).choice(len(feats), MAX_FEATURES, replace=False))]
    settings = {"format": FORMAT, "mode": mode, "metric": ext.label, "extractor": ext.path.name,
                "extractor_sha256": sha, "dataset": str(dataset), "fingerprint": fingerprint,
                "num_images": len(index), "num_features": len(feats), "feature_dim": int(feats.shape[1])}
    save_ref(out, mu, sigma, feats, settings)
    if cached:
        try:
            _copy(out, cached)
        except (OSError, UserError) as e:  # the cache only saves time: the statistics are written, so keep them
            log.warning(f"statistics not cached ({e}); {out} is written")
    log.info(f"{out}: statistics of {len(index)} images ({feats.shape[1]} features, {ext.label}) "
             f"in {time.time() - t0:.1f}s")
    return out


def _copy(src: Path, dst: Path) -> None:
    with io.atomic_write(dst) as f, open(src, "rb") as s:
        shutil.copyfileobj(s, f, 1 << 20)


def is_statistics_file(path) -> bool:
    """A statistics file of `diffrelay fid-ref` (intact or not: a damaged one of ours may be rebuilt)."""
    try:
        with zipfile.ZipFile(path) as z:
            return {"digest.npy", "settings.npy"} <= set(z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def main_fid_ref(args) -> int:
    logs.setup()
    io.check_file_target(args.out, is_statistics_file, "reference statistics written by `diffrelay fid-ref`")
    import torch

    torch.set_num_threads(args.threads)
    make_ref(args.dataset, args.extractor, args.out, mode=args.mode, num=args.num, batch_size=args.batch_size,
             cache_dir=args.cache_dir, workers=args.threads, device=args.device)
    return 0


# ---------------------------------------------------------------------------- diffrelay fid

def run_clean(cmd, timeout_s: float) -> subprocess.CompletedProcess:
    """Run `cmd` without any process-group variables, stdout/stderr passed through; killed after timeout_s,
    or when this process is killed or told to stop."""
    import signal

    cmd = [str(c) for c in cmd]
    # No stdin: a child waiting for input would only ever end at the timeout.
    child = subprocess.Popen(cmd, env=distributed.clean_env(), stdin=subprocess.DEVNULL,
                             preexec_fn=parallel.die_with_parent)

    def stop(signum, frame):
        child.kill()
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return subprocess.CompletedProcess(cmd, child.wait(timeout=timeout_s))
    except subprocess.TimeoutExpired as e:
        child.kill()
        child.wait()
        raise UserError(f"{' '.join([Path(cmd[0]).name, *cmd[1:4]])}: timed out after {timeout_s / 60:g} minutes "
                        "and was killed; raise --timeout-minutes (fid.timeout_minutes) or score fewer images") from e
    except BaseException:  # Ctrl-C, or the handler above
        child.kill()
        child.wait()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def score(images, ref_path, extractor_path, mode="clean", batch_size=64, workers=1, device="auto") -> dict:
    """FD/KID of an image folder against reference statistics with one extractor (see score_all)."""
    return score_all(images, [(extractor_path, ref_path)], mode, batch_size, workers, device)


def score_all(images, pairs, mode="clean", batch_size=64, workers=1, device="auto", metrics=None,
              cache_dir=None) -> dict:
    """Scores of an image folder with each (extractor, reference statistics) pair, in this process; each
    image is decoded once for all of them. Returns the result record: its "scores" hold one entry per
    pair, and its top-level metric, fid, kid ... repeat the first (the primary score). `metrics` (fid.metrics,
    scores.py) picks the metrics; None keeps the set of results made before it existed."""
    from diffrelay.evaluation import extractor, scores
    from diffrelay.evaluation import metrics as more

    started = time.time()
    wanted = None if metrics is None else set(metrics)
    files = features.image_files(images)  # cheap checks first: images, statistics, extractor hashes, then models
    checked = []
    for ext_path, ref_path in pairs:
        sha = extractor_sha256(ext_path)
        if wanted is not None and scores.is_adm(ref_path):
            ref = scores.adm_reference(ref_path, files, wanted)
        else:
            ref = load_reference(ref_path)
            check_reference(ref, ref_path, sha, mode)
        checked.append((ext_path, ref_path, ref, sha))
    exts, device = [], _device(device)
    heads = wanted is not None and bool(wanted & {"sfid", "is"})
    for ext_path, ref_path, ref, sha in checked:
        # Heads for the first Inception only: sFID and IS are one metric each, not one per file.
        ext = extractor.load(ext_path, mode, device, sha256=sha, heads=heads and not any(e.heads for e in exts))
        if scores.is_adm(ref_path):  # with fid.metrics or without: its mu/sigma are Inception's
            scores.check_adm_extractor(ext, ref_path)
        if ref["settings"].get("foreign") and not ref["settings"].get("adm"):  # checked before the costly pass
            more.load_foreign_ref(ref_path, want_dim=extractor.check(ext))
        if wanted is not None:
            scores.check(ext, ref, ref_path, wanted)
        exts.append(ext)
    if heads and not any(e.heads for e in exts):
        raise UserError(f"--metrics={','.join(sorted(wanted))}: sfid and is need clean-fid's Inception among the "
                        "extractors (fid.extractors: [inception, ...]); add it or drop them from fid.metrics")
    for ext, (_, ref_path, ref, _) in zip(exts, checked):
        if ref["settings"].get("adm"):
            scores.reference_features(ref, ref_path, ext, mode, batch_size, device, workers, cache_dir)
    feats = features.of_files(files, exts, mode, batch_size, device, workers)
    labels = [e.label for e in exts]
    # Two extractors of one kind (two random seeds, two files of one name) would give one metric name twice.
    labels = [f"{lab} [{e.path.name}]" if labels.count(lab) > 1 else lab for lab, e in zip(labels, exts)]
    if wanted is None:
        records = [_distances_record(images, ext, label, f, ref, ref_path) for ext, label, f, (_, ref_path, ref, _)
                   in zip(exts, labels, feats, checked)]
    else:
        records = [scores.record(ext, label, f, ref, ref_path, wanted, device)
                   for ext, label, f, (_, ref_path, ref, _) in zip(exts, labels, feats, checked)]
    finished = time.time()
    return {**records[0], "num_images": len(files), "mode": mode, "seconds": round(finished - started, 3),
            "images": str(images), "started": started, "finished": finished, "scores": records,
            **({} if wanted is None else {"metrics": sorted(wanted)})}


def _distances_record(images, ext, label, feats, ref, ref_path) -> dict:
    from diffrelay.evaluation import metrics

    if len(feats) <= feats.shape[1]:
        log.warning(f"{images}: {len(feats)} images for {feats.shape[1]} features: the covariance is rank-deficient, "
                    f"so {label} is biased upward; compare only scores with equal image counts")
    fd, kid = distances(feats, ref)
    extra = {}
    if ref["features"] is None:
        from diffrelay.evaluation import scores

        extra["note"] = (f"{Path(ref_path).name}: an ADM batch scored by its mu and sigma only (fid.metrics is unset): "
                         "no KID, precision or recall; set fid.metrics to use its other arrays" if scores.is_adm(ref_path) else
                         f"{Path(ref_path).name} holds mu and sigma only: no KID, precision or recall")
    elif min(len(feats), len(ref["features"])) > metrics.PR_NEIGHBOURS:
        extra["precision"], extra["recall"] = metrics.precision_recall(ref["features"], feats)
    return {"metric": metrics.metric_name(label, len(feats)), "fid": fd, "kid": kid, **extra,
            "num_ref": ref["settings"]["num_images"], "feature_dim": int(feats.shape[1]),  # scores.md: refsize.py
            "reference": Path(ref_path).name, "ref": str(ref_path), "extractor": str(ext.path),
            "extractor_sha256": ext.sha256}


def _pairs(args) -> list[tuple[str, str]]:
    if len(args.extractor) != len(args.ref):
        raise UserError(f"--extractor given {len(args.extractor)} times, --ref {len(args.ref)} times; give one "
                        "--ref (the statistics made with it) after each --extractor")
    return list(zip(args.extractor, args.ref))


RESULT_KEYS = ("scores", "num_images", "mode", "images")


def main_fid(args) -> int:
    from diffrelay.evaluation import adherence, scores

    logs.setup()
    io.check_file_target(args.out, lambda p: io.is_json_object(p, RESULT_KEYS), "a result written by `diffrelay fid`")
    pairs = _pairs(args)
    if not args.in_process:
        # Cheap checks here too, so a bad path fails before a child process is paid for.
        files = features.image_files(args.images)
        for ext_path, ref_path in pairs:
            if args.metrics is not None and scores.is_adm(ref_path):
                scores.adm_reference(ref_path, files, set(args.metrics))
            else:
                check_reference(load_reference(ref_path), ref_path, extractor_sha256(ext_path), args.mode)
        adherence.check(args)  # CLIP score, PickScore, class accuracy: their models and every image's prompt
        # The child writes a private file that this process publishes only if the child succeeded in time:
        # a scorer outliving a failed job can never leave a result behind.
        with tempfile.TemporaryDirectory(prefix="diffrelay-fid-") as tmp:
            private = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "diffrelay", "fid", "--images", args.images,
                   *[a for e, r in pairs for a in ("--extractor", e, "--ref", r)],
                   "--mode", args.mode, "--batch-size", args.batch_size,
                   "--threads", args.threads, "--timeout-minutes", args.timeout_minutes, "--out", private,
                   "--device", args.device, "--in-process",
                   *(["--metrics", ",".join(args.metrics)] if args.metrics is not None else []),
                   *(["--cache-dir", args.cache_dir] if args.cache_dir else []),
                   *adherence.flags(args)]
            code = run_clean(cmd, args.timeout_minutes * 60).returncode
            if code == 0:
                io.write_bytes(args.out, private.read_bytes())
                log.info(f"wrote {args.out}")
        return code
    import torch

    torch.set_num_threads(args.threads)
    # --threads: the extractors' torch threads and as many threads decoding and resizing images ahead of them.
    result = score_all(args.images, pairs, args.mode, args.batch_size, workers=args.threads, device=args.device,
                       metrics=args.metrics, cache_dir=args.cache_dir)
    adherence.score(args, _device(args.device), result)
    io.write_json(args.out, result)
    for r in result["scores"]:
        kid = "n/a" if r["kid"] is None else f"{r['kid']:.5f}"
        values = (", ".join(f"{name} {r[k]:.4f}" for k, name in r["labels"].items()) if "labels" in r
                  else f"{r['metric']} {r['fid']:.4f}, KID {kid}")
        log.info(f"{args.images}: {values} ({result['num_images']} images vs {r['num_ref']} in {r['reference']})")
    log.info(f"scored in {result['seconds']:.1f}s")
    return 0
