"""LSR on a pre-scored candidate pool (paper §4, measured at a cost a CPU can pay).

The frozen LM's score of an (example, passage) pair never changes, so each example's top-``M``
candidates of the *base* retriever are scored once (:func:`build_pool`): the per-token
log-probs ``log p(y_t | d ∘ x, y_<t)`` of every pair, in large length-bucketed batches, kept
in the score store call by call so an interrupted run resumes where it stopped. Everything
after that costs no LM call:

* training (the one trainer, :class:`~replug_jax.train.loop.LSRTrainer` with
  ``supervision.kind="pool"``, its batches from :class:`~replug_jax.train.pool_source.PoolSource`):
  at each step the current retriever re-ranks each example's pool and its top-``k`` within
  the pool is the retrieved set (the paper retrieves from the whole index; the pool stands in
  for the index between refreshes), and the loss of ``core.losses`` compares ``P_R`` with the
  LM's ``Q`` over those ``k``;
* evaluation (:func:`pool_logliks`): REPLUG's mixture ``Σ_k λ_k p(y | d_k ∘ x)`` over the
  retriever's top-``k`` within the pool, from the stored per-token log-probs — the dev curve
  and early stopping use it;
* every objective and temperature is compared on the same supervision.

The pool itself is a :class:`~replug_jax.branches.ScoredBranches` (``[E, M, T]`` token
log-probs, the base retriever's scores) plus the candidates' passage ids and a provenance
record (LM, prompt settings, lengths, corpus checksum, base retriever).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Sequence

import numpy as np

from replug_jax.branches import ScoredBranches, mixture_logliks
from replug_jax.eval.temperature import fit_tau
from replug_jax.fileio import atomic_path, write_json_atomic
from replug_jax.retrieval import corpus_text
from replug_jax.train.data import Example
from replug_jax.train.pool_scoring import score_pairs

POOL_VERSION = 1


@dataclasses.dataclass
class ScoredPool:
    """Each example's ``M`` candidates and the frozen LM's per-token scores of them."""

    branches: ScoredBranches  # logprobs_NKT [E, M, T]; scores_NK: the base retriever's
    doc_ids_EM: np.ndarray  # int64 passage ids of the candidates (-1: fewer than M)
    provenance: dict

    @property
    def ids(self) -> tuple[str, ...]:
        return self.branches.ids

    def __len__(self) -> int:
        return len(self.branches)

    def lm_scores(self, reduction: str = "sum") -> np.ndarray:
        """``[E, M]`` sequence scores of the continuation in each branch (the ``lm_scores``
        of the LSR loss): mean or sum of token log-probs."""
        c = self.branches
        total_EM = np.sum(c.logprobs_NKT * c.token_mask_NT[:, None, :], axis=-1)
        if reduction == "sum":
            return total_EM.astype(np.float32)
        return (total_EM / np.maximum(c.token_mask_NT.sum(-1), 1)[:, None]).astype(np.float32)

    def subset(self, rows) -> "ScoredPool":
        from replug_jax.branches import subset

        rows = np.asarray(rows)
        return ScoredPool(subset(self.branches, rows), self.doc_ids_EM[rows], self.provenance)

    def save(self, directory: str | pathlib.Path) -> None:
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.branches.save(d / "branches.npz")
        with atomic_path(d / "candidates.npy", ".npy") as tmp:
            np.save(tmp, self.doc_ids_EM)
        write_json_atomic(self.provenance, d / "pool.json")  # last: marks the pool complete

    @classmethod
    def load(cls, directory: str | pathlib.Path, expect: dict | None = None) -> "ScoredPool":
        """Load a pool; with ``expect``, refuse one whose provenance differs in any key."""
        d = pathlib.Path(directory)
        if not (d / "pool.json").exists():
            raise ValueError(f"{d}: no finished pool (pool.json missing); build it first")
        provenance = json.loads((d / "pool.json").read_text())
        for key, value in (expect or {}).items():
            if provenance.get(key) != value:
                raise ValueError(f"{d}: a pool made with {key}={provenance.get(key)!r}, not "
                                 f"{value!r}; use another folder or rebuild it")
        branches = ScoredBranches.load(d / "branches.npz")
        try:
            doc_ids = np.load(d / "candidates.npy", allow_pickle=False)
        except (OSError, ValueError, EOFError) as err:
            raise ValueError(f"{d / 'candidates.npy'}: unreadable ({err}); rebuild the pool") \
                from err
        want = branches.doc_mask_NK.shape
        if doc_ids.shape != want or not np.issubdtype(doc_ids.dtype, np.integer):
            raise ValueError(f"{d / 'candidates.npy'}: {doc_ids.dtype} {doc_ids.shape} where "
                             f"the pool's scores are {want}; rebuild the pool")
        return cls(branches, doc_ids, provenance)


def build_pool(examples: Sequence[Example], candidates_EM: np.ndarray,
               base_scores_EM: np.ndarray, passages_by_id: dict, scorer,
               directory: str | pathlib.Path, provenance: dict, *, separator: str = "\n\n",
               part_size: int = 32, progress: bool = True, store=None) -> ScoredPool:
    """Score every (example, candidate) pair once (:func:`score_pairs`; pairs already in the
    content-keyed ``store`` are taken from it) and save the pool in ``directory``; every
    example needs a candidate. Returns the pool, with ``provenance`` extended by the pairs/s
    measured."""
    lp_EMT, n_tok_E, provenance = score_pairs(
        examples, candidates_EM, passages_by_id, scorer, directory, provenance,
        separator=separator, part_size=part_size, progress=progress, store=store)
    token_mask = np.arange(lp_EMT.shape[-1])[None, :] < n_tok_E[:, None]
    candidates_EM = np.asarray(candidates_EM, np.int64)
    branches = ScoredBranches(
        lp_EMT, np.asarray(base_scores_EM, np.float32), candidates_EM >= 0, token_mask,
        np.array([len(ex.continuation.encode("utf-8")) for ex in examples], np.int64),
        tuple(ex.id for ex in examples))
    pool = ScoredPool(branches, candidates_EM, {**provenance, "version": POOL_VERSION})
    pool.save(directory)
    return pool


# -- the retriever on the pool -------------------------------------------------------------

def embed_pool(retriever, params, pool: ScoredPool, examples: Sequence[Example],
               passages_by_id: dict, doc_params="same", frozen_docs: dict | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
    """The retriever's (``params``) query embeddings ``[E, D]`` and candidate embeddings
    ``[E, M, D]`` (zeros for missing candidates); each distinct passage is encoded once, with
    ``doc_params`` (default: ``params``; None: the retriever's own weights, a frozen
    document tower, whose embeddings are kept in ``frozen_docs`` (id -> vector) across
    calls)."""
    q_ED = retriever.encode_queries([ex.query for ex in examples], params)
    ids = sorted({int(x) for x in pool.doc_ids_EM.ravel() if x >= 0})
    if doc_params is None and frozen_docs is not None:
        new = [i for i in ids if i not in frozen_docs]
        if new:
            vecs = retriever.encode_passages([corpus_text(passages_by_id[i]) for i in new])
            frozen_docs.update(zip(new, np.asarray(vecs, np.float32)))
        emb = np.stack([frozen_docs[i] for i in ids])
    else:
        emb = retriever.encode_passages([corpus_text(passages_by_id[i]) for i in ids],
                                        params if doc_params == "same" else doc_params)
    row = {pid: r for r, pid in enumerate(ids)}
    d_EMD = np.zeros(pool.doc_ids_EM.shape + (emb.shape[1],), np.float32)
    for (i, j), pid in np.ndenumerate(pool.doc_ids_EM):
        if pid >= 0:
            d_EMD[i, j] = emb[row[int(pid)]]
    return np.asarray(q_ED, np.float32), d_EMD


def top_k_in_pool(scores_EM: np.ndarray, valid_EM: np.ndarray, k: int) -> np.ndarray:
    """``[E, k]`` candidate positions of the ``k`` highest scores within each pool (ties by
    position); positions of missing candidates come last."""
    masked = np.where(valid_EM, scores_EM, -np.inf)
    return np.argsort(-masked, axis=1, kind="stable")[:, :k]


def pool_logliks(pool: ScoredPool, scores_EM: np.ndarray, k: int,
                 temperature: float = 1.0, choose_EM: np.ndarray | None = None) -> np.ndarray:
    """``[E]`` REPLUG log-likelihoods (§3.2) of the targets when the retriever scoring
    ``scores_EM`` retrieves its top-``k`` within each pool: ``λ = softmax(s / τ)`` over those
    ``k``, the mixture from the stored per-token log-probs. ``choose_EM``: pick the ``k`` by
    these scores instead (λ still from ``scores_EM``)."""
    c = pool.branches
    top = top_k_in_pool(scores_EM if choose_EM is None else choose_EM, c.doc_mask_NK, k)
    mask = np.zeros_like(c.doc_mask_NK)
    np.put_along_axis(mask, top, True, axis=1)
    view = ScoredBranches(c.logprobs_NKT, np.asarray(scores_EM, np.float32),
                          mask & c.doc_mask_NK, c.token_mask_NT, c.bytes_N, c.ids)
    return mixture_logliks(view, temperature)


def oracle_logliks(pool: ScoredPool, k: int, temperature: float = 1.0) -> np.ndarray:
    """The ceiling of any retriever on this pool, at no LM cost: the ``k`` candidates the LM
    itself scores best (its summed log-likelihood of the target, what Q ranks by) are
    retrieved, weighted by the base retriever's λ over them. A study whose oracle is no better
    than the base retriever cannot show LSR helping, whatever it trains."""
    return pool_logliks(pool, pool.branches.scores_NK, k, temperature,
                        choose_EM=pool.lm_scores("sum"))


def shuffled_q(lm_EM: np.ndarray, valid_EM: np.ndarray, seed: int) -> np.ndarray:
    """The control of the LM's supervision: each example's scores permuted among its own
    valid candidates (same values, no link to the documents). Training on them must not
    help."""
    rng = np.random.default_rng(seed)
    out = np.array(lm_EM, copy=True)
    for e in range(len(out)):
        idx = np.flatnonzero(valid_EM[e])
        out[e, idx] = out[e, rng.permutation(idx)]
    return out


def fit_pool_tau(pool: ScoredPool, scores_EM: np.ndarray, k: int, grid) -> tuple[float, float]:
    """(τ, mean log-likelihood at τ): the τ of ``grid`` that maximises REPLUG's mean
    log-likelihood of the targets with the retriever's top-``k`` within the pools (§3.2 with
    a fitted τ: the τ REPLUG then infers at), by the one fitter
    (:func:`~replug_jax.eval.temperature.fit_tau`)."""
    fit = fit_tau(lambda t: float(np.mean(pool_logliks(pool, scores_EM, k, t))), grid=grid)
    return fit["temperature"], fit["loglik"]


def masked_log_softmax(x: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """Log-softmax over the last axis of ``x`` with the invalid entries at -inf (numpy, for
    the diagnostics read off a pool on the host)."""
    x = np.where(valid, x, -np.inf)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.sum(np.exp(x - m), -1, keepdims=True))


def fit_beta(pool: ScoredPool, scores_EM: np.ndarray, k: int, tau: float, grid,
             lm_score: str = "sum") -> float:
    """The β of ``grid`` at which Q (Eq. 4) over the retriever's top-``k`` of each pool is
    nearest to P_R at ``tau``: the smallest mean KL(P_R‖Q), so the LSR loss then measures how
    the two rank the documents rather than how peaked each is."""
    c = pool.branches
    top = top_k_in_pool(scores_EM, c.doc_mask_NK, k)
    pick = lambda a: np.take_along_axis(a, top, axis=1)  # noqa: E731
    valid = pick(c.doc_mask_NK)
    s, lm = pick(np.asarray(scores_EM, np.float64)), pick(pool.lm_scores(lm_score))

    log_p = masked_log_softmax(s / tau, valid)
    kls = [float(np.mean(np.sum(np.where(
        valid, np.exp(log_p) * (log_p - masked_log_softmax(lm / b, valid)), 0.0), 1)))
        for b in grid]
    return float(grid[int(np.argmin(kls))])
