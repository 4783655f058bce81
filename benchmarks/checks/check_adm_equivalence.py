"""diffrelay.evaluation.adm against the official ADM evaluator's own NumPy code, on the same random features.

  python benchmarks/checks/check_adm_equivalence.py --guided-diffusion /tmp/off/guided-diffusion \\
      [--out benchmarks/results/adm_equivalence.json]

--guided-diffusion is a checkout of github.com/openai/guided-diffusion. Its evaluations/evaluator.py imports
TensorFlow at the top, which is not installed here: the script reads that file's source and executes it as a
module with a stub `tensorflow` (and `tensorflow.compat.v1`) in sys.modules, enough for the import and nothing
more. Nothing of it enters the package. Then, on seeded random data (float64 unless said):
  statistics     Evaluator.compute_statistics (called unbound: it uses no state) against adm.statistics
  fid_*          FIDStatistics(mu, sigma).frechet_distance(other), the official code unchanged, against
                 adm.frechet_distance: pool-sized (2048) and spatial-sized (2023) features, fewer rows than
                 dimensions, and a tiny rank-1 case whose sqrtm is NaN so the eps shift path runs
  is_*           Evaluator.compute_inception_score on an object made with object.__new__ (no __init__, so no
                 TF graph); its session stub returns the fed rows unchanged, i.e. the softmax graph is replaced
                 by identity and both sides get the same float32 softmax probabilities; splits of 5000 with a
                 short last split
  pr_*           Evaluator.compute_prec_recall with the official ManifoldEstimator (batching, radii via
                 _numpy_partition, evaluate_pr) over a SUBSTITUTED DistanceBlock: its two methods are restated
                 here in NumPy from the TF graph in evaluator.py (float16 features, |u|^2 - 2 u.v + |v|^2 floored
                 at 0, float32 again for a block with a non-finite value); this part is not the official code,
                 and TF's own float16 rounding is not reproduced bit for bit by anyone's NumPy
Writes benchmarks/results/adm_equivalence.json. Not a test: CI has no guided-diffusion checkout.
"""

import argparse
import hashlib
import os
import sys
import time
import types
import warnings
from pathlib import Path

import numpy as np
import scipy
from official import RESULTS

from diffrelay import io
from diffrelay.evaluation import adm


def load_evaluator(checkout: Path):
    """evaluator.py executed as a module, with a stub tensorflow that only has to survive the import lines."""
    path = checkout / "evaluations" / "evaluator.py"
    tf = types.ModuleType("tensorflow")
    tf.compat = types.ModuleType("tensorflow.compat")
    tf.compat.v1 = types.ModuleType("tensorflow.compat.v1")
    saved = {k: sys.modules.get(k) for k in ("tensorflow", "tensorflow.compat", "tensorflow.compat.v1")}
    sys.modules.update({"tensorflow": tf, "tensorflow.compat": tf.compat, "tensorflow.compat.v1": tf.compat.v1})
    try:
        module = types.ModuleType("adm_evaluator")
        module.__file__ = str(path)
        exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module, hashlib.sha256(path.read_bytes()).hexdigest()


class NumpyDistanceBlock:
    """SUBSTITUTE for evaluator.py's DistanceBlock (a TF graph): the same two methods, restated in NumPy.
    float16 is modelled with NumPy's float16 arithmetic; the reduction and the matmul accumulate in float32
    and round once, as the GPU kernels do."""

    def __init__(self, session, half=True):
        self.half = half

    @staticmethod
    def _graph(U, V):  # _batch_pairwise_distances, in U's dtype
        acc = np.float32
        norm_u = np.square(U).sum(1, dtype=acc).astype(U.dtype).reshape(-1, 1)
        norm_v = np.square(V).sum(1, dtype=acc).astype(V.dtype).reshape(1, -1)
        prod = (U.astype(acc) @ V.astype(acc).T).astype(U.dtype)
        return np.maximum(norm_u - 2 * prod + norm_v, U.dtype.type(0))

    def pairwise_distances(self, U, V):
        U, V = np.asarray(U, np.float32), np.asarray(V, np.float32)  # the float32 placeholders
        if self.half:
            with np.errstate(over="ignore", invalid="ignore"):
                d16 = self._graph(U.astype(np.float16), V.astype(np.float16))
            if np.isfinite(d16).all():  # the tf.cond on reduce_all(is_finite)
                return d16.astype(np.float32)
        return self._graph(U, V)

    def less_thans(self, batch_1, radii_1, batch_2, radii_2):
        dist32 = self.pairwise_distances(batch_1, batch_2)[..., None]
        return np.any(dist32 <= radii_2, axis=1), np.any(dist32 <= radii_1[:, None], axis=0)


def overflowing(real, fake, rows, cols, mode) -> str:
    """How many of evaluate_pr's blocks hold a non-finite float16 distance (so run in float32)."""
    if mode != "float16":
        return "n/a"
    bad = total = 0
    for r0 in range(0, len(real), rows):
        for c0 in range(0, len(fake), cols):
            with np.errstate(over="ignore", invalid="ignore"):
                u, v = real[r0:r0 + rows].astype(np.float16), fake[c0:c0 + cols].astype(np.float16)
                d = NumpyDistanceBlock._graph(u, v)
            bad, total = bad + int(not np.isfinite(d).all()), total + 1
    return f"{bad}/{total}"


def diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def fid_cases(ev, rng) -> dict:
    out = {}
    shapes = {"pool_4000x2048": (4000, 2048), "spatial_4000x2023": (4000, 2023), "few_rows_500x2048": (500, 2048)}
    for name, (n, d) in shapes.items():
        mix = rng.standard_normal((d, d)) / np.sqrt(d)
        a = np.abs(rng.standard_normal((n, d)) @ mix).astype(np.float32)  # correlated, non-negative like pool_3
        b = np.abs(rng.standard_normal((n, d)) @ mix * 1.1 + 0.05).astype(np.float32)
        theirs_a, theirs_b = ev.Evaluator.compute_statistics(None, a), ev.Evaluator.compute_statistics(None, b)
        mu_a, sigma_a = adm.statistics(a)
        mu_b, sigma_b = adm.statistics(b)
        stats_diff = max(diff(mu_a, theirs_a.mu), diff(sigma_a, theirs_a.sigma), diff(mu_b, theirs_b.mu),
                         diff(sigma_b, theirs_b.sigma))
        theirs = float(theirs_a.frechet_distance(theirs_b))
        ours = adm.frechet_distance(mu_a, sigma_a, mu_b, sigma_b)
        out[name] = {"ours": ours, "theirs": theirs, "abs_diff": abs(ours - theirs),
                     "statistics_max_abs_diff": stats_diff, "mu_dtype": str(mu_a.dtype)}
    # Rank-1 covariances of 2 x 4 small-integer features: scipy's sqrtm of their product is NaN.
    a = np.array([[1, 2, 0, 0], [0, 1, 1, 0]], np.float64)
    b = np.array([[1, 0, 2, 2], [1, 1, 0, 0]], np.float64)
    sa, sb = ev.Evaluator.compute_statistics(None, a), ev.Evaluator.compute_statistics(None, b)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        theirs = float(sa.frechet_distance(sb))
        ours = adm.frechet_distance(sa.mu, sa.sigma, sb.mu, sb.sigma)
    shifted = [str(w.message) for w in seen if "diagonal" in str(w.message)]
    out["eps_shift_2x4"] = {"ours": ours, "theirs": theirs, "abs_diff": abs(ours - theirs),
                            "shift_warnings": len(shifted)}
    return out


def is_cases(ev, rng) -> dict:
    class Identity:  # the session stub: "softmax" of the fed rows is the rows themselves
        def run(self, fetch, feed_dict):
            return next(iter(feed_dict.values()))

    obj = object.__new__(ev.Evaluator)
    obj.sess, obj.softmax, obj.softmax_input, obj.softmax_batch_size = Identity(), None, None, 512
    out = {}
    for name, n, dtype in (("float32_12345x1008", 12345, np.float32), ("float64_7001x1008", 7001, np.float64)):
        logits = (rng.standard_normal((n, 1008)) * 3).astype(dtype)
        e = np.exp(logits - logits.max(1, keepdims=True))
        probs = (e / e.sum(1, keepdims=True)).astype(dtype)
        theirs = ev.Evaluator.compute_inception_score(obj, probs)
        ours = adm.inception_score(probs)
        out[name] = {"ours": ours, "theirs": theirs, "abs_diff": abs(ours - theirs), "splits": -(-n // 5000)}
    return out


def clouds(rng, n_real, n_fake, d, latent):
    """Points near a `latent`-dimensional plane in d dimensions, the fake ones shifted and spread wider: precision
    and recall are then neither 0 nor 1 (independent Gaussian clouds in 2048 dimensions give exactly 0 and 1)."""
    mix = rng.standard_normal((latent, d)) / np.sqrt(latent)
    real = rng.standard_normal((n_real, latent)) @ mix + 0.05 * rng.standard_normal((n_real, d)) + 0.5
    fake = (rng.standard_normal((n_fake, latent)) * 1.2 + 0.3) @ mix + 0.05 * rng.standard_normal((n_fake, d)) + 0.5
    return real.astype(np.float32), fake.astype(np.float32)


def pr_cases(ev, rng) -> dict:
    out = {}
    cases = (("n3000x2500_d2048_batch10000", 3000, 2500, 2048, 10000, 10000),
             ("n3000x2500_d2048_batch700x900", 3000, 2500, 2048, 700, 900),
             ("n600x500_d64_overflow_batch128x200", 600, 500, 64, 128, 200))
    for name, n_real, n_fake, d, rows, cols in cases:
        real, fake = clouds(rng, n_real, n_fake, d, 16 if d > 64 else 8)
        if "overflow" in name:  # rows beyond float16's range (|u|^2 > 65504): their blocks fall back to float32
            real[:5] *= 40
        for mode in ("float16", "float32"):
            ev.DistanceBlock = lambda session, half=(mode == "float16"): NumpyDistanceBlock(session, half)
            est = ev.ManifoldEstimator(None, row_batch_size=rows, col_batch_size=cols)
            evaluator = object.__new__(ev.Evaluator)
            evaluator.manifold_estimator = est
            start = time.perf_counter()
            theirs = evaluator.compute_prec_recall(real, fake)
            t_theirs = time.perf_counter() - start
            theirs_radii = est.manifold_radii(real)[:, 0]
            start = time.perf_counter()
            ours = adm.precision_recall(real, fake, 3, rows, cols, mode)
            t_ours = time.perf_counter() - start
            ours_radii = adm.manifold_radii(real, 3, rows, cols, mode)
            out[f"{name}_{mode}"] = {"float16_blocks_overflowing": overflowing(real, fake, rows, cols, mode),
                "ours": list(ours), "theirs": list(theirs), "precision_abs_diff": abs(ours[0] - theirs[0]),
                "recall_abs_diff": abs(ours[1] - theirs[1]), "radii_max_abs_diff": diff(ours_radii, theirs_radii),
                "radii_range": [float(theirs_radii.min()), float(theirs_radii.max())],
                "seconds_ours": round(t_ours, 2), "seconds_theirs": round(t_theirs, 2)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--guided-diffusion", type=Path, required=True)
    ap.add_argument("--out", type=Path, default=RESULTS / "adm_equivalence.json")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message=".*disp.*", category=DeprecationWarning)  # the evaluator's disp=False
    warnings.filterwarnings("ignore", category=scipy.linalg.LinAlgWarning)
    ev, sha = load_evaluator(args.guided_diffusion)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    fid, inception, pr = fid_cases(ev, rng), is_cases(ev, rng), pr_cases(ev, rng)
    seconds = time.perf_counter() - start

    print(f"{'case':44s} {'ours':>22s} {'theirs':>22s} {'|diff|':>10s}")
    for name, r in {**fid, **inception}.items():
        print(f"{name:44s} {r['ours']:22.15g} {r['theirs']:22.15g} {r['abs_diff']:10.3g}")
    for name, r in pr.items():
        print(f"{name:44s} {str(np.round(r['ours'], 6).tolist()):>22s} {str(np.round(r['theirs'], 6).tolist()):>22s} "
              f"{max(r['precision_abs_diff'], r['recall_abs_diff']):10.3g}  radii {r['radii_max_abs_diff']:.3g}")
    print(f"statistics max |diff|: {max(r['statistics_max_abs_diff'] for k, r in fid.items() if 'eps' not in k):.3g}; "
          f"eps-shift warnings: {fid['eps_shift_2x4']['shift_warnings']} (both sides); {seconds:.1f} s")
    worst = {"fid": max(r["abs_diff"] for r in fid.values()),
             "fid_relative": max(r["abs_diff"] / abs(r["theirs"]) for r in fid.values()),
             "statistics": max(r.get("statistics_max_abs_diff", 0.0) for r in fid.values()),
             "inception_score": max(r["abs_diff"] for r in inception.values()),
             "precision_recall": max(max(r["precision_abs_diff"], r["recall_abs_diff"]) for r in pr.values()),
             "radii": max(r["radii_max_abs_diff"] for r in pr.values())}
    print("max abs differences:", worst)
    io.write_json(args.out, {
        "what": "diffrelay.evaluation.adm against guided-diffusion evaluations/evaluator.py (exec'd with a stub "
                "tensorflow; DistanceBlock substituted by a NumPy restatement of its TF graph)",
        "evaluator_sha256": sha, "numpy": np.__version__, "scipy": scipy.__version__, "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%d"), "max_abs_diff": worst, "fid": fid, "inception_score": inception,
        "precision_recall": pr, "seconds": round(seconds, 1)})
    print(f"wrote {args.out}")
    if worst["precision_recall"] != 0 or worst["fid_relative"] > 1e-9 or worst["inception_score"] > 1e-9:
        sys.exit("not equal: see the table")


if __name__ == "__main__":
    main()
