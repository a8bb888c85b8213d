"""Paired bootstrap confidence intervals for differences between two systems scored on the
same items (questions, windows).

Every difference a results table reports comes from two systems scored on the same items, so
the items are resampled *jointly* (a paired bootstrap: Efron & Tibshirani 1993, §16.3); the
interval is the percentile interval of the resampled differences. The statistic is a ratio of
sums, ``Σ a_i / Σ w_i − Σ b_i / Σ w_i``, which covers both per-item means (``w = 1``) and
corpus-level rates such as log-likelihood per byte (``w`` = bytes; bits per byte is
``−rate / ln 2``). scipy.stats.bootstrap does the resampling.

Items that share a source (windows of one article, questions of one paragraph's article) are
not independent: with ``clusters=`` the bootstrap resamples whole clusters (the cluster, or
block, bootstrap: Davison & Hinkley 1997, §3.8). Since the statistic is a ratio of sums, that
is the same bootstrap over the clusters' totals.
"""

from __future__ import annotations

import math

import numpy as np


def paired_bootstrap(a, b, weights=None, *, confidence: float = 0.95, resamples: int = 10_000,
                     seed: int = 0, scale: float = 1.0, clusters=None) -> dict:
    """The difference ``scale · (Σ a − Σ b) / Σ w`` and its paired-bootstrap interval.

    Args:
      a, b: ``[N]`` per-item totals of two systems on the same N items (e.g. log-likelihoods).
      weights: ``[N]`` per-item denominators (default 1: the difference of means).
      confidence: the interval's coverage.
      resamples: bootstrap resamples; ``seed`` makes them reproducible.
      scale: a constant the statistic is multiplied by (``−1/ln 2`` turns nats per byte into
        bits per byte).
      clusters: ``[N]`` labels (article ids): resample whole clusters instead of items.

    Returns:
      ``{"difference", "low", "high", "confidence", "items", "resamples"}`` (and
      ``"clusters"``, their count, when given); ``low == high`` when every item gives the
      same difference.
    """
    from scipy.stats import bootstrap

    a_N = np.asarray(a, np.float64)
    b_N = np.asarray(b, np.float64)
    w_N = np.ones_like(a_N) if weights is None else np.asarray(weights, np.float64)
    if a_N.ndim != 1 or a_N.shape != b_N.shape or a_N.shape != w_N.shape:
        raise ValueError(f"paired_bootstrap needs three [N] arrays of one length, got "
                         f"{a_N.shape}, {b_N.shape}, {w_N.shape}")
    if len(a_N) < 2:
        raise ValueError(f"a bootstrap interval needs at least 2 items, got {len(a_N)}")
    if not (np.all(np.isfinite(a_N)) and np.all(np.isfinite(b_N))):
        raise ValueError("paired_bootstrap: non-finite values among the per-item scores")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    items = len(a_N)
    if clusters is not None:
        labels = np.asarray(clusters)
        if labels.shape != a_N.shape:
            raise ValueError(f"clusters must label each of the {len(a_N)} items, got "
                             f"{labels.shape}")
        _, group = np.unique(labels, return_inverse=True)
        if group.max() < 1:
            raise ValueError("a cluster bootstrap needs at least 2 clusters, got 1")
        a_N, b_N, w_N = (np.bincount(group, x) for x in (a_N, b_N, w_N))

    def statistic(x, y, w, axis=-1):
        return scale * (np.sum(x, axis) - np.sum(y, axis)) / np.sum(w, axis)

    point = float(statistic(a_N, b_N, w_N))
    rate_N = (a_N - b_N) / w_N
    if np.allclose(rate_N, rate_N[0], rtol=0, atol=1e-12):
        low = high = point  # every resample gives the same value (Σ c·w / Σ w = c)
    else:
        res = bootstrap((a_N, b_N, w_N), statistic, paired=True, vectorized=True,
                        n_resamples=resamples, confidence_level=confidence,
                        method="percentile", random_state=np.random.default_rng(seed))
        low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    out = {"difference": point, "low": low, "high": high, "confidence": confidence,
           "items": int(items), "resamples": resamples}
    if clusters is not None:
        out["clusters"] = int(len(a_N))
    return out


def bpb_difference(loglik_a, loglik_b, num_bytes, **kw) -> dict:
    """Bits per byte of system a minus system b over the same windows, with its interval."""
    return paired_bootstrap(loglik_a, loglik_b, num_bytes, scale=-1.0 / math.log(2.0), **kw)


def format_interval(d: dict, digits: int = 3) -> str:
    """``+0.012 [−0.004, +0.027]``: a difference with its interval, as tables print it."""
    f = f"{{:+.{digits}f}}"
    return f"{f.format(d['difference'])} [{f.format(d['low'])}, {f.format(d['high'])}]"
