"""REPLUG LSR on QA, cross-fitted: a retriever the LM taught, tested on questions it never
trained on (pre-registration in ``experiments/configs/lsr_qa.py``; questions, folds and
datastore in :mod:`experiments.lib.lsr_qa_data`).

1. **Datastore**: SQuAD: every SQuAD paragraph (train and the dev articles here); NQ: the 624
   gold passages; plus enwiki passages as distractors, searched exactly as one index
   (:class:`experiments.lib.squad.MergedDatastore`, built in the work folder).
2. **Pools**: each question's top-``pool_size`` passages by the base retriever, scored once
   by the frozen LM (``log p(answer | d ∘ question)`` per token; document KV reuse shares each
   paragraph across the questions that retrieve it; resumable, LM call by call).
3. **Diagnostics at no LM cost**: the oracle ceiling (the LM's own top-k of each pool) against
   the base on dev and test; the shuffled-Q control trained like the first variant.
4. **Training**, in each fold (SQuAD: one, by article; NQ: K by question), on the train pool
   for every objective × (γ, β), early-stopped on dev
   (the one trainer, :class:`replug_jax.train.loop.LSRTrainer` on the pools, only the query
   tower learning by default).
5. **Test, end to end**: every retriever (base, each variant) retrieves its top-k for every
   test question from the whole datastore; the pairs the test pool lacks (their union over
   retrievers) are scored once; τ is fitted on the dev pool per retriever; the primary
   endpoint, recall@k and EM/F1 are compared with the base over all folds' test questions,
   intervals bootstrapped over articles (NQ: questions).

``--config confirm`` is the registered confirmatory test of the variant ``default``'s results
pointed to, on questions of SQuAD train articles no split held (reusing ``default``'s pools
and trained variant). ``python -m experiments.lib.lsr_qa_report --config NAME`` rewrites a
finished run's report from its JSON.

``--config tau_confirm`` is the third (issue 66): the variant the finished temperature study
picks on dev by its registered rule (``variant_from``), selected on recall@1 of 4,000 dev
questions (``recall_dev``).

Usage: ``python -m experiments.lsr_qa [--config default|confirm|confirm_recall|tau_confirm|nq|
tiny] [--set key=value] [--stage pools|train|primary|all]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib

import numpy as np

from experiments.lib import lsr_qa_report, squad
from experiments.lib.common import provenance, run, write_results
from experiments.configs.lsr_qa import CONFIGS
from experiments.lib.lsr_common import REGISTERED_RULE, registered_variant, slug, study_models
from experiments.lib.lsr_qa_data import (
    base_retrieval,
    examples_of,
    generate_answers,
    nq_transfer,
    open_study,
    write_question_file,
)
from experiments.lib.lsr_qa_report import chosen_name
from experiments.lib.lsr_qa_results import BASE, across_folds, recall_endpoint
from experiments.lib.pool_study import Fold, run_params, run_study
from replug_jax.branches import ScoredBranches, mixture_logliks
from replug_jax.eval.stats import format_interval
from replug_jax.fileio import atomic_path
from replug_jax.lm.score_store import ScoreStore, scorer_identity
from replug_jax.retrieval.encoder import Retriever
from replug_jax.train.pool import (
    build_pool,
    embed_pool,
    fit_pool_tau,
    oracle_logliks,
    pool_logliks,
    score_pairs,
)


def retrieve(store, retriever, params, questions, k: int):
    return store.search(retriever.encode_queries([q.question for q in questions], params), k)


def pool_scores(retriever, params, pool, examples, by_id, frozen: dict) -> np.ndarray:
    """``[E, M]`` similarities of each question (``params``) to its pool's passages (base
    document embeddings, kept in ``frozen``)."""
    q, d = embed_pool(retriever, params, pool, examples, by_id, None, frozen)
    return np.einsum("ed,emd->em", q, d)


def pair_logprobs(results: dict, examples, pool, lm, by_id, work, k: int, progress,
                  part_size: int = 32, store=None) -> dict:
    """``{(question, passage id): log-probs}`` for every pair of the test pool and every pair
    in some retriever's top-``k`` (``results``: name → retrieval): those the pool lacks (their
    union over retrievers) are scored once, resumably, into ``work/extra_test_<digest>``."""
    logprobs = {(i, int(pid)): pool.branches.logprobs_NKT[i, j]
                for (i, j), pid in np.ndenumerate(pool.doc_ids_EM) if pid >= 0}
    missing = [sorted({int(pid) for res in results.values() for pid in res.ids[i, :k]
                       if pid >= 0 and (i, int(pid)) not in logprobs})
               for i in range(len(examples))]
    width = max((len(m) for m in missing), default=0)
    if not width:
        return logprobs
    for res in results.values():
        by_id.update({p.id: p for ps in res.passages for p in ps})
    cand = np.array([m + [-1] * (width - len(m)) for m in missing], np.int64)
    digest = hashlib.sha256(cand.tobytes()).hexdigest()[:10]
    lp_EMT, _, _ = score_pairs(examples, cand, by_id, lm, work / f"extra_test_{digest}",
                               {"retrieved_by": sorted(results)}, part_size=part_size,
                               progress=progress, store=store)
    logprobs.update({(i, pid): lp_EMT[i, j] for i, m in enumerate(missing)
                     for j, pid in enumerate(m)})
    return logprobs


def end_to_end(res, logprobs: dict, length_E: np.ndarray, tau, k: int) -> np.ndarray:
    """``[E]`` REPLUG log-likelihoods of the gold answers (``length_E`` tokens) with the
    top-``k`` of ``res`` (retrieved from the whole datastore) and ``λ = softmax(s/τ)``, each
    pair's log-probs from ``logprobs`` (:func:`pair_logprobs`)."""
    t = max(len(r) for r in logprobs.values())
    lp = np.zeros((len(res.ids), k, t), np.float32)
    for i in range(len(res.ids)):
        for slot, pid in enumerate(res.ids[i, :k]):
            if pid >= 0:
                row = logprobs[i, int(pid)]
                lp[i, slot, :len(row)] = row
    mask_NT = np.arange(t)[None, :] < np.asarray(length_E)[:, None]
    branches = ScoredBranches(lp, res.scores[:, :k].astype(np.float32), res.ids[:, :k] >= 0,
                              mask_NT, np.zeros(len(lp), np.int64), tuple(map(str, range(len(lp)))))
    return mixture_logliks(branches, tau)


def score_pools(study, examples, lm, retriever, cfg, work, progress, store, carry,
                only: tuple[str, ...] = ()):
    """Each pool set's pools (its questions' top-``pool_size`` by the base retriever, kept in
    ``carry``, scored once by the LM through the content-keyed ``store``), the base retrieval
    and the passages by id; ``only``: these pool sets alone (scoring the train and dev pools
    of a study whose test is not registered yet)."""
    by_id, pools, base_res = {}, {}, {}
    roles = [(n, s == "test") for f in study.folds for s, (n, _) in f.items()]
    test_only = {n for n, t in roles if t} - {n for n, t in roles if not t}
    unknown = set(only) - set(study.pool_sets)
    if unknown:
        raise ValueError(f"--pool-sets {','.join(sorted(unknown))}: this study's pool sets are "
                         f"{', '.join(study.pool_sets)}")
    for name, qs in study.pool_sets.items():
        if only and name not in only:
            continue
        m = (cfg.test_pool_size or cfg.pool_size) if name in test_only else cfg.pool_size
        res = base_retrieval(study, retriever, qs, max(cfg.pool_size, *cfg.recall_ks),
                             carry / "retrievals" / f"base_{name}.npz",
                             {"retriever": retriever.identity, "distractors": cfg.distractors})
        base_res[name] = res
        by_id.update({p.id: p for ps in res.passages for p in ps})
        pools[name] = build_pool(
            examples[name], res.ids[:, :m], res.scores[:, :m], by_id,
            lm, work / f"pool_{name}", {"lm": lm.name, "retriever": retriever.identity,
                                        "split": name, "examples": [e.id for e in examples[name]],
                                        "distractors": cfg.distractors,
                                        "datastore": len(study.store), "pool_size": m},
            part_size=cfg.part_size, progress=progress, store=store)
    return pools, base_res, by_id


def _rows_of(res, rows):
    """The retrieval ``res`` restricted to ``rows`` (its questions in that order)."""
    return dataclasses.replace(res, ids=res.ids[rows], scores=res.scores[rows],
                               passages=[res.passages[i] for i in rows])


@dataclasses.dataclass
class QATask:
    """The QA study as a pool-study task (:mod:`experiments.lib.pool_study`): the models, the
    questions and datastore (:func:`experiments.lib.lsr_qa_data.open_study`), the pools of
    each pool set and the base retrievals."""
    cfg: object
    args: object
    work: pathlib.Path
    lm: object
    retriever: Retriever
    study: object
    examples: dict  # pool set -> examples
    carry: pathlib.Path
    store: ScoreStore
    progress: bool = True
    frozen: dict = dataclasses.field(default_factory=dict)  # base embeddings, encoded once
    pools: dict = dataclasses.field(default_factory=dict)
    base_res: dict = dataclasses.field(default_factory=dict)
    by_id: dict = dataclasses.field(default_factory=dict)

    @staticmethod
    def add_args(ap) -> None:
        ap.add_argument("--carry", type=pathlib.Path, default=None, metavar="DIR",
                        help="where the study keeps what is costly to make and small to keep "
                             "(default: the work folder): DIR/lm_scores, the LM's pair scores "
                             "keyed by their text (pairs found there are never scored again), "
                             "and DIR/retrievals, the base retriever's top passages of each "
                             "pool set; copy or commit it to resume the scoring on another "
                             "machine without encoding the datastore again")
        ap.add_argument("--pool-sets", default="", metavar="A,B",
                        help="with --stage pools: score only these pool sets (e.g. train,dev: "
                             "the supervision of a study whose test pairs must wait for its "
                             "registration); default: every pool set")

    @classmethod
    def open(cls, cfg, args) -> "QATask":
        if cfg.train.k > min(cfg.pool_size, cfg.test_pool_size or cfg.pool_size):
            raise ValueError(f"k={cfg.train.k} exceeds the pool of {cfg.pool_size} (test "
                             f"{cfg.test_pool_size or cfg.pool_size}) candidates")
        if cfg.train.supervision.towers != "query":
            raise ValueError("lsr_qa trains the query tower only (train.supervision.towers="
                             "query): a shared encoder would re-embed the whole datastore for "
                             "every variant's test")
        progress = not args.no_progress
        work = pathlib.Path(cfg.workdir) / (cfg.work or args.config)
        work.mkdir(parents=True, exist_ok=True)
        lm, retriever = study_models(cfg.train)
        study = open_study(cfg, retriever, lm, work, progress)
        examples = {n: examples_of(qs) for n, qs in study.pool_sets.items()}
        carry = args.carry or work
        return cls(cfg, args, work, lm, retriever, study, examples, carry,
                   ScoreStore(carry / "lm_scores", scorer_identity(lm)), progress)

    def build_pools(self) -> None:
        self.pools, self.base_res, self.by_id = score_pools(
            self.study, self.examples, self.lm, self.retriever, self.cfg, self.work,
            self.progress, self.store, self.carry,
            tuple(n for n in getattr(self.args, "pool_sets", "").split(",") if n))

    def pools_summary(self) -> list[str]:
        return [f"pool {name}: {len(pool)} questions, {pool.provenance['pairs']} pairs "
                f"({pool.provenance.get('pairs_per_second', '?')} pairs/s)"
                for name, pool in self.pools.items()]

    def diagnostics(self) -> tuple[dict, bool]:
        return {}, False  # the oracle's headroom is measured per fold, in the summary

    def embed_base(self, pools: dict) -> None:
        """The base embeddings of the passages of ``pools`` (name -> (pool, examples)) into
        ``frozen``, once: kept in the work folder (``base_pool_embeddings.npz``, an hour of CPU
        for confirm_recall's pools), so a restart, or a study sharing the work folder, reads
        them back."""
        cache = self.work / "base_pool_embeddings.npz"
        fingerprint = self.retriever.identity["fingerprint"]
        if not self.frozen and cache.is_file():  # read once (folds share it)
            with np.load(cache, allow_pickle=False) as z:
                if str(z["fingerprint"]) == fingerprint:
                    self.frozen.update(zip(z["ids"].tolist(), z["vectors"]))
        known = len(self.frozen)
        for pool, examples in pools.values():
            embed_pool(self.retriever, None, pool, examples, self.by_id, None, self.frozen)
        if len(self.frozen) != known:
            ids = sorted(self.frozen)
            with atomic_path(cache) as tmp, open(tmp, "wb") as f:
                np.savez(f, ids=np.array(ids, np.int64), fingerprint=np.array(fingerprint),
                         vectors=np.stack([self.frozen[i] for i in ids]))

    def folds(self) -> list[Fold]:
        if self.cfg.variant_from:  # a registered config: its variant, by its rule
            self.cfg = registered_variant(self.cfg)
        single = len(self.study.folds) == 1
        out = []
        for f, split in enumerate(self.study.folds):
            built = {s: (n, rows) for s, (n, rows) in split.items() if n in self.pools}
            pools = {s: self.pools[n].subset(rows) for s, (n, rows) in built.items()}
            examples = {s: [self.examples[n][i] for i in rows] for s, (n, rows) in built.items()}
            self.embed_base({s: (pools[s], examples[s]) for s in ("train", "dev")})
            recall = self._dev_recall(f) if self.cfg.train.selection.metric == "recall@1" else None
            run_dir = (self.work if single else self.work / f"fold{f}") / "runs"
            out.append(Fold(f, pools, examples, run_dir, recall))
        return out

    def _dev_recall(self, f: int):
        if self.cfg.recall_dev and self.study.dev_all is None:
            raise ValueError("recall_dev needs a study with dev articles (dataset=squad)")
        dev_qs = (squad.sample_questions(self.study.dev_all, self.cfg.recall_dev, self.cfg.seed)
                  if self.cfg.recall_dev else self.study.questions(f, "dev"))
        dev_gold = np.array([q.paragraph for q in dev_qs])

        def dev_recall(params) -> float:  # the gold paragraph at rank 1 of the whole datastore
            return float(np.mean(retrieve(self.study.store, self.retriever, params, dev_qs,
                                          1).ids[:, 0] == dev_gold))
        return dev_recall

    def measure(self, fold: Fold, params) -> dict:
        return {}

    def choose(self, fold: Fold, runs: dict) -> str:
        return chosen_name(runs)

    def test(self, fold: Fold, runs: dict, chosen: str) -> dict:
        """Per retriever (the base, each run): τ fitted on dev, the end-to-end test
        log-likelihoods, gold-paragraph hits and (base and chosen) greedy answers."""
        cfg, f = self.cfg, fold.index
        test_qs = self.study.questions(f, "test")
        pools, examples = fold.pools, fold.examples
        base_scores = {s: pools[s].branches.scores_NK for s in ("dev", "test")}
        out = {"questions": {s: self.study.questions(f, s) for s in self.study.folds[f]},
               "base_ll": {s: pool_logliks(pools[s], base_scores[s], cfg.train.k)
                           for s in base_scores},
               "oracle": {s: oracle_logliks(pools[s], cfg.train.k) for s in base_scores},
               "tau": {}, "dev_ll": {}, "ll": {}, "hits": {}, "answers": {},
               "test_pool_size": pools["test"].doc_ids_EM.shape[1],
               "runs": runs, "chosen": chosen}
        # EM / F1 on test questions spread evenly over the fold's (article-grouped) list
        n_gen = min(-(-cfg.max_generate // len(self.study.folds)), len(test_qs))
        out["gen_rows"] = np.unique(np.linspace(0, len(test_qs) - 1, n_gen).round().astype(int))
        params = {BASE: None, **{n: run_params(self.retriever, fold, n) for n in runs}}
        out["params"] = params[chosen]
        results = {name: self.retrieval(fold, name, p, base_scores["dev"], out)
                   for name, p in params.items()}
        logprobs = pair_logprobs(results, examples["test"], pools["test"], self.lm, self.by_id,
                                 fold.work, cfg.train.k, self.progress, cfg.part_size, self.store)
        length = pools["test"].branches.token_mask_NT.sum(1)
        for name, res in results.items():
            out["ll"][name] = end_to_end(res, logprobs, length, out["tau"][name], cfg.train.k)
            if out["gen_rows"].size and name in (BASE, chosen):
                self.answers(fold, name, _rows_of(res, out["gen_rows"]), out)
        out["alone"] = np.array([r.total for r in self.lm.score_continuations(
            [e.context for e in examples["test"]], [e.continuation for e in examples["test"]])],
            np.float64)
        return out

    def retrieval(self, fold: Fold, name: str, params, base_dev_scores, out: dict):
        """Retriever ``name``'s τ fitted on the dev pool, its top passages of the fold's test
        questions (the base's are kept) and its hits at each recall cut-off, into ``out``;
        returns the retrieval."""
        cfg, study, pools = self.cfg, self.study, fold.pools
        dev_s = (base_dev_scores if params is None else pool_scores(
            self.retriever, params, pools["dev"], fold.examples["dev"], self.by_id,
            self.frozen))
        out["tau"][name], out["dev_ll"][name] = fit_pool_tau(pools["dev"], dev_s, cfg.train.k,
                                                             cfg.train.selection.tau_grid)
        set_name, rows = study.folds[fold.index]["test"]
        test_qs = study.questions(fold.index, "test")
        res = (_rows_of(self.base_res[set_name], rows) if params is None else
               retrieve(study.store, self.retriever, params, test_qs,
                        max(cfg.train.k, *cfg.recall_ks)))
        gold = np.array([q.paragraph for q in test_qs])
        out["hits"][name] = {r: (res.ids[:, :r] == gold[:, None]).any(1).astype(float)
                             for r in cfg.recall_ks}
        if study.recall_test is not None:  # recall on every test question, LM pool or not
            wide = retrieve(study.store, self.retriever, params, study.recall_test,
                            max(cfg.recall_ks))
            every_gold = np.array([q.paragraph for q in study.recall_test])
            out.setdefault("recall_hits", {})[name] = {
                r: (wide.ids[:, :r] == every_gold[:, None]).any(1).astype(float)
                for r in cfg.recall_ks}
        return res

    def question_file(self) -> dict:
        """The primary endpoint's test questions as a ``replug eval`` file in the work
        folder (:func:`~experiments.lib.lsr_qa_data.write_question_file`)."""
        return write_question_file(self.study.recall_test or self.study.questions(0, "test"),
                                   self.work / "test_questions.jsonl")

    def primary(self, tested: list) -> None:
        """A recall study's primary endpoint alone (``--stage primary``), for ``tested``'s
        (fold, finished runs): every retriever's gold-paragraph hits on every test question
        against the base, clustered by article, as the full test computes them (τ fitted on
        dev alike), written to ``<config>_primary.json`` as a partial result: the
        gatekeeping log-likelihood and so the release rule are not in it."""
        cfg = self.cfg
        if cfg.primary != "recall@1" or len(tested) != 1:
            raise SystemExit("--stage primary: a one-fold study whose primary endpoint is "
                             "recall@1 (its LM-free endpoint)")
        fold, runs = tested[0]
        out = {"tau": {}, "dev_ll": {}, "hits": {}}
        for name in (BASE, *runs):
            params = None if name == BASE else run_params(self.retriever, fold, name)
            self.retrieval(fold, name, params, fold.pools["dev"].branches.scores_NK, out)
        articles = [q.article for q in self.study.questions(fold.index, "test")]
        payload = {"partial": "the primary endpoint alone, computed while the test's LM pairs "
                              "are scored: no log-likelihood gate and no release decision yet",
                   "config": dataclasses.asdict(cfg), "chosen": chosen_name(runs),
                   "recall_test": recall_endpoint(cfg, [out], out["hits"], self.study,
                                                  articles),
                   "tau": out["tau"],
                   "test_questions": self.question_file()}
        if cfg.variant_from:
            payload["variant_rule"] = {"from": cfg.variant_from, "rule": REGISTERED_RULE}
        payload["provenance"] = provenance()
        rec = payload["recall_test"]
        table = [(n, f"{v['1']:.4f}", "" if n == BASE else format_interval(
            rec["vs_base"][n]["1"])) for n, v in rec["recall"].items()]
        write_results("lsr_qa", f"{self.args.config}_primary", payload, table,
                      ("retriever", "test recall@1", "− base [95 % CI, by article]"),
                      notes=f"Partial: {payload['partial']}; {rec['questions']} questions of "
                            f"{rec['articles']} articles.", root=self.args.out,
                      differences=lsr_qa_report.DIFFERENCES[cfg.dataset])

    def answers(self, fold: Fold, name: str, sub, out: dict) -> None:
        """Greedy REPLUG answers with retriever ``name``'s top-k (``sub``: its retrieval of
        the generating rows), kept in the work folder."""
        cfg = self.cfg
        set_name = self.study.folds[fold.index]["test"][0]
        tag = "" if set_name == "test" else f"{set_name}_"  # answers file names
        out["answers"][BASE if name == BASE else "chosen"] = generate_answers(
            self.lm, [fold.examples["test"][i] for i in out["gen_rows"]], sub,
            out["tau"][name], cfg.train.k, cfg.max_new_tokens,
            fold.work / f"answers_{tag}{slug(name).replace(' ', '_')}.json",
            progress=self.progress)

    def summarize(self, tested: list[dict], diagnostics: dict) -> tuple[dict, object]:
        """All folds together (:func:`experiments.lib.lsr_qa_results.across_folds`), the NQ
        transfer where asked, and the pairs the LM scored; the chosen's parameters when
        there is one fold (a release is of one retriever)."""
        cfg = self.cfg
        payload, _, chosen = across_folds(tested, cfg, self.study)
        if cfg.recall_dev:  # the step was selected on these dev questions' recall@1
            payload["questions"]["dev_recall"] = len(self.study.dev_all[:cfg.recall_dev])
        if len(tested) == 1:  # the primary endpoint's questions, for `replug eval`
            payload["test_questions"] = self.question_file()
        if cfg.variant_from:
            payload["variant_rule"] = {"from": cfg.variant_from, "rule": REGISTERED_RULE}
        params = tested[0]["params"] if len(tested) == 1 else None
        if getattr(cfg, "transfer_nq", False) and params is not None:  # reported, not gated
            payload["transfer_nq"] = nq_transfer(cfg, self.retriever, params, self.work,
                                                 self.progress, base=BASE)
        pools = self.pools.values()
        payload.update(lm_pairs_scored=sum(p.provenance["pairs"] for p in pools),
                       pairs_per_second=[p.provenance["pairs_per_second"] for p in pools
                                         if "pairs_per_second" in p.provenance])
        return payload, params

    def card(self, payload: dict) -> tuple[dict, str]:
        return lsr_qa_report.card(self.cfg, self.retriever, payload)

    def report(self, payload: dict) -> None:
        lsr_qa_report.write_report(payload, payload["systems"], self.cfg, self.args,
                                   payload["chosen"])


def main(argv=None):
    run_study(QATask, argv, __doc__, CONFIGS)


if __name__ == "__main__":
    run(main)
