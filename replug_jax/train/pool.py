"""LSR on a pre-scored candidate pool (paper §4, measured at a cost a CPU can pay).

The frozen LM's score of an (example, passage) pair never changes, so each example's top-``M``
candidates of the *base* retriever are scored once (:func:`build_pool`): the per-token
log-probs ``log p(y_t | d ∘ x, y_<t)`` of every pair, in large length-bucketed batches, saved
part by part so an interrupted run resumes where it stopped. Everything after that costs no LM
call:

* training (:func:`train_on_pool`): at each step the current retriever re-ranks each
  example's pool and its top-``k`` within the pool is the retrieved set (the paper retrieves
  from the whole index; the pool stands in for the index between refreshes), and the loss of
  ``core.losses`` compares ``P_R`` with the LM's ``Q`` over those ``k``;
* evaluation (:func:`pool_logliks`): REPLUG's mixture ``Σ_k λ_k p(y | d_k ∘ x)`` over the
  retriever's top-``k`` within the pool, from the stored per-token log-probs — the dev curve
  and early stopping use it;
* every objective and temperature is compared on the same supervision.

The pool itself is a :class:`~replug_jax.branches.BranchCache` (``[E, M, T]`` token
log-probs, the base retriever's scores) plus the candidates' passage ids and a provenance
record (LM, prompt settings, lengths, corpus checksum, base retriever).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time
from typing import Callable, ClassVar, Sequence

import jax
import numpy as np

from replug_jax.branches import BranchCache, mixture_logliks
from replug_jax.fileio import atomic_path, write_json_atomic
from replug_jax.retrieval import corpus_text
from replug_jax.train.spec import (
    MARGINAL_NEEDS_SUM,
    ObjectiveConfig,
    OptimConfig,
    marginal_score_ok,
)
from replug_jax.train.data import Example, batch_indices
from replug_jax.train.pool_scoring import score_pairs

POOL_VERSION = 1


@dataclasses.dataclass
class ScoredPool:
    """Each example's ``M`` candidates and the frozen LM's per-token scores of them."""

    branches: BranchCache  # logprobs_NKT [E, M, T]; scores_NK: the base retriever's
    doc_ids_EM: np.ndarray  # int64 passage ids of the candidates (-1: fewer than M)
    provenance: dict

    @property
    def ids(self) -> tuple[str, ...]:
        return self.branches.ids

    def __len__(self) -> int:
        return len(self.branches)

    def lm_scores(self, reduction: str = "mean") -> np.ndarray:
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
        branches = BranchCache.load(d / "branches.npz")
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
    branches = BranchCache(lp_EMT, np.asarray(base_scores_EM, np.float32), candidates_EM >= 0,
                           token_mask, np.array([len(ex.continuation.encode("utf-8"))
                                                 for ex in examples], np.int64),
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
    view = BranchCache(c.logprobs_NKT, np.asarray(scores_EM, np.float32), mask & c.doc_mask_NK,
                       c.token_mask_NT, c.bytes_N, c.ids)
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


def bits_per_byte(logliks_E: np.ndarray, bytes_E: np.ndarray) -> float:
    return float(-np.sum(logliks_E) / (np.log(2.0) * np.sum(bytes_E)))


@dataclasses.dataclass(frozen=True)
class PoolTrainConfig:
    """One LSR run on a pool (the study varies ``objective``, ``gamma``, ``beta``)."""

    # dotted keys for the spec's pieces (replug_jax.config): `objective.gamma=1`
    PIECES: ClassVar[dict] = {
        "objective": {n: n for n in ("objective", "gamma", "beta", "lm_score")},
        "optim": {n: n for n in ("learning_rate", "warmup_ratio", "grad_clip")},
    }

    objective: str = "kl_retriever_to_lm"  # | kl_lm_to_retriever | marginal
    gamma: float = 0.1  # supervision temperature of P_R (§4.1, Eq. 3)
    beta: float = 0.1  # supervision temperature of Q (§4.2, Eq. 4)
    k: int = 4  # documents retrieved within each pool
    lm_score: str = "mean"  # sequence score of a branch: mean or sum of token log-probs
    steps: int = 2000
    batch_size: int = 16
    learning_rate: float = 2e-5
    warmup_ratio: float = 0.1
    grad_clip: float = 1.0
    refresh_every: int = 250  # re-embed the pools' passages (the paper's index refresh)
    eval_every: int = 250  # dev within-pool bits per byte
    patience: int = 4  # evaluations without a new best dev value before stopping
    # τ of λ at evaluation (§3.2: 1); 0: fitted on the dev pool at every evaluation over
    # tau_grid (the τ an end-to-end test with a fitted τ uses), recorded in the curve
    eval_temperature: float = 1.0
    tau_grid: tuple = (0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0)
    # what selects the step (and early-stops): "pool_loglik" (the dev pool's REPLUG
    # likelihood) | "recall@1" (``dev_recall`` given to train_on_pool, higher is better; a
    # step counts only if its dev pool log-likelihood is not below step 0's, the base's)
    select_on: str = "pool_loglik"
    early_stop: bool = True  # False: run every step and return the last (a fixed budget)
    shuffle_q: bool = False  # the control: Q permuted within each pool (shuffled_q)
    # "shared": one encoder for queries and documents (the paper's Contriever), documents
    # re-embedded with it every refresh_every steps; "query": only the query tower learns,
    # documents keep the base encoder's embeddings (an index built with the base stays valid)
    towers: str = "shared"
    seed: int = 0

    def __post_init__(self):
        if not marginal_score_ok(self.objective, self.lm_score):
            raise ValueError(MARGINAL_NEEDS_SUM)
        if self.towers not in ("shared", "query"):
            raise ValueError(f"towers must be 'shared' or 'query', got {self.towers!r}")
        if self.select_on not in ("pool_loglik", "recall@1"):
            raise ValueError(f"select_on must be 'pool_loglik' or 'recall@1', got "
                             f"{self.select_on!r}")
        if self.eval_temperature < 0 or (self.eval_temperature == 0 and not self.tau_grid):
            raise ValueError("eval_temperature must be > 0, or 0 with a tau_grid to fit")
        self.objective_config  # an unknown objective name fails here, not at training

    @property
    def objective_config(self) -> ObjectiveConfig:
        """The loss's piece (``objective`` names the kind and direction:
        :data:`~replug_jax.train.spec.OBJECTIVES`)."""
        return ObjectiveConfig.named(self.objective, self.gamma, self.beta, self.lm_score)

    @property
    def optim_config(self) -> OptimConfig:
        """The optimizer's piece: Adam, no weight decay (``optim_config.build(steps)``)."""
        return OptimConfig("adam", self.learning_rate, 0.0, self.warmup_ratio, self.grad_clip)


def train_on_pool(retriever, train_pool: ScoredPool, train_examples: Sequence[Example],
                  dev_pool: ScoredPool, dev_examples: Sequence[Example], passages_by_id: dict,
                  cfg: PoolTrainConfig, *, progress: bool = True,
                  log: Callable[[dict], None] | None = None,
                  frozen_docs: dict | None = None,
                  dev_recall: Callable[[object], float] | None = None) -> dict:
    """REPLUG LSR on a pre-scored pool; returns ``{"params", "best_step", "curve",
    "steps_run", "seconds"}``.

    Query tower trained, documents from the last refresh: at every step the batch's queries
    are encoded with the current parameters (gradients reach the shared encoder through them)
    and re-rank their whole pool against the pool passages' embeddings of the last refresh
    (every ``refresh_every`` steps, with the current parameters: the paper's stale index
    embeddings, refreshed periodically, §4.3; with ``towers="query"`` the documents keep the
    base encoder's embeddings and only the query tower learns); the top-``k`` within each
    pool by those scores are the retrieved documents of that step. The dev curve (REPLUG
    bits per byte within the dev pools, τ = ``eval_temperature``) is read every
    ``eval_every`` steps; the parameters of the best dev value are returned, and training
    stops after ``patience`` evaluations without a new best. ``frozen_docs``: the base
    document embeddings by passage id, shared by runs with ``towers="query"`` (each passage
    encoded once for all of them).

    With ``eval_temperature=0`` each evaluation fits τ on the dev pool (``tau_grid``) and the
    curve is read at it; with ``select_on="recall@1"`` the step with the best
    ``dev_recall(params)`` (gold passage at rank 1 of the whole datastore) is kept among
    those whose dev pool log-likelihood is not below the base's; ``early_stop=False`` runs
    every step and returns the last.
    """
    from tqdm.auto import tqdm

    from replug_jax.models.params import split_params
    from replug_jax.train.lsr import init_state, make_query_step

    graphdef, template, params0 = split_params(retriever.model.encoder)
    tx = cfg.optim_config.build(cfg.steps)
    step_fn = make_query_step(graphdef, template, cfg.objective_config, tx,
                              retriever.model.pooling, retriever.normalize, cfg.k,
                              schedule=cfg.optim_config.schedule(cfg.steps))
    state = init_state(params0, tx)
    lm_EM = train_pool.lm_scores(cfg.lm_score)
    valid_EM = train_pool.branches.doc_mask_NK
    if cfg.shuffle_q:
        lm_EM = shuffled_q(lm_EM, valid_EM, cfg.seed)
    q_ids, q_mask = retriever.tokenize_fixed([ex.query for ex in train_examples],
                                             retriever.query_max_length,
                                             retriever.query_truncation)
    longest = int(q_mask.sum(1).max())  # padding past the longest query changes nothing
    q_ids, q_mask = q_ids[:, :longest], q_mask[:, :longest]

    doc_params = "same" if cfg.towers == "shared" else None
    frozen = (frozen_docs if frozen_docs is not None else {}) if doc_params is None else None

    if cfg.select_on == "recall@1" and dev_recall is None:
        raise ValueError("select_on='recall@1' needs dev_recall")

    def evaluate(params) -> dict:
        q, d = embed_pool(retriever, params, dev_pool, dev_examples, passages_by_id,
                          doc_params, frozen)
        s = np.einsum("ed,emd->em", q, d)
        taus = (cfg.eval_temperature,) if cfg.eval_temperature > 0 else tuple(cfg.tau_grid)
        lls = [pool_logliks(dev_pool, s, cfg.k, t) for t in taus]
        best_t = int(np.argmax([float(np.sum(ll)) for ll in lls]))
        out = {"dev_bpb": bits_per_byte(lls[best_t], dev_pool.branches.bytes_N),
               "dev_loglik": float(np.mean(lls[best_t])), "tau": float(taus[best_t])}
        if dev_recall is not None:
            out["dev_recall@1"] = float(dev_recall(params))
        return out

    def score(entry: dict, base: dict) -> float:
        """Lower is better; inf: not eligible (the guard)."""
        if cfg.select_on == "pool_loglik":
            return entry["dev_bpb"]
        if entry["dev_loglik"] < base["dev_loglik"]:
            return float("inf")
        return -entry["dev_recall@1"]

    t0 = time.perf_counter()
    curve = [{"step": 0, **evaluate(params0)}]
    best = (score(curve[0], curve[0]), 0, jax.tree.map(np.asarray, params0))
    since_best = 0
    d_EMD = None
    bar = tqdm(total=cfg.steps, desc=f"LSR on the pool ({cfg.objective})", disable=not progress)
    step = 0
    for step in range(cfg.steps):
        if d_EMD is None or (cfg.towers == "shared" and step % cfg.refresh_every == 0):
            _, d_EMD = embed_pool(retriever, state.params, train_pool, train_examples,
                                  passages_by_id, doc_params, frozen)
        rows = batch_indices(step, cfg.batch_size, len(train_examples), cfg.seed)
        batch = {"query_ids": q_ids[rows], "query_mask": q_mask[rows],
                 "doc_emb": d_EMD[rows], "doc_valid": valid_EM[rows],
                 "lm_scores": lm_EM[rows]}
        state, metrics = step_fn(state, batch)
        bar.update(1)
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            entry = {"step": step + 1, **evaluate(state.params),
                     **{k: float(v) for k, v in metrics.items()}}
            curve.append(entry)
            if log is not None:
                log(entry)
            value = score(entry, curve[0])
            if not cfg.early_stop:  # a fixed budget: the last step is the result
                best = (value, step + 1, jax.tree.map(np.asarray, state.params))
            elif value < best[0]:
                best, since_best = (value, step + 1, jax.tree.map(np.asarray, state.params)), 0
            else:
                since_best += 1
                if since_best >= cfg.patience:
                    break
    bar.close()
    chosen = next(c for c in curve if c["step"] == best[1])
    return {"params": best[2], "best_step": best[1], "best_dev_bpb": chosen["dev_bpb"],
            "best": chosen, "curve": curve, "steps_run": step + 1,
            "seconds": time.perf_counter() - t0}
