"""Pre-scored pools as the supervision of the LSR trainer (``supervision.kind="pool"``): the batch
of each step and the dev curve, at no LM cost (DESIGN.md, "LSR on a pre-scored pool").

At every step the batch's queries are encoded by the step itself with the current parameters
and re-rank their whole pool against the pool passages' embeddings of the last refresh (every
``refresh_every`` steps, with the current parameters: the paper's stale index embeddings,
§4.3; with ``towers="query"`` the documents keep the base encoder's embeddings and only the
query tower learns). The dev curve is REPLUG within the dev pools (§3.2, λ at ``eval_tau`` or
the τ fitted at each evaluation) and, where given, recall@1 of the dev questions over the
whole datastore. Named temperatures (γ "fitted" or "learned", β "fitted") are fitted here,
once, from the base retriever on the dev pool.
"""

from __future__ import annotations

import pathlib
from typing import Callable, Sequence

import numpy as np

from replug_jax.core.ensemble import bits_per_byte
from replug_jax.eval.temperature import fit_tau
from replug_jax.fileio import atomic_path
from replug_jax.train.data import Example, batch_indices
from replug_jax.train.pool import (
    ScoredPool,
    embed_pool,
    fit_beta,
    fit_pool_tau,
    pool_logliks,
    shuffled_q,
)


def _check_aligned(pool: ScoredPool, examples: Sequence[Example], split: str) -> None:
    ids = tuple(e.id for e in examples)
    if ids != pool.ids:
        raise ValueError(f"the {split} pool holds {len(pool)} examples that are not the "
                         f"{len(ids)} {split} examples in its order (first pool id "
                         f"{pool.ids[0] if pool.ids else None!r}, first example id "
                         f"{ids[0] if ids else None!r}); build the pool from these examples")


class PoolSource:
    """The batches and dev curve of LSR on pre-scored pools (``cfg``: an
    :class:`~replug_jax.train.config.LSRConfig` with ``supervision="pool"``)."""

    def __init__(self, cfg, retriever, train_pool: ScoredPool, train: Sequence[Example],
                 dev_pool: ScoredPool | None, dev: Sequence[Example], passages_by_id, *,
                 frozen_docs: dict | None = None,
                 dev_recall: Callable[[object], float] | None = None):
        """``frozen_docs``: the base document embeddings by passage id (``towers="query"``),
        shared by runs over the same pools so each passage is encoded once for all of them;
        ``dev_recall(params)``: recall@1 of the dev questions over the whole datastore."""
        _check_aligned(train_pool, train, "train")
        if dev_pool is not None:
            _check_aligned(dev_pool, dev, "dev")
        if cfg.k > train_pool.doc_ids_EM.shape[1]:
            raise ValueError(f"k={cfg.k} exceeds the train pool's {train_pool.doc_ids_EM.shape[1]} "
                             "candidates per example")
        if cfg.selection.metric == "recall@1" and dev_recall is None:
            raise ValueError("select_on='recall@1' needs the dev questions' recall over the "
                             "whole datastore (an index of it)")
        self.cfg, self.retriever = cfg, retriever
        self.train_pool, self.train = train_pool, list(train)
        self.dev_pool, self.dev = dev_pool, list(dev)
        self.by_id = passages_by_id
        self.dev_recall = dev_recall
        self.doc_params = "same" if cfg.supervision.towers == "shared" else None
        self.frozen = (frozen_docs if frozen_docs is not None else {}) \
            if cfg.supervision.towers == "query" else None
        self.lm_EM = train_pool.lm_scores(cfg.objective.lm_score)
        self.valid_EM = train_pool.branches.doc_mask_NK
        if cfg.supervision.shuffle_q:
            self.lm_EM = shuffled_q(self.lm_EM, self.valid_EM, cfg.seed)
        q_ids, q_mask = retriever.tokenize_fixed([e.query for e in self.train],
                                                 retriever.query_max_length,
                                                 retriever.query_truncation)
        longest = int(q_mask.sum(1).max())  # padding past the longest query changes nothing
        self.q_ids, self.q_mask = q_ids[:, :longest], q_mask[:, :longest]
        self.d_EMD: np.ndarray | None = None
        self.base_fit: dict | None = None

    # -- temperatures --------------------------------------------------------------------

    def fit_base(self) -> dict:
        """The base retriever's τ fitted on the dev pool (the τ REPLUG infers at) and the β
        whose Q is nearest its P_R there: ``{"tau", "beta"}`` (computed once)."""
        if self.base_fit is None:
            if self.dev_pool is None:
                raise ValueError("fitting τ or β needs a dev pool")
            s = self._dev_scores(None)
            tau, _ = fit_pool_tau(self.dev_pool, s, self.cfg.k, self.cfg.selection.tau_grid)
            beta = fit_beta(self.dev_pool, s, self.cfg.k, tau, self.cfg.selection.beta_grid,
                            self.cfg.objective.lm_score)
            self.base_fit = {"tau": tau, "beta": beta}
        return self.base_fit

    def resolve(self, objective):
        """``objective`` with its named temperatures replaced by the base's fitted ones."""
        if not objective.needs_fit:
            return objective
        fit = self.fit_base()
        return objective.resolved(fit["tau"], fit["beta"])

    # -- batches --------------------------------------------------------------------------

    def _doc_path(self, workdir: pathlib.Path) -> pathlib.Path:
        return workdir / "pool_doc_embeddings.npy"

    def refresh(self, step: int, params, workdir: pathlib.Path | None = None) -> bool:
        """Re-embed the train pools' passages when due (the first step, then every
        ``refresh_every`` steps with a shared encoder); kept in ``workdir`` so that a resumed
        run continues from the embeddings of the last refresh, as an uninterrupted one does."""
        due = self.d_EMD is None or (self.cfg.supervision.towers == "shared"
                                     and step % self.cfg.retrieval.refresh_every == 0)
        if not due:
            return False
        path = None if workdir is None else self._doc_path(workdir)
        last = step - step % self.cfg.retrieval.refresh_every
        if (self.d_EMD is None and path is not None and path.exists() and step != last
                and self.cfg.supervision.towers == "shared"):
            self.d_EMD = np.load(path, allow_pickle=False)  # the refresh before the restart
            return False
        _, self.d_EMD = embed_pool(self.retriever, params, self.train_pool, self.train,
                                   self.by_id, self.doc_params, self.frozen)
        if path is not None and self.cfg.supervision.towers == "shared":
            with atomic_path(path, ".npy") as tmp:
                np.save(tmp, self.d_EMD)
        return True

    def batch(self, step: int) -> dict:
        rows = batch_indices(step, self.cfg.batch_size, len(self.train), self.cfg.seed)
        return {"query_ids": self.q_ids[rows], "query_mask": self.q_mask[rows],
                "doc_emb": self.d_EMD[rows], "doc_valid": self.valid_EM[rows],
                "lm_scores": self.lm_EM[rows]}

    # -- the dev curve --------------------------------------------------------------------

    def _dev_scores(self, params) -> np.ndarray:
        q, d = embed_pool(self.retriever, params, self.dev_pool, self.dev, self.by_id,
                          self.doc_params, self.frozen)
        return np.einsum("ed,emd->em", q, d)

    def evaluate(self, params) -> dict:
        """The dev curve's point at ``params``: REPLUG's dev-pool bits per byte and mean
        log-likelihood at ``eval_tau`` (or the τ fitted now), and dev recall@1 where given."""
        out: dict = {}
        if self.dev_pool is not None:
            cfg = self.cfg
            s = self._dev_scores(params)
            lls = {}  # τ -> the dev pool's log-likelihoods, each computed once

            def total(t: float) -> float:
                lls[t] = pool_logliks(self.dev_pool, s, cfg.k, t)
                return float(np.sum(lls[t]))
            tau = cfg.selection.tau if cfg.selection.tau > 0 else fit_tau(
                total, grid=cfg.selection.tau_grid)["temperature"]
            ll = lls[tau] if tau in lls else pool_logliks(self.dev_pool, s, cfg.k, tau)
            out = {"dev_bpb": float(bits_per_byte(np.sum(ll, dtype=np.float64),
                                                  np.sum(self.dev_pool.branches.bytes_N))),
                   "dev_loglik": float(np.mean(ll)), "tau": float(tau)}
        if self.dev_recall is not None:
            out["dev_recall@1"] = float(self.dev_recall(params))
        return out
