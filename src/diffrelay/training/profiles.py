"""The math of edm2's power-function EMA profiles (Karras et al. 2024): widths, exponents, inner products,
the least-squares reconstruction and its error. numpy only, so config validation can use it at parse time.
"""

import numpy as np

MAX_SIGMA_REL = 12 ** -0.5  # gamma = 0, a plain average of all weights so far; wider has gamma < 0
# A reconstruction whose profile is further than this from the asked one (relative L2 distance) is refused:
# it would be labelled with a width it does not have. With edm2's pair (0.05, 0.10) stored 20 times a run,
# widths of about 0.03 to 0.2 stay below 2 %, while 0.01 is 30 % off and 0.28 18 %; with few stored files the
# usable range narrows (3 files: 0.08 is 4 % off, 0.15 15 %).
MAX_ERROR = 0.15


def gamma_to_sigma(gamma: float) -> float:
    """sigma_rel of the profile tau^gamma: its variance over t^2 is (g+1) / ((g+2)^2 (g+3))."""
    g = float(gamma)
    return float(np.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3))))


def sigma_to_gamma(sigma_rel: float) -> float:
    """The exponent with gamma_to_sigma(gamma) == sigma_rel, gamma > 0 (0 < sigma_rel < MAX_SIGMA_REL).

    s^2 (g+2)^2 (g+3) = g+1 is a cubic in g; of its real roots the largest is the one on the branch where
    a larger gamma means a narrower profile."""
    s = float(sigma_rel)
    if not 0 < s < MAX_SIGMA_REL:
        raise ValueError(f"sigma_rel={s}: must be between 0 and {MAX_SIGMA_REL:.4f}")
    inv = s ** -2
    roots = np.roots([1.0, 7.0, 16.0 - inv, 12.0 - inv])
    return float(max(r.real for r in roots if abs(r.imag) < 1e-9 * max(1.0, abs(r))))


def beta(gamma: float, t: int) -> float:
    """Weight kept by the running average at its t-th update (t = 1, 2, ...): the first update copies the
    weights, and (1 - 1/t)^(gamma + 1) keeps the sum of tau^gamma weights in proportion."""
    return (1.0 - 1.0 / t) ** (gamma + 1.0)


def profile(t: float, gamma: float, tau) -> np.ndarray:
    """p(tau) of the EMA at time t (its density over the training time tau)."""
    tau = np.asarray(tau, dtype=np.float64)
    inside = (tau > 0) & (tau <= t)
    return np.where(inside, (gamma + 1) * np.clip(tau, 0, None) ** gamma / float(t) ** (gamma + 1), 0.0)


def inner(t_a, gamma_a, t_b, gamma_b) -> np.ndarray:
    """Integral of p_a(tau) p_b(tau) for profiles ending at t_a and t_b (broadcasts).

    With t_lo <= t_hi the product lives on (0, t_lo]; integrating tau^(ga+gb) there gives
    (ga+1)(gb+1) / (ga+gb+1) * t_lo^(g_hi) / t_hi^(g_hi+1), g_hi the exponent of the later profile."""
    t_a, g_a, t_b, g_b = (np.asarray(x, dtype=np.float64) for x in (t_a, gamma_a, t_b, gamma_b))
    a_first = t_a <= t_b
    t_lo, t_hi = np.where(a_first, t_a, t_b), np.where(a_first, t_b, t_a)
    g_hi = np.where(a_first, g_b, g_a)
    return (g_a + 1) * (g_b + 1) / (g_a + g_b + 1) * (t_lo / t_hi) ** g_hi / t_hi


def solve(steps, gammas, out_step: int, out_gamma: float) -> np.ndarray:
    """Coefficients x (one per stored average) with sum_i x_i p_i closest to the target profile in L2.

    The normal equations of that least-squares problem are A x = b, A_ij = <p_i, p_j>, b_i = <p_i, p_out>;
    the result is scaled to sum to 1, so the combined weights stay an average."""
    steps, gammas = np.asarray(steps, dtype=np.float64), np.asarray(gammas, dtype=np.float64)
    a = inner(steps[:, None], gammas[:, None], steps[None, :], gammas[None, :])
    b = inner(steps, gammas, float(out_step), float(out_gamma))
    x = np.linalg.lstsq(a, b, rcond=None)[0]
    return x / x.sum()


def error(steps, gammas, out_step: int, out_gamma: float, x) -> float:
    """Relative L2 distance between sum_i x_i p_i and the target profile: ||sum x_i p_i - p|| / ||p||."""
    steps, gammas, x = (np.asarray(v, dtype=np.float64) for v in (steps, gammas, x))
    a = inner(steps[:, None], gammas[:, None], steps[None, :], gammas[None, :])
    b = inner(steps, gammas, float(out_step), float(out_gamma))
    c = float(inner(float(out_step), float(out_gamma), float(out_step), float(out_gamma)))
    return float(np.sqrt(max(0.0, x @ a @ x - 2 * x @ b + c) / c))


def stored_error(steps, sigma_rels, out_step: int, sigma_rel: float) -> float:
    """The reconstruction error of width sigma_rel at out_step from profiles sigma_rels stored at `steps`."""
    flat = [(t, sigma_to_gamma(s)) for t in steps for s in sigma_rels]
    g = sigma_to_gamma(sigma_rel)
    x = solve([f[0] for f in flat], [f[1] for f in flat], out_step, g)
    return error([f[0] for f in flat], [f[1] for f in flat], out_step, g, x)


def check_config(t: dict, s: dict) -> list[tuple[str, str]]:
    """Rules of train.phema and sample.phema (called by config.validate): (key, message) pairs."""
    every, want = t["phema"]["every"], f"sample.phema={s['phema']}"
    if every and t["segment_steps"] % every:
        return [(f"train.phema.every={every}",
                 f"does not divide train.segment_steps={t['segment_steps']}; use a divisor of it or 0")]
    if s["phema"] and not every:
        return [(want, f"needs the stored EMA profiles; set train.phema.every (e.g. {t['segment_steps']}) "
                 "or sample.phema: []")]
    if s["phema"] and s["weights"] != "ema":
        return [(want, "reconstructions are EMA weights; set sample.weights: ema or sample.phema: []")]
    if not s["phema"]:
        return []
    # The files training will store: every `every` steps and at the run's end; the widths are rebuilt there.
    total = t["total_steps"]
    steps = sorted(set(range(every, total + 1, every)) | {total})
    for width in s["phema"]:
        if not 0 < width < MAX_SIGMA_REL:
            return [(f"sample.phema={width}", f"not a width between 0 and {MAX_SIGMA_REL:.4f}")]
        err = stored_error(steps, t["phema"]["profiles"], total, width)
        if err > MAX_ERROR:
            return [(f"sample.phema={width}", f"the stored profiles {t['phema']['profiles']} rebuild this width "
                     f"{err:.0%} off (more than {MAX_ERROR:.0%}); choose a width nearer them, or store "
                     "profiles closer to it in train.phema.profiles")]
    return []
