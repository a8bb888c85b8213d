"""The retrieval temperature τ of REPLUG's weights ``λ = softmax(s(d, x) / τ)`` (paper §3.2)
as a research axis: every (example, document) branch is scored by the LM once, its per-token
log-probabilities cached, and the ensemble for any weighting evaluated from the cache.

The mixture is per token (Eq. §3.2 applied to every target token with fixed weights), so the
cache (:class:`~replug_jax.branches.BranchCache`) holds ``[N, K, T]`` branch log-probs, not
per-branch totals. :func:`fit_temperature`
maximises the total log-likelihood over log τ (a bounded 1-D search); weights other than a
temperature: ``"uniform"`` (λ = 1/K) and ``"top1"`` (all weight on the best-scored document).
"""

from __future__ import annotations

import math

import numpy as np

from replug_jax.branches import SCHEMES, BranchCache, mixture_logliks, subset  # noqa: F401


def fit_temperature(cache: BranchCache, bounds: tuple[float, float] = (1e-3, 10.0),
                    tol: float = 1e-4) -> dict:
    """τ maximising the total cached log-likelihood, by a bounded search over log τ (Brent's
    method in scipy). Returns ``{"temperature", "loglik", "bounds", "at_bound"}``; a maximum
    at a bound is reported as such (the optimum may lie outside)."""
    from scipy.optimize import minimize_scalar

    lo, hi = bounds
    if not 0 < lo < hi:
        raise ValueError(f"bounds must satisfy 0 < low < high, got {bounds}")
    res = minimize_scalar(lambda log_tau: -float(mixture_logliks(cache, math.exp(log_tau)).sum()),
                          bounds=(math.log(lo), math.log(hi)), method="bounded",
                          options={"xatol": tol})
    tau, best = float(math.exp(res.x)), -float(res.fun)
    # A maximum at (or flat towards) a bound: the optimum may lie beyond it.
    at_bound = False
    for edge in bounds:
        value = float(mixture_logliks(cache, edge).sum())
        if value >= best - 1e-6 * max(1.0, abs(best)):
            at_bound = True
            if value > best:
                tau, best = float(edge), value
    return {"temperature": tau, "loglik": best, "bounds": list(bounds), "at_bound": at_bound}


def cross_fit_logliks(cache: BranchCache, folds: int = 2, seed: int = 0,
                      bounds: tuple[float, float] = (1e-3, 10.0)) -> tuple[np.ndarray, list]:
    """``[N]`` log-likelihoods where each example is scored at the τ fitted on the *other*
    folds (an honest estimate of a fitted τ on unseen examples), and the per-fold τ."""
    n = len(cache)
    if n < folds:
        raise ValueError(f"{n} examples cannot make {folds} folds")
    fold_N = np.random.default_rng(seed).permutation(n) % folds
    out = np.zeros(n, np.float64)
    taus = []
    for f in range(folds):
        fit = fit_temperature(subset(cache, np.flatnonzero(fold_N != f)), bounds)
        taus.append(fit["temperature"])
        held = np.flatnonzero(fold_N == f)
        out[held] = mixture_logliks(subset(cache, held), fit["temperature"])
    return out, taus
