"""FID/KID with clean-fid: reference statistics of a dataset, and scores of image folders in a clean subprocess.

Examples:
  diffrelay fid-ref --dataset results/demo/dataset --extractor resources/extractors/random-seed0.pt \\
      --cache-dir resources/fid-ref --out results/demo/fid/reference.npz
  diffrelay fid --images results/demo/samples/step_0000400 --ref results/demo/fid/reference.npz \\
      --extractor resources/extractors/random-seed0.pt --out results/demo/metrics/fid/step_0000400.json

`diffrelay fid` re-runs itself with --in-process as a fresh child through `run_clean`, whose environment
has no torchrun variables: scoring can never join, or wait for, a training process group.
"""

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
import zipfile
from pathlib import Path

import numpy as np

from diffrelay import distributed, io, logs
from diffrelay.errors import UserError

FORMAT = "diffrelay-fid-ref/1"
# KID draws subsets of at most 1000 rows (clean-fid's max_subset_size), so 10k reference rows are plenty,
# and they bound the file: 10k x 2048 float32 = 80 MB for Inception.
MAX_FEATURES = 10_000
# clean-fid's image extensions; only numbered files (000000.png) count, so a sample folder's grid.png is skipped.
NUMBERED = re.compile(r"^\d+\.(bmp|jpg|jpeg|pgm|png|ppm|tif|tiff|webp)$", re.IGNORECASE)
ARRAYS = ("mu", "sigma", "features", "settings")
log = logs.get()


# ---------------------------------------------------------------------------- images and features

def image_files(folder) -> list[Path]:
    """The numbered images of a folder (000000.png ...), sorted; at least 2 or UserError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder}: image folder not found")
    files = sorted(p for p in folder.iterdir() if NUMBERED.match(p.name) and p.is_file())
    if len(files) < 2:
        raise UserError(f"{folder}: {len(files)} numbered images (000000.png ...); FID/KID need at least 2")
    return files


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def features(files, ext, mode: str, batch_size: int, device) -> np.ndarray:
    """(N, D) float32 features of image files through clean-fid's resize + batching pipeline."""
    from cleanfid.fid import get_files_features

    # get_files_features is get_folder_features minus its recursive glob (we choose the files).
    # num_workers=0: worker processes are a hang risk inside schedulers and buy nothing at this size.
    return get_files_features([str(f) for f in files], model=ext.fn, num_workers=0, batch_size=batch_size,
                              device=device, mode=mode, verbose=False)


def features_or_name_bad_file(files, ext, mode: str, batch_size: int, device) -> np.ndarray:
    """features(), but an image that cannot be decoded is named in one line instead of a deep traceback."""
    try:
        return features(files, ext, mode, batch_size, device)
    except (OSError, SyntaxError, ValueError) as e:  # PIL's ways of saying "truncated or not an image"
        from PIL import Image

        for f in files:
            try:
                with Image.open(f) as im:
                    im.load()
            except (OSError, SyntaxError, ValueError) as bad:
                raise UserError(f"{f}: damaged or not an image ({bad}); remake the folder "
                                "(`diffrelay sample` remakes damaged files) and score again") from e
        raise


def statistics(feats: np.ndarray):
    """mu, sigma exactly as clean-fid computes them."""
    return np.mean(feats, axis=0), np.cov(feats, rowvar=False)


def distances(feats, ref: dict) -> tuple[float, float]:
    """(FD, KID) of features against reference statistics, with clean-fid's formulas."""
    mu, sigma = statistics(feats)
    if ref["features"] is None:  # statistics made elsewhere: mu and sigma only, so no KID
        return _frechet(mu, sigma, ref), None
    return _frechet(mu, sigma, ref), _kid(feats, ref)


def _frechet(mu, sigma, ref) -> float:
    from cleanfid.fid import frechet_distance
    from scipy.linalg import LinAlgWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # clean-fid passes scipy's deprecated `disp`
        # Too few images for the feature count make sigma singular; `score` logs that once, in plain words.
        warnings.simplefilter("ignore", LinAlgWarning)
        return float(frechet_distance(mu, sigma, ref["mu"], ref["sigma"]))


def _kid(feats, ref) -> float:
    from cleanfid.fid import kernel_distance

    # kernel_distance draws subsets from numpy's global generator: seed it, then put the caller's state back.
    state = np.random.get_state()
    np.random.seed(0)
    try:
        return kernel_distance(ref["features"], feats)
    finally:
        np.random.set_state(state)


def load_reference(path) -> dict:
    """Statistics from `diffrelay fid-ref` (verified by its digest), or a file made elsewhere
    (EDM/ADM/clean-fid `.npz` with mu and sigma; settings["foreign"] is then true)."""
    from diffrelay import metrics

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

def make_ref(dataset, extractor_path, out, *, mode="clean", num=0, batch_size=64, cache_dir=None) -> Path:
    """Reference statistics of <dataset>/png, computed once per (fingerprint, extractor, mode, count) in cache_dir."""
    from diffrelay import extractor

    dataset, out = Path(dataset), Path(out)
    info = io.read_json(dataset / "dataset.json")
    fingerprint = info.get("fingerprint")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise UserError(f"{dataset / 'dataset.json'}: fingerprint={fingerprint!r}: missing; rerun `diffrelay prepare`")
    files = image_files(dataset / "png")
    if num > len(files):
        raise UserError(f"--num={num}: {dataset / 'png'} has only {len(files)} images; use at most that or 0 (all)")
    if num:
        # A seeded subset, not the first `num`: a dataset stored class by class would bias the reference.
        keep = np.sort(np.random.default_rng(0).choice(len(files), num, replace=False))
        files = [files[i] for i in keep]
    sha = extractor_sha256(extractor_path)

    cached = None
    if cache_dir:
        cached = Path(cache_dir) / f"{fingerprint[:16]}-{sha[:16]}-{mode}-{len(files)}.npz"
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
    ext = extractor.load(extractor_path, mode, _device(), sha256=sha)
    feats = features_or_name_bad_file(files, ext, mode, batch_size, _device())
    mu, sigma = statistics(feats)
    if len(files) <= feats.shape[1]:
        log.warning(f"{dataset}: {len(files)} reference images for {feats.shape[1]} features: sigma is singular; "
                    "use more images than features")
    if len(feats) > MAX_FEATURES:
        feats = feats[np.sort(np.random.default_rng(0).choice(len(feats), MAX_FEATURES, replace=False))]
    settings = {"format": FORMAT, "mode": mode, "metric": ext.label, "extractor": ext.path.name,
                "extractor_sha256": sha, "dataset": str(dataset), "fingerprint": fingerprint,
                "num_images": len(files), "num_features": len(feats), "feature_dim": int(feats.shape[1])}
    save_ref(out, mu, sigma, feats, settings)
    if cached:
        _copy(out, cached)
    log.info(f"{out}: statistics of {len(files)} images ({feats.shape[1]} features, {ext.label}) "
             f"in {time.time() - t0:.1f}s")
    return out


def _copy(src: Path, dst: Path) -> None:
    with io.atomic_write(dst) as f, open(src, "rb") as s:
        shutil.copyfileobj(s, f, 1 << 20)


def main_fid_ref(args) -> int:
    logs.setup()
    import torch

    torch.set_num_threads(args.threads)
    make_ref(args.dataset, args.extractor, args.out, mode=args.mode, num=args.num, batch_size=args.batch_size,
             cache_dir=args.cache_dir)
    return 0


# ---------------------------------------------------------------------------- diffrelay fid

def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGKILL when the parent dies (Linux prctl), so a
    killed `diffrelay fid` leaves no scorer running on without its timeout."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the parent's own handler below still ends the child on SIGTERM


def run_clean(cmd, timeout_s: float) -> subprocess.CompletedProcess:
    """Run `cmd` without any process-group variables, stdout/stderr passed through; killed after timeout_s,
    or when this process is killed or told to stop."""
    import signal

    cmd = [str(c) for c in cmd]
    # No stdin: a child waiting for input would only ever end at the timeout.
    child = subprocess.Popen(cmd, env=distributed.clean_env(), stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)

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


def score(images, ref_path, extractor_path, mode="clean", batch_size=64) -> dict:
    """FD/KID of an image folder against reference statistics, in this process. Returns the result record."""
    from diffrelay import extractor

    started = time.time()
    from diffrelay import metrics

    files = image_files(images)  # cheap checks first: images, statistics, extractor hash, then the model
    ref = load_reference(ref_path)
    sha = extractor_sha256(extractor_path)
    check_reference(ref, ref_path, sha, mode)
    ext = extractor.load(extractor_path, mode, _device(), sha256=sha)
    if ref["settings"].get("foreign"):  # the feature count must match, checked before the costly pass
        metrics.load_foreign_ref(ref_path, want_dim=extractor.check(ext))
    feats = features_or_name_bad_file(files, ext, mode, batch_size, _device())
    if len(files) <= feats.shape[1]:
        log.warning(f"{images}: {len(files)} images for {feats.shape[1]} features: the covariance is rank-deficient, "
                    f"so {ext.label} is biased upward; compare only scores with equal image counts")
    fd, kid = distances(feats, ref)
    extra = {}
    if ref["features"] is None:
        extra["note"] = f"{Path(ref_path).name} holds mu and sigma only: no KID, precision or recall"
    elif min(len(feats), len(ref["features"])) > metrics.PR_NEIGHBOURS:
        extra["precision"], extra["recall"] = metrics.precision_recall(ref["features"], feats)
    finished = time.time()
    return {"metric": metrics.metric_name(ext.label, len(files)), "fid": fd, "kid": kid, **extra,
            "num_images": len(files), "num_ref": ref["settings"]["num_images"], "reference": Path(ref_path).name,
            "extractor": str(extractor_path), "extractor_sha256": sha, "mode": mode,
            "seconds": round(finished - started, 3), "images": str(images), "ref": str(ref_path),
            "started": started, "finished": finished}


def main_fid(args) -> int:
    logs.setup()
    if not args.in_process:
        # Cheap checks here too, so a bad path fails before a child process is paid for.
        image_files(args.images)
        check_reference(load_reference(args.ref), args.ref, extractor_sha256(args.extractor), args.mode)
        # The child writes a private file that this process publishes only if the child succeeded in time:
        # a scorer outliving a failed job can never leave a result behind.
        with tempfile.TemporaryDirectory(prefix="diffrelay-fid-") as tmp:
            private = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "diffrelay", "fid", "--images", args.images, "--ref", args.ref,
                   "--extractor", args.extractor, "--mode", args.mode, "--batch-size", args.batch_size,
                   "--threads", args.threads, "--timeout-minutes", args.timeout_minutes, "--out", private,
                   "--in-process"]
            code = run_clean(cmd, args.timeout_minutes * 60).returncode
            if code == 0:
                io.write_bytes(args.out, private.read_bytes())
                log.info(f"wrote {args.out}")
        return code
    import torch

    torch.set_num_threads(args.threads)
    result = score(args.images, args.ref, args.extractor, args.mode, args.batch_size)
    io.write_json(args.out, result)
    kid = "n/a" if result["kid"] is None else f"{result['kid']:.5f}"
    log.info(f"{args.images}: {result['metric']} {result['fid']:.4f}, KID {kid} "
             f"({result['num_images']} images vs {result['num_ref']}, {result['seconds']:.1f}s)")
    return 0
