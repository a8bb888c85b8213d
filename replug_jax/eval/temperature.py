"""The retrieval temperature τ of REPLUG's weights ``λ = softmax(s(d, x) / τ)`` (paper §3.2)
as a research axis: every (example, document) branch is scored by the LM once, its per-token
log-probabilities kept, and the ensemble for any weighting evaluated from them.

The mixture is per token (Eq. §3.2 applied to every target token with fixed weights), so the
scored branches (:class:`~replug_jax.branches.ScoredBranches`) hold ``[N, K, T]`` log-probs, not
per-branch totals. :func:`fit_tau` is the one τ fitter (a grid, or a bounded 1-D search over
log τ) of any log-likelihood of τ: a file's (:func:`fit_temperature`), a pool's
(``train/pool.py``), a study's windows; weights other than a temperature: ``"uniform"``
(λ = 1/K) and ``"top1"`` (all weight on the best-scored document).
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import numpy as np

from replug_jax.branches import SCHEMES, ScoredBranches, mixture_logliks, subset  # noqa: F401


def fit_tau(loglik_at: Callable[[float], float], *, grid: Sequence[float] | None = None,
            bounds: tuple[float, float] = (1e-3, 10.0), tol: float = 1e-4) -> dict:
    """The τ of ``λ = softmax(s(d, x) / τ)`` (§3.2) that maximises ``loglik_at(τ)``, the
    log-likelihood (a total or a mean) REPLUG scores with that τ: the one τ fitter of the
    codebase (files, pools, windows). Over ``grid`` when given (a registered study's fixed
    list; the first maximum wins), else by a bounded search over log τ (Brent's method in
    scipy). Returns ``{"temperature", "loglik", "at_bound"}`` and the ``grid`` or ``bounds``
    searched; a maximum at a bound or at an end of the grid is reported as such (the optimum
    may lie outside)."""
    if grid is not None:
        grid = [float(t) for t in grid]
        if not grid or any(not t > 0 for t in grid):
            raise ValueError(f"a τ grid needs positive values, got {grid}")
        values = [float(loglik_at(t)) for t in grid]
        best = int(np.argmax(values))
        return {"temperature": grid[best], "loglik": values[best], "grid": grid,
                "at_bound": len(grid) > 1 and grid[best] in (min(grid), max(grid))}
    from scipy.optimize import minimize_scalar

    lo, hi = bounds
    if not 0 < lo < hi:
        raise ValueError(f"bounds must satisfy 0 < low < high, got {bounds}")
    res = minimize_scalar(lambda log_tau: -float(loglik_at(math.exp(log_tau))),
                          bounds=(math.log(lo), math.log(hi)), method="bounded",
                          options={"xatol": tol})
    tau, best = float(math.exp(res.x)), -float(res.fun)
    # A maximum at (or flat towards) a bound: the optimum may lie beyond it.
    at_bound = False
    for edge in bounds:
        value = float(loglik_at(edge))
        if value >= best - 1e-6 * max(1.0, abs(best)):
            at_bound = True
            if value > best:
                tau, best = float(edge), value
    return {"temperature": tau, "loglik": best, "bounds": list(bounds), "at_bound": at_bound}


def fit_temperature(cache: ScoredBranches, bounds: tuple[float, float] = (1e-3, 10.0),
                    tol: float = 1e-4, grid: Sequence[float] | None = None) -> dict:
    """:func:`fit_tau` of a file's cached branches: the τ maximising their total
    log-likelihood (the mixture of §3.2, per token), over ``grid`` or ``bounds``."""
    return fit_tau(lambda tau: float(mixture_logliks(cache, tau).sum()), grid=grid,
                   bounds=bounds, tol=tol)


def cross_fit_logliks(cache: ScoredBranches, folds: int = 2, seed: int = 0,
                      bounds: tuple[float, float] = (1e-3, 10.0), *,
                      grid: Sequence[float] | None = None, groups=None
                      ) -> tuple[np.ndarray, list]:
    """``[N]`` log-likelihoods where each example is scored at the τ fitted (over ``grid``,
    else ``bounds``) on the *other* folds (an honest estimate of a fitted τ on unseen
    examples), and the per-fold τ. Folds are of examples, or with ``groups`` (``[N]`` labels,
    such as articles) of whole groups: the groups shuffled and dealt to the folds in turn."""
    units = len(cache) if groups is None else len(np.unique(groups))
    if units < folds:
        raise ValueError(f"{units} {'examples' if groups is None else 'groups'} cannot make "
                         f"{folds} folds")
    rng = np.random.default_rng(seed)
    if groups is None:
        fold_N = rng.permutation(len(cache)) % folds
    else:
        fold_of = dict(zip(rng.permutation(np.unique(groups)), itertools.cycle(range(folds))))
        fold_N = np.array([fold_of[g] for g in groups])
    out = np.zeros(len(cache), np.float64)
    taus = []
    for f in range(folds):
        fit = fit_temperature(subset(cache, np.flatnonzero(fold_N != f)), bounds, grid=grid)
        taus.append(fit["temperature"])
        held = np.flatnonzero(fold_N == f)
        out[held] = mixture_logliks(subset(cache, held), fit["temperature"])
    return out, taus
