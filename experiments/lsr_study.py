"""REPLUG LSR measured properly (paper §4): pre-scored pools, objectives and temperatures
compared on the same LM scores, and the chosen retriever evaluated end to end.

1. The base retriever's top-``pool_size`` passages for every train / dev / test example, from a
   datastore that never holds the example's own article (``leakage="document"``), are scored
   once by the frozen LM (:func:`replug_jax.train.pool.build_pool`; resumable).
2. For every objective (KL(P_R‖Q) as the paper, KL(Q‖P_R), the marginal likelihood) and
   (γ, β) of the grid: LSR on the train pool for up to ``steps`` steps with a dev curve and
   early stopping (the one trainer, :class:`replug_jax.train.loop.LSRTrainer` on the pools);
   dev and test bits per byte of REPLUG within the pools, each vs the base retriever with a
   paired bootstrap interval.
3. The variant with the best dev value re-embeds the whole datastore (with ``towers="query"``
   the passages keep their base embeddings) and retrieves its top-k for every test example
   from the index (not the pool); those branches are scored and REPLUG's
   test bits per byte compared with the base retriever's (paired interval), with the smallest
   effect the test set could detect (80 % power at the 5 % level).
4. The release rule: the chosen retriever is written to ``release`` (float16 safetensors and a
   model card) only if its interval vs the base excludes zero in its favour.

Usage: ``python -m experiments.lsr_study [--config
default|full|enwiki|enwiki1k|enwiki1k_fresh|tiny] [--set key=value ...]``.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from experiments.lib import lm_datastore, lsr_study_report
from experiments.lib.common import run
from experiments.configs.lsr_study import CONFIGS
from experiments.lib.lsr_common import min_detectable, slug, study_models
from experiments.lib.pool_study import Fold, run_params, run_study
from replug_jax.eval.stats import bpb_difference, format_interval
from replug_jax.fileio import write_json_atomic
from replug_jax.lm.score_store import ScoreStore, scorer_identity
from replug_jax.retrieval.corpus import chunk_documents, leakage_exclusions, read_documents
from replug_jax.retrieval.encoder import Retriever
from replug_jax.retrieval import Index, corpus_text
from replug_jax.train.data import lm_examples
from replug_jax.core.ensemble import bits_per_byte
from replug_jax.train.pool import (
    build_pool,
    embed_pool,
    oracle_logliks,
    pool_logliks,
)
from replug_jax.train.release import passes as release_passes

SPLITS = ("train", "dev", "test")


def _bpb(logliks_E, bytes_E) -> float:
    """Bits per byte of per-example log-likelihoods (the core's, from their totals)."""
    return float(bits_per_byte(np.sum(logliks_E, dtype=np.float64), np.sum(bytes_E)))


def headroom(pools, base_ll, bytes_, cfg, kw) -> dict:
    """The oracle ceiling on the dev and test pools (the LM's own top-k, base λ) against the
    base retriever, with article-clustered intervals, and whether there is anything to learn:
    the oracle better than the base on dev with an interval excluding zero."""
    out = {"oracle_bpb": {}, "oracle_vs_base": {}}
    for s in ("dev", "test"):
        ll = oracle_logliks(pools[s], cfg.train.k, cfg.train.selection.tau)
        out["oracle_bpb"][s] = _bpb(ll, bytes_[s])
        out["oracle_vs_base"][s] = bpb_difference(ll, base_ll[s], bytes_[s], **kw[s])
    out["headroom"] = out["oracle_vs_base"]["dev"]["high"] < 0
    d = out["oracle_vs_base"]["dev"]
    out["verdict"] = (
        f"the oracle (the LM's own top-{cfg.train.k} of each pool) is "
        f"{format_interval(d, 4)} bits per byte from the base retriever on dev; "
        + ("a retriever can gain up to that much here." if out["headroom"] else
           "not better with an interval excluding zero: no retriever trained on these pools "
           "can show a gain, whatever the steps."))
    return out


def _paths(cfg) -> dict:
    """Each split's data file."""
    return {"train": cfg.train_data, "dev": cfg.dev_data, "test": cfg.test_data}


def _examples(cfg, tokenizer) -> dict:
    """Each split's windows: a seeded sample across articles, not the first ones."""
    caps = {"train": cfg.max_train, "dev": cfg.max_dev, "test": cfg.max_test}
    paths = _paths(cfg)
    examples = {s: lm_examples(paths[s], tokenizer, cfg.train.data.context_tokens,
                               cfg.train.data.continuation_tokens) for s in paths}
    for s, cap in caps.items():
        if cap and len(examples[s]) > cap:
            keep = np.sort(np.random.default_rng([cfg.seed, len(s)]).choice(
                len(examples[s]), cap, replace=False))
            examples[s] = [examples[s][i] for i in keep]
    return examples


@dataclasses.dataclass
class WindowsTask:
    """The language-modelling study as a pool-study task (:mod:`experiments.lib.pool_study`):
    the models, the datastore, the windows of each split with their leakage exclusions, and
    the pools the base retriever scored."""
    cfg: object
    args: object
    work: pathlib.Path
    tag: str  # "_<config>" when the trained runs are another config's (work=), else ""
    lm: object
    retriever: Retriever
    passages: list
    by_id: dict  # the passages the pools and the end-to-end test retrieve
    examples: dict
    excluded: dict
    base_index: Index
    texts: list | None  # the passages' texts when the datastore was embedded here
    provenance: dict  # what every pool's LM scores depend on
    store: ScoreStore  # the LM's pair scores, shared by every pool of the work folder
    progress: bool = True
    frozen: dict = dataclasses.field(default_factory=dict)  # towers=query: base embeddings
    # filled by build_pools: per split the pool, the base's REPLUG log-likelihoods and
    # bytes (dev, test), each example's article and the bootstrap's settings
    pools: dict = dataclasses.field(default_factory=dict)
    base_ll: dict = dataclasses.field(default_factory=dict)
    bytes_: dict = dataclasses.field(default_factory=dict)
    articles: dict = dataclasses.field(default_factory=dict)
    kw: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def open(cls, cfg, args) -> "WindowsTask":
        """The LM, the retriever, the datastore (a built index, or the corpus embedded here)
        and each split's windows with their leakage exclusions."""
        if cfg.train.k > cfg.pool_size:
            raise ValueError(f"k={cfg.train.k} exceeds the pool of {cfg.pool_size} candidates")
        work = pathlib.Path(cfg.workdir) / (cfg.work or args.config)
        # work=another config: its pools and trained runs, tested on this config's test data
        # (its test pool and end-to-end pairs in folders named after this config)
        tag = f"_{args.config}" if cfg.work and cfg.work != args.config else ""
        (work / "runs").mkdir(parents=True, exist_ok=True)
        progress = not args.no_progress
        lm, retriever = study_models(cfg.train)
        base_index, texts = None, None
        if cfg.index:  # a built datastore (`replug index build`): only the query tower learns
            if cfg.train.supervision.towers != "query":
                raise ValueError("index= needs train.supervision.towers=query: a shared encoder "
                                 "would re-embed the whole index")
            # enwiki:N (the first N enwiki articles) is indexed once in the work root
            base_index = lm_datastore.open_datastore(
                cfg.index, retriever, lm, cfg.passage_tokens, cache=pathlib.Path(cfg.workdir),
                progress=progress)[0]
            passages, by_id = base_index.passages, {}
        else:
            passages = chunk_documents(read_documents(cfg.corpus), size=cfg.passage_tokens,
                                       unit="tokens", tokenizer=lm.tokenizer)
            by_id = {p.id: p for p in passages}
        examples = _examples(cfg, lm.tokenizer)
        # one pass over the datastore (a store of 220k passages is read once, not per split)
        every = [e for s in SPLITS for e in examples[s]]
        flat = iter(leakage_exclusions(every, passages, cfg.train.data.leakage))
        excluded = {s: [next(flat) for _ in examples[s]] for s in SPLITS}
        if not cfg.index:
            texts = [corpus_text(p) for p in passages]
            base_index = Index.build(retriever.encode_passages(texts), passages,
                                     encoder=retriever.identity)
        prov = {"lm": lm.name, "lm_max_context": lm.max_context,
                "retriever": retriever.identity, "corpus": cfg.index or cfg.corpus,
                "corpus_checksum": base_index.store.checksum,
                "passage_tokens": cfg.passage_tokens, **{
                    name: getattr(cfg.train.data, name)
                    for name in ("context_tokens", "continuation_tokens", "leakage")},
                "separator": "\n\n"}
        return cls(cfg, args, work, tag, lm, retriever, passages, by_id, examples, excluded,
                   base_index, texts, prov, ScoreStore(work / "lm_scores", scorer_identity(lm)),
                   progress)

    def build_pools(self) -> None:
        """The base retriever's top-``pool_size`` of every example, scored by the LM once."""
        cfg = self.cfg
        paths = _paths(cfg)
        for s in paths:
            res = self.base_index.search(self.retriever.encode_queries(
                [e.query for e in self.examples[s]]), cfg.pool_size,
                exclude_ids=self.excluded[s])
            self.by_id.update({p.id: p for ps in res.passages for p in ps})
            folder = self.work / (f"pool_{s}{self.tag}" if s == "test" else f"pool_{s}")
            self.pools[s] = build_pool(
                self.examples[s], res.ids, res.scores, self.by_id, self.lm, folder,
                {**self.provenance, "split": s, "data": paths[s],
                 "examples": [e.id for e in self.examples[s]], "pool_size": cfg.pool_size},
                progress=self.progress, store=self.store)
        self.base_ll = {s: pool_logliks(self.pools[s], self.pools[s].branches.scores_NK,
                                        cfg.train.k, cfg.train.selection.tau)
                        for s in ("dev", "test")}
        self.bytes_ = {s: self.pools[s].branches.bytes_N for s in ("dev", "test")}
        # windows of one article are not independent: intervals resample whole articles
        self.articles = {s: [e.source_id or e.id for e in self.examples[s]]
                         for s in self.examples}
        self.kw = {s: dict(resamples=cfg.bootstrap_resamples, seed=cfg.seed,
                           clusters=(self.articles[s] if len(set(self.articles[s])) > 1
                                     else None))
                   for s in ("dev", "test")}  # one article: its windows are resampled

    def pools_summary(self) -> list[str]:
        return [f"pool {s}: {len(p)} windows, {p.provenance['pairs']} pairs"
                for s, p in self.pools.items()]

    def diagnostics(self) -> tuple[dict, bool]:
        """The oracle's headroom; without it the study stops when the config requires it."""
        out = headroom(self.pools, self.base_ll, self.bytes_, self.cfg, self.kw)
        if out["headroom"]:
            return out, False
        print(f"lsr_study: {out['verdict']}", flush=True)
        if self.cfg.require_headroom:
            write_json_atomic({"config": dataclasses.asdict(self.cfg), "diagnostics": out},
                              self.work / f"diagnostics{self.tag}.json")
            return out, True
        return out, False

    def folds(self) -> list[Fold]:
        return [Fold(0, self.pools, self.examples, self.work / "runs",
                     reuse_only=bool(self.tag))]

    def within_pool(self, params, s: str) -> dict:
        """REPLUG on split ``s`` with ``params``' top-k within each pool, vs the base."""
        doc_tower = ((None, self.frozen) if self.cfg.train.supervision.towers == "query"
                     else ("same", None))
        q, d = embed_pool(self.retriever, params, self.pools[s], self.examples[s], self.by_id,
                          *doc_tower)
        ll = pool_logliks(self.pools[s], np.einsum("ed,emd->em", q, d), self.cfg.train.k,
                          self.cfg.train.selection.tau)
        return {"bpb": _bpb(ll, self.bytes_[s]),
                "vs_base": bpb_difference(ll, self.base_ll[s], self.bytes_[s], **self.kw[s]),
                "logliks": ll.tolist()}

    def measure(self, fold: Fold, params) -> dict:
        return {s: self.within_pool(params, s) for s in ("dev", "test")}

    def choose(self, fold: Fold, runs: dict) -> str:
        """The variant best on dev within the pools (the shuffled-Q control excluded)."""
        return min((n for n in runs if "shuffled-Q" not in n),
                   key=lambda n: runs[n]["dev"]["bpb"])

    def test(self, fold: Fold, runs: dict, chosen: str) -> dict:
        """The chosen retriever's top-k from the whole datastore (re-embedded with its
        parameters; with towers=query the documents keep their base embeddings), scored with
        the pairs the test pool already holds reused, against the base and the LM alone."""
        cfg, retriever, test = self.cfg, self.retriever, self.examples["test"]
        params = run_params(retriever, fold, chosen)
        if self.tag:  # the runs' test values are of the other test set: the chosen's is redone
            for r in runs.values():
                r["test"] = None
            runs[chosen]["test"] = self.within_pool(params, "test")
        index = self.base_index if cfg.train.supervision.towers == "query" else Index.build(
            retriever.encode_passages(self.texts, params), self.passages,
            encoder=retriever.identity)
        res = index.search(retriever.encode_queries([e.query for e in test], params), cfg.train.k,
                           exclude_ids=self.excluded["test"])
        self.by_id.update({p.id: p for ps in res.passages for p in ps})
        # the pairs the test pool holds come from the store: only the others are scored
        held = {(i, int(d)) for (i, _), d in np.ndenumerate(self.pools["test"].doc_ids_EM)}
        full = build_pool(test, res.ids, res.scores, self.by_id, self.lm,
                          self.work / f"extra_test{self.tag}_{slug(chosen)}",
                          {**self.provenance, "split": "test", "retrieved_by": chosen,
                           "examples": [e.id for e in test]},
                          progress=self.progress, store=self.store)
        full.provenance["pairs_reused"] = sum((i, int(d)) in held
                                              for (i, _), d in np.ndenumerate(res.ids) if d >= 0)
        full_ll = pool_logliks(full, full.branches.scores_NK, cfg.train.k, cfg.train.selection.tau)
        alone = np.array([r.logprobs.sum() for r in self.lm.score_continuations(
            [e.context for e in test], [e.continuation for e in test])], np.float64)
        return {"runs": runs, "chosen": chosen, "params": params, "full": full,
                "full_ll": full_ll, "alone": alone}

    def end_to_end_rows(self, full_ll, alone) -> tuple[dict, bool]:
        """LM alone, base and LSR bits per byte on test, the paired differences, the smallest
        detectable effect and the release rule's verdict; and whether the rule passes."""
        base, nbytes, kw = self.base_ll["test"], self.bytes_["test"], self.kw["test"]
        e2e = {"lm_alone_bpb": _bpb(alone, nbytes),
               "base_bpb": _bpb(base, nbytes),
               "lsr_bpb": _bpb(full_ll, nbytes),
               "base_vs_lm_alone": bpb_difference(base, alone, nbytes, **kw),
               "lsr_vs_base": bpb_difference(full_ll, base, nbytes, **kw)}
        e2e["min_detectable_bpb"] = min_detectable(e2e["lsr_vs_base"])
        passes = release_passes(e2e["lsr_vs_base"], higher_is_better=False)  # bits/byte
        e2e["release_rule"] = ("passes: better than the base with an interval excluding zero"
                               if passes else "fails: not better than its base")
        return e2e, passes

    def summarize(self, tested: list[dict], diagnostics: dict) -> tuple[dict, object]:
        """The payload: the end-to-end comparison, every variant's within-pool values and
        every window's log-likelihood under each system; and the chosen's parameters."""
        (t,) = tested
        e2e, passes = self.end_to_end_rows(t["full_ll"], t["alone"])
        pools, examples, base_ll, bytes_ = self.pools, self.examples, self.base_ll, self.bytes_
        full = t["full"]
        pairs = sum(p.provenance["pairs"] for p in pools.values()) + full.provenance["pairs"]
        rates = [p.provenance.get("pairs_per_second") for p in (*pools.values(), full)]
        payload = {
            "config": dataclasses.asdict(self.cfg), "chosen": t["chosen"], "end_to_end": e2e,
            "passes": passes, "diagnostics": diagnostics,
            "examples": {s: len(examples[s]) for s in examples}, "lm_pairs_scored": pairs,
            "end_to_end_pairs_reused": full.provenance["pairs_reused"],
            "pairs_per_second": [r for r in rates if r is not None],
            "base": {s: {"bpb": _bpb(base_ll[s], bytes_[s])} for s in base_ll},
            "variants": {n: {k: v for k, v in r.items() if k != "curve"}
                         | {"curve": r["curve"]} for n, r in t["runs"].items()},
            # every window's log-likelihood under each system, with its id, article and
            # bytes: any difference can be re-bootstrapped (by article) from the JSON
            "per_example": {
                "test": {"ids": [e.id for e in examples["test"]],
                         "articles": self.articles["test"],
                         "bytes": bytes_["test"].tolist(), "lm_alone": t["alone"].tolist(),
                         "base": base_ll["test"].tolist(),
                         "lsr_end_to_end": t["full_ll"].tolist()},
                "dev": {"ids": [e.id for e in examples["dev"]],
                        "articles": self.articles["dev"], "bytes": bytes_["dev"].tolist(),
                        "base": base_ll["dev"].tolist()}}}
        return payload, t["params"]

    def card(self, payload: dict) -> tuple[dict, str]:
        return lsr_study_report.card(self.cfg, payload, len(self.passages),
                                     self.retriever.similarity)

    def report(self, payload: dict) -> None:
        lsr_study_report.report(self.cfg, self.args, payload, len(self.passages),
                                bool(self.tag))


def main(argv=None):
    run_study(WindowsTask, argv, __doc__, CONFIGS)


if __name__ == "__main__":
    run(main)
