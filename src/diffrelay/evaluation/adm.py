"""The arithmetic of OpenAI's ADM evaluator (guided-diffusion evaluations/evaluator.py) without TensorFlow.

The evaluator scores a sample batch against a reference batch (e.g. VIRTUAL_imagenet256_labeled.npz) with
Inception-V3 features: FID on the 2048 pool_3 features, sFID on the first 7 channels of mixed_6/conv
(17 x 17 x 7 = 2023 values), the Inception Score on the softmax of the pool features, and precision/recall
with a k-nearest-neighbour manifold estimate on the pool features. This module is everything after the
network: statistics, the Frechet distance with the evaluator's sqrtm fallback (frechet.py), the split Inception Score,
the manifold radii and precision/recall with the evaluator's batching, and the reference `.npz` reader. All of it
is NumPy except precision/recall's distance blocks, which run in torch on the scoring device.
Formulas follow the evaluator; the code is our own. Every problem with an input is one line of UserError.
"""

import hashlib
import struct
import zipfile
from pathlib import Path

import numpy as np

from diffrelay.errors import UserError
from diffrelay.evaluation.frechet import IMAG_TOLERANCE, frechet_distance  # noqa: F401 (the evaluator's)

POOL_DIM = 2048  # pool_3:0
SPATIAL_DIM = 2023  # mixed_6/conv:0 sliced to [..., :7]: 17 x 17 x 7 for 299 x 299 inputs
FLOAT16_MAX = 65504.0
STAT_KEYS = ("mu", "sigma", "mu_s", "sigma_s")


# ---------------------------------------------------------------------------- FID and sFID

def statistics(features) -> tuple[np.ndarray, np.ndarray]:
    """(mu, sigma) of N x D features as Evaluator.compute_statistics makes them: mean over rows (in the
    features' dtype) and np.cov with rowvar=False (float64)."""
    x = np.asarray(features)
    if x.ndim != 2 or len(x) < 2:
        raise UserError(f"statistics: features of shape {x.shape}; give an N x D array with N >= 2 rows")
    return np.mean(x, axis=0), np.cov(x, rowvar=False)


# ---------------------------------------------------------------------------- Inception Score

def inception_score(probs, split_size: int = 5000) -> float:
    """Evaluator.compute_inception_score from class probabilities (N x C softmax rows, not logits).

    The evaluator's probabilities are float32 softmax(pool_3 @ W), W the weight of the graph's
    softmax/logits/MatMul (its bias is not added), 1008 classes; the arithmetic here keeps the dtype given.
    Rows are cut into consecutive splits of `split_size` (the last one may be shorter and counts like the
    others); a split scores exp(mean over its rows of KL(p(y|x) || p(y))), p(y) the split's mean row; the
    result is the plain mean of the split scores (no weighting by split length, no std)."""
    p = np.asarray(probs)
    if p.ndim != 2 or len(p) == 0 or not np.issubdtype(p.dtype, np.floating):
        raise UserError(f"inception_score: probabilities of shape {p.shape} and dtype {p.dtype}; give an N x C "
                        "float array of softmax rows")
    if split_size < 1:
        raise UserError(f"inception_score: split_size {split_size}; give a positive number of rows")
    if not (np.isfinite(p).all() and (p > 0).all()):
        # 0 * log(0) makes the evaluator's score NaN
        raise UserError("inception_score: probabilities must be finite and > 0 (the evaluator's score would be "
                        "NaN); give softmax outputs, not logits or rounded values")
    scores = []
    for start in range(0, len(p), split_size):
        part = p[start:start + split_size]
        marginal = np.expand_dims(np.mean(part, 0), 0)
        kl = part * (np.log(part) - np.log(marginal))
        scores.append(np.exp(np.mean(np.sum(kl, 1))))
    return float(np.mean(scores))


# ---------------------------------------------------------------------------- precision and recall

def _half(x: np.ndarray) -> np.ndarray:
    """Round float32 values to float16 and back (overflow -> inf), as a float16 TF tensor holds them."""
    with np.errstate(over="ignore"):
        return x.astype(np.float16).astype(np.float32)


def _squared_distances(u: np.ndarray, v: np.ndarray, half: bool) -> np.ndarray:
    """max(|u|^2 - 2 u.v + |v|^2, 0) for all row pairs (_batch_pairwise_distances). With half=True, a model of
    the evaluator's float16 graph: inputs and every op's output rounded to float16, the sums and the matmul
    accumulated in float32 (as GPU kernels do) before their one rounding."""
    r = _half if half else (lambda a: a)
    if half:
        u, v = r(u), r(v)
    norm_u = r(np.sum(r(u * u), axis=1))[:, None]
    norm_v = r(np.sum(r(v * v), axis=1))[None, :]
    with np.errstate(invalid="ignore"):  # inf - inf in an overflowing float16 block: caught by the caller
        d = r(r(norm_u - r(2 * r(u @ v.T))) + norm_v)
    return np.maximum(d, np.float32(0))


def pairwise_distances(u, v, distances: str = "float16") -> np.ndarray:
    """Squared distances of one block as DistanceBlock.pairwise_distances gives them (float32): the evaluator
    casts the features to float16, computes there, and only when some value is not finite computes the whole
    block again in float32. distances="float32" skips the float16 attempt. This is the NumPy statement of a block;
    precision/recall run the same arithmetic in torch (_block), and the tests hold one to the other."""
    # v is copied: numpy computes x @ x.T (a diagonal block) with syrk, rounding unlike every other block's gemm
    u, v = np.asarray(u, np.float32), np.array(v, np.float32)
    if distances not in ("float16", "float32"):
        raise UserError(f"distances={distances!r}; use 'float16' (the evaluator's) or 'float32'")
    if distances == "float16":
        d = _squared_distances(u, v, half=True)
        if np.isfinite(d).all():
            return d
    return _squared_distances(u, v, half=False)


def _torch_distances(u, v, half: bool):
    """_squared_distances on torch tensors, op for op (the same roundings, the same order of operations)."""
    import torch

    def r(a):  # in place where it can be: a 10k x 10k block is 400 MB, and a GPU holds Inception beside it
        return a.copy_(a.half()) if half else a

    if half:
        u, v = u.half().float(), v.half().float()
    norm_u = r(r(u * u).sum(1))[:, None]
    norm_v = r(r(v * v).sum(1))[None, :]
    d = r(torch.mm(u, v.T)).mul_(2)
    d = r(r(r(d).neg_().add_(norm_u)).add_(norm_v))  # -(2 u.v) + |u|^2 is |u|^2 - 2 u.v exactly
    return d.clamp_(min=0)  # NaN (inf - inf) stays NaN, as in np.maximum: the caller falls back to float32


def _block(u, v, distances: str):
    """pairwise_distances of one block in torch, on u's device: DistanceBlock's float16 attempt and its float32
    retry for a block with any non-finite value (one host read per block)."""
    import torch

    if distances == "float16":
        d = _torch_distances(u, v, half=True)
        # Values are float16's (<= 65504), +inf or NaN, so their sum is finite exactly when all are: one
        # reduction instead of a boolean block.
        if bool(torch.isfinite(d.sum())):
            return d
    return _torch_distances(u, v, half=False)


class _StrictFloat32:
    """fp32 matmuls in IEEE float32 on CUDA while the blocks run: TF32 (train.tf32) keeps 10 mantissa bits, as
    coarse as the float16 mode, and would make the float32 mode a different metric."""

    def __enter__(self):
        import torch

        self.saved = torch.backends.cuda.matmul.fp32_precision
        torch.backends.cuda.matmul.fp32_precision = "ieee"

    def __exit__(self, *exc):
        import torch

        torch.backends.cuda.matmul.fp32_precision = self.saved


def _on(device, a: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).to(torch.device(device))


def _features(x, name: str, k: int) -> np.ndarray:
    a = np.asarray(x, np.float32)  # the evaluator feeds float32 placeholders
    if a.ndim != 2 or len(a) < k + 1 or not np.isfinite(a).all():
        raise UserError(f"precision/recall: {name} features of shape {a.shape}; give a finite N x D array with "
                        f"more than k = {k} rows")
    return a


def _check_batches(k: int, row_batch_size: int, col_batch_size: int, distances: str = "float16") -> None:
    if k < 1 or row_batch_size < 1 or col_batch_size < 1:
        raise UserError(f"precision/recall: k={k}, row_batch_size={row_batch_size}, col_batch_size="
                        f"{col_batch_size}; all must be positive")
    if distances not in ("float16", "float32"):
        raise UserError(f"distances={distances!r}; use 'float16' (the evaluator's) or 'float32'")


# The blocks below run in torch on `device` (the scoring job's; default CPU): 31 blocks of 10k x 10k x 2048 for
# 50k samples were minutes of single-threaded NumPy. Each block's arithmetic is pairwise_distances', op for op;
# only the float32 sums inside the matmul and the row norms may be ordered differently from NumPy's BLAS, so a
# distance can differ by a float32 rounding step (a float16 one in the float16 mode, where such a step crosses a
# float16 rounding boundary), as two BLAS libraries differ. test_adm.py holds the bounds.

def manifold_radii(features, k: int = 3, row_batch_size: int = 10000, col_batch_size: int = 10000,
                   distances: str = "float16", device="cpu") -> np.ndarray:
    """Squared distance of each row to its k-th nearest other row (float32, N), as ManifoldEstimator.manifold_radii
    with nhood_sizes=(k,) and no clamp_to_percentile (the evaluator's defaults: k=3, None).

    The evaluator partitions each full row of distances at k (so the self-distance, normally 0, is the 0th and
    k is the k-th neighbour) with distances computed in (row_batch_size x col_batch_size) blocks. Here the same
    blocks are computed, and only the k+1 smallest values of each row are carried from block to block, so memory
    is row_batch_size x (col_batch_size + k + 1) instead of the evaluator's row_batch_size x N."""
    import torch

    _check_batches(k, row_batch_size, col_batch_size, distances)
    x = _on(device, _features(features, "the", k))
    n = len(x)
    radii = torch.empty(n, dtype=torch.float32, device=x.device)
    with _StrictFloat32():
        for r0 in range(0, n, row_batch_size):
            rows, best = x[r0:r0 + row_batch_size], None
            for c0 in range(0, n, col_batch_size):
                d = _block(rows, x[c0:c0 + col_batch_size], distances)
                merged = d if best is None else torch.cat([best, d], 1)
                # the k+1 smallest as a multiset, like np.partition's first k+1 columns: ties are kept
                best = merged.topk(k + 1, 1, largest=False).values if merged.shape[1] > k + 1 else merged
            radii[r0:r0 + len(rows)] = best.kthvalue(k + 1, 1).values  # 1-based: index k of the sorted row
    return radii.cpu().numpy()


def in_manifolds(real, real_radii, fake, fake_radii, row_batch_size: int = 10000, col_batch_size: int = 10000,
                 distances: str = "float16", device="cpu") -> tuple[np.ndarray, np.ndarray]:
    """(fake_in_real, real_in_fake) booleans, as ManifoldEstimator.evaluate_pr: blocks of real rows (row_batch_size)
    against fake rows (col_batch_size); a point lies in the other set's manifold when its squared distance to some
    point there is <= that point's radius (ties count as inside)."""
    import torch

    _check_batches(1, row_batch_size, col_batch_size, distances)
    real, fake = _features(real, "real", 0), _features(fake, "fake", 0)
    real_radii, fake_radii = np.asarray(real_radii, np.float32), np.asarray(fake_radii, np.float32)
    if real_radii.shape != (len(real),) or fake_radii.shape != (len(fake),):
        raise UserError(f"precision/recall: radii of shapes {real_radii.shape} and {fake_radii.shape} for "
                        f"{len(real)} real and {len(fake)} fake rows; give one radius per row (manifold_radii)")
    real, fake, real_radii, fake_radii = (_on(device, a) for a in (real, fake, real_radii, fake_radii))
    real_in = torch.zeros(len(real), dtype=torch.bool, device=real.device)
    fake_in = torch.zeros(len(fake), dtype=torch.bool, device=real.device)
    with _StrictFloat32():
        for r0 in range(0, len(real), row_batch_size):
            for c0 in range(0, len(fake), col_batch_size):
                d = _block(real[r0:r0 + row_batch_size], fake[c0:c0 + col_batch_size], distances)
                real_in[r0:r0 + len(d)] |= (d <= fake_radii[None, c0:c0 + d.shape[1]]).any(1)
                fake_in[c0:c0 + d.shape[1]] |= (d <= real_radii[r0:r0 + len(d), None]).any(0)
    return fake_in.cpu().numpy(), real_in.cpu().numpy()


def precision_recall(real, fake, k: int = 3, row_batch_size: int = 10000, col_batch_size: int = 10000,
                     distances: str = "float16", device="cpu") -> tuple[float, float]:
    """(precision, recall) as Evaluator.compute_prec_recall(real, fake): precision is the fraction of fake rows
    inside the real manifold, recall the fraction of real rows inside the fake manifold (k-NN radii of each set).
    The evaluator's distances are float16 on the GPU (float32 for a block that overflows); `distances`="float16"
    models that, "float32" computes every block in float32. The blocks run in torch on `device`."""
    _check_batches(k, row_batch_size, col_batch_size, distances)
    r, f = _features(real, "real", k), _features(fake, "fake", k)
    if r.shape[1] != f.shape[1]:
        raise UserError(f"precision/recall: real features have {r.shape[1]} values and fake {f.shape[1]}; "
                        "use the same extractor for both")
    radii = [manifold_radii(x, k, row_batch_size, col_batch_size, distances, device) for x in (r, f)]
    fake_in, real_in = in_manifolds(r, radii[0], f, radii[1], row_batch_size, col_batch_size, distances, device)
    return float(np.mean(fake_in)), float(np.mean(real_in))


# ---------------------------------------------------------------------------- reference batches

def _check_images(path: Path, shape, dtype) -> None:
    if dtype != np.uint8 or len(shape) != 4 or shape[-1] != 3:
        raise UserError(f"{path}: arr_0 is {dtype} of shape {tuple(shape)}; an ADM reference batch holds uint8 images "
                        "(N, H, W, 3): save the images as one uint8 array in [0, 255], channels last")


def read_reference(path, images: bool = False) -> dict:
    """The arrays of an ADM reference batch `.npz` that are present, checked: mu (D,) / sigma (D, D) (pool_3,
    D = 2048), mu_s / sigma_s (spatial, 2023), and arr_0 (uint8 N x H x W x 3 images; loaded only with
    images=True, always checked from its header). Every member's header is checked before any array is loaded
    (npz.headers); never unpickles. "images_shape" holds arr_0's shape (or None), "members" the headers."""
    from diffrelay.evaluation import metrics, npz

    path = Path(path)
    fix = "give an ADM reference batch .npz (e.g. VIRTUAL_imagenet256_labeled.npz)"
    if not path.is_file():
        raise UserError(f"{path}: ADM reference batch not found; check the path or {fix}")
    members = npz.headers(path, fix)
    if "arr_0" in members:
        _check_images(path, members["arr_0"].shape, members["arr_0"].dtype)
    keys = [k for k in STAT_KEYS if k in members] + (["arr_0"] if images and "arr_0" in members else [])
    npz.check_memory(path, "/".join(keys), sum(members[k].nbytes for k in keys),
                     "give it to a job with more memory" + (" or store arr_0 uncompressed (np.savez: it is then "
                                                            "memory-mapped)" if "arr_0" in keys else ""))
    out = {"images_shape": members["arr_0"].shape if "arr_0" in members else None, "members": members}
    try:
        with np.load(path, allow_pickle=False) as z:
            for key in keys:
                out[key] = z[key]
    except (OSError, ValueError, EOFError, KeyError, MemoryError, zipfile.BadZipFile) as e:
        raise UserError(f"{path}: not a readable .npz ({type(e).__name__}: {e}); {fix}") from e
    for mu, sigma in (("mu", "sigma"), ("mu_s", "sigma_s")):
        if (mu in out) != (sigma in out):
            raise UserError(f"{path}: {mu if mu in out else sigma} without {sigma if mu in out else mu}; {fix}")
        if mu in out:
            m, s = out[mu], out[sigma]
            if not (np.issubdtype(m.dtype, np.floating) and np.issubdtype(s.dtype, np.floating)):
                raise UserError(f"{path}: {mu} is {m.dtype} and {sigma} {s.dtype}; both must be float arrays")
            if m.ndim != 1 or s.shape != (len(m), len(m)):
                raise UserError(f"{path}: {mu} of shape {m.shape} and {sigma} of shape {s.shape}; expected (D,) "
                                "and (D, D)")
            # The check of a plain statistics file too: finite, sigma symmetric and positive semi-definite.
            metrics.check_statistics(m, s, path, fix, (mu, sigma))
    if out["images_shape"] is None and "mu" not in out:
        raise UserError(f"{path}: neither arr_0 nor mu/sigma (found {', '.join(sorted(members)) or 'nothing'}); {fix}")
    return out


def images(path) -> np.ndarray:
    """arr_0 of a checked reference batch, memory-mapped where the .npz stores it uncompressed (np.savez, DiT's
    and diffrelay's sample export), so a 10k x 512 x 512 batch costs no memory; a compressed one is read whole."""
    path = Path(path)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("arr_0.npy")
    if info.compress_type == zipfile.ZIP_STORED:
        with open(path, "rb") as f:
            f.seek(info.header_offset)
            local = f.read(30)  # the local file header: its name and extra field lengths end it
            f.seek(info.header_offset + 30 + sum(struct.unpack("<HH", local[26:30])))
            version = np.lib.format.read_magic(f)
            if version in ((1, 0), (2, 0)):
                read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, fortran, dtype = read(f)
                if not fortran and dtype == np.uint8:
                    offset, want = f.tell(), int(np.prod(shape))
                    held = info.header_offset + 30 + sum(struct.unpack("<HH", local[26:30])) + info.file_size - offset
                    if want > held:  # np.memmap would read past the member, or fail naming neither file nor fix
                        raise UserError(f"{path}: arr_0's header declares {tuple(shape)} ({want} bytes) but the "
                                        f"archive holds {max(held, 0)} bytes of it; the file is damaged: copy or "
                                        "download the reference batch again")
                    try:
                        return np.memmap(path, np.uint8, "r", offset=offset, shape=shape)
                    except (OSError, MemoryError) as e:  # ulimit -v counts a mapping's address space too
                        raise UserError(f"{path}: arr_0 ({tuple(shape)}) cannot be memory-mapped ({e}); give the "
                                        "job more (virtual) memory or score against fewer reference images") from e
    return read_reference(path, images=True)["arr_0"]


def fingerprint(path) -> str:
    """A content key of an .npz without reading its arrays: the file's size and its zip directory, whose entries
    carry each member's CRC-32 over all of its bytes. Hashing a 10k x 512 x 512 batch (8 GB) at every scoring
    job would cost more than the scores; any rewrite by np.savez changes a CRC or a size."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:
            entries = sorted((i.filename, i.CRC, i.file_size, i.compress_size, i.header_offset) for i in z.infolist())
    except (OSError, zipfile.BadZipFile) as e:
        raise UserError(f"{path}: not a readable .npz ({type(e).__name__}: {e}); give an ADM reference batch") from e
    return hashlib.sha256(repr((path.stat().st_size, entries)).encode()).hexdigest()


def require(ref: dict, names, path, why: str) -> None:
    """One line of UserError when the reference `ref` (read_reference) lacks any of `names`; `why` says which
    metric needs them and what to do, e.g. "sfid needs them: use a reference that has them
    (VIRTUAL_imagenet256_labeled.npz does) or drop sfid from fid.metrics"."""
    missing = [n for n in names if (ref.get("images_shape") is None if n == "arr_0" else n not in ref)]
    if missing:
        raise UserError(f"{path}: an ADM reference batch without {'/'.join(missing)}; {why}")
