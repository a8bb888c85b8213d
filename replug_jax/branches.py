"""Scored REPLUG branches, kept: every (example, document) branch's per-token log-probs of the
target, scored by the LM once, and the ensemble's log-likelihood under any weighting read back
from them without the LM (paper §3.2: the mixture is per token, with fixed weights).

:class:`ScoredBranches` holds ``[N, K, T]`` branch log-probs with the retrieval scores and masks;
the retrieval-temperature studies (:mod:`replug_jax.eval.temperature`) and the candidate pools
of LSR training (:mod:`replug_jax.train.pool`) both read it. Weightings: a retrieval
temperature τ (``λ = softmax(s / τ)``), ``"uniform"`` (λ = 1/K) or ``"top1"`` (all weight on
the best-scored document).
"""

from __future__ import annotations

import dataclasses
import pathlib
import zipfile
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from replug_jax.core.ensemble import mixture_logprobs, retrieval_log_weights, sequence_logprob
from replug_jax.fileio import atomic_path

SCHEMES = ("uniform", "top1")


@dataclasses.dataclass(frozen=True)
class ScoredBranches:
    """Scored branches of N examples, padded to K documents and T target tokens.

    ``logprobs_NKT`` per-token log-probs of the target in each branch (0 in padding),
    ``scores_NK`` retrieval similarities, ``doc_mask_NK`` / ``token_mask_NT`` mark real
    documents and tokens, ``bytes_N`` the targets' UTF-8 lengths, ``ids`` the example ids."""

    logprobs_NKT: np.ndarray
    scores_NK: np.ndarray
    doc_mask_NK: np.ndarray
    token_mask_NT: np.ndarray
    bytes_N: np.ndarray
    ids: tuple[str, ...]

    def __post_init__(self):
        n, k, t = self.logprobs_NKT.shape
        for name, shape in (("scores_NK", (n, k)), ("doc_mask_NK", (n, k)),
                            ("token_mask_NT", (n, t)), ("bytes_N", (n,))):
            if getattr(self, name).shape != shape:
                raise ValueError(f"ScoredBranches: {name} has shape {getattr(self, name).shape}, "
                                 f"expected {shape}")
        if len(self.ids) != n:
            raise ValueError(f"ScoredBranches: {len(self.ids)} ids for {n} examples")
        if n and not self.doc_mask_NK.any(axis=1).all():
            raise ValueError("ScoredBranches: an example has no scored document")

    def __len__(self) -> int:
        return len(self.ids)

    @classmethod
    def from_results(cls, results: Sequence, ids: Sequence[str] | None = None, *,
                     unscored: str = "refuse") -> "ScoredBranches":
        """From :class:`~replug_jax.replug.ScoreResult` objects (each holds ``branch_logprobs
        [K', T]`` and ``doc_scores``). A result without one retrieval score per branch (mode
        "none", "concat" or "random") is refused, or with ``unscored="uniform"`` kept with
        equal scores: λ uniform over its branches at any τ."""
        if not results:
            raise ValueError("no scored examples")
        k = max(r.branch_logprobs.shape[0] for r in results)
        t = max(r.branch_logprobs.shape[1] for r in results)
        n = len(results)
        lp = np.zeros((n, k, t), np.float32)
        scores = np.zeros((n, k), np.float32)
        doc_mask = np.zeros((n, k), bool)
        tok_mask = np.zeros((n, t), bool)
        for i, r in enumerate(results):
            kk, tt = r.branch_logprobs.shape
            scored = (r.doc_scores is not None and len(r.doc_scores) == kk
                      and not np.isnan(r.doc_scores).any())
            if not scored and unscored != "uniform":
                raise ValueError(f"result {i} has no retrieval scores (mode {r.settings['mode']!r}"
                                 "); score with mode 'replug'")
            lp[i, :kk, :tt] = r.branch_logprobs
            scores[i, :kk] = r.doc_scores if scored else 0.0
            doc_mask[i, :kk] = True
            tok_mask[i, :tt] = True
        ids = tuple(str(x) for x in (ids if ids is not None else range(n)))
        return cls(lp, scores, doc_mask, tok_mask,
                   np.array([r.num_bytes for r in results], np.int64), ids)

    def save(self, path: str | pathlib.Path) -> None:
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, logprobs_NKT=self.logprobs_NKT, scores_NK=self.scores_NK,
                         doc_mask_NK=self.doc_mask_NK, token_mask_NT=self.token_mask_NT,
                         bytes_N=self.bytes_N, ids=np.array(self.ids, dtype=str))

    @classmethod
    def load(cls, path: str | pathlib.Path) -> "ScoredBranches":
        try:
            with np.load(path, allow_pickle=False) as z:
                return cls(z["logprobs_NKT"], z["scores_NK"], z["doc_mask_NK"],
                           z["token_mask_NT"], z["bytes_N"], tuple(z["ids"].tolist()))
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as err:
            raise ValueError(f"{path}: not a readable file of scored branches ({err}); delete "
                             "it to rescore") from err


def scheme_log_weights(scores_NK, doc_mask_NK, scheme: float | str):
    """``[N, K]`` log-weights: ``softmax(s / τ)`` for a float τ (§3.2), ``"uniform"`` or
    ``"top1"`` (one-hot on the highest score; REPLUG with k = 1)."""
    scores_NK = jnp.asarray(scores_NK, jnp.float32)
    mask_NK = jnp.asarray(doc_mask_NK, bool)
    if scheme == "uniform":
        return jnp.where(mask_NK, -jnp.log(jnp.sum(mask_NK, -1, keepdims=True)), -jnp.inf)
    if scheme == "top1":
        best_N = jnp.argmax(jnp.where(mask_NK, scores_NK, -jnp.inf), axis=-1)
        one_hot = jax.nn.one_hot(best_N, scores_NK.shape[-1], dtype=bool)
        return jnp.where(one_hot, 0.0, -jnp.inf)
    if isinstance(scheme, str):
        raise ValueError(f"a weighting is a temperature > 0 or one of {SCHEMES}, got {scheme!r}")
    return retrieval_log_weights(scores_NK, scheme, mask_NK)


@jax.jit
def _logliks(logprobs_NKT, token_mask_NT, log_weights_NK):
    mix_NT = mixture_logprobs(logprobs_NKT, log_weights_NK)
    return sequence_logprob(mix_NT, token_mask_NT)


def mixture_logliks(cache: ScoredBranches, scheme: float | str) -> np.ndarray:
    """``[N]`` REPLUG log-likelihoods ``Σ_t log Σ_k λ_k p(y_t | d_k ∘ x, y_<t)`` of the cached
    targets under the weighting ``scheme`` (a temperature, "uniform" or "top1")."""
    log_w = scheme_log_weights(cache.scores_NK, cache.doc_mask_NK, scheme)
    return np.asarray(_logliks(cache.logprobs_NKT, cache.token_mask_NT, log_w), np.float64)


def first(cache: ScoredBranches, k: int) -> ScoredBranches:
    """Each example's first ``k`` documents (the top-``k`` of a top-K retrieval)."""
    return dataclasses.replace(cache, doc_mask_NK=cache.doc_mask_NK & (
        np.arange(cache.doc_mask_NK.shape[1]) < k))


def subset(cache: ScoredBranches, rows) -> ScoredBranches:
    rows = np.asarray(rows)
    return ScoredBranches(cache.logprobs_NKT[rows], cache.scores_NK[rows],
                          cache.doc_mask_NK[rows], cache.token_mask_NT[rows],
                          cache.bytes_N[rows], tuple(cache.ids[i] for i in rows))
