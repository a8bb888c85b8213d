"""REPLUG LSR measured properly (paper §4): pre-scored pools, objectives and temperatures
compared on the same LM scores, and the chosen retriever evaluated end to end.

1. The base retriever's top-``pool_size`` passages for every train / dev / test example, from a
   datastore that never holds the example's own article (``leakage="document"``), are scored
   once by the frozen LM (:func:`replug_jax.train.pool.build_pool`; resumable).
2. For every objective (KL(P_R‖Q) as the paper, KL(Q‖P_R), the marginal likelihood) and
   (γ, β) of the grid: LSR on the train pool for up to ``steps`` steps with a dev curve and
   early stopping (:func:`replug_jax.train.pool.train_on_pool`); dev and test bits per byte of
   REPLUG within the pools, each vs the base retriever with a paired bootstrap interval.
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
import json
import math
import pathlib

import numpy as np

from experiments.lib import lm_datastore
from experiments.lib.common import (
    load_lm,
    new_figure,
    parse_experiment_args,
    provenance,
    run,
    save_figure,
    write_results,
)
from experiments.configs.lsr_study import CONFIGS
from experiments.lib.lsr_common import (
    label,
    min_detectable,
    pool_reusing,
    save_params,
    slug,
    trained_with,
    variants,
    write_release,
)
from replug_jax.eval.stats import bpb_difference, format_interval
from replug_jax.fileio import write_json_atomic
from replug_jax.retrieval.corpus import chunk_documents, leakage_exclusions, read_documents
from replug_jax.retrieval.encoder import Retriever
from replug_jax.retrieval import Index, corpus_text
from replug_jax.timing import Timer
from replug_jax.train.data import lm_examples
from replug_jax.train.pool import (
    bits_per_byte,
    build_pool,
    embed_pool,
    oracle_logliks,
    pool_logliks,
    train_on_pool,
)
from replug_jax.train.refresh import unflatten_params
from replug_jax.train.release import passes as release_passes

DIFFERENCES = (
    "The paper trains Contriever from GPT-3 Curie on 800K Pile sequences (x, y = 128 tokens; "
    "k = 20 from the whole index, refreshed every 3K of 25K steps, batch 64). Here "
    "all-MiniLM-L6-v2 learns from SmolLM2-135M at the scale 2 CPU cores allow (each "
    "section's config is in its JSON); retrieval during training is the top-k within each "
    "example's pre-scored pool of the base retriever's top-M (the pool stands in for the "
    "index; the current query embedding re-ranks it at every step), only the query tower is "
    "trained between refreshes (documents from the last refresh, as the paper's stale index), "
    "and the final comparison retrieves from the whole datastore.")


def setting(cfg) -> tuple[str, str]:
    """``(windows, datastore)``: what the config's windows and datastore are, in words (the
    notes state them: the default's WikiText-2 and the enwiki configs differ)."""
    if cfg.index:
        n = cfg.index.split(":", 1)[1] if cfg.index.startswith("enwiki:") else None
        store = (f"the first {n} enwiki-sample articles in 100-word passages"
                 if n else f"the index `{cfg.index}`")
        store += ", embedded once by the base retriever (only the query tower learns)"
    else:
        store = f"`{cfg.corpus}` in {cfg.passage_tokens}-token passages, re-embedded"
    windows = (f"(x, y = {cfg.context_tokens} tokens) of `{cfg.train_data}`, "
               f"`{cfg.dev_data}` and `{cfg.test_data}` (disjoint articles)")
    return windows, store


def headroom(pools, base_ll, bytes_, cfg, kw) -> dict:
    """The oracle ceiling on the dev and test pools (the LM's own top-k, base λ) against the
    base retriever, with article-clustered intervals, and whether there is anything to learn:
    the oracle better than the base on dev with an interval excluding zero."""
    out = {"oracle_bpb": {}, "oracle_vs_base": {}}
    for s in ("dev", "test"):
        ll = oracle_logliks(pools[s], cfg.k, cfg.eval_temperature)
        out["oracle_bpb"][s] = bits_per_byte(ll, bytes_[s])
        out["oracle_vs_base"][s] = bpb_difference(ll, base_ll[s], bytes_[s], **kw[s])
    out["headroom"] = out["oracle_vs_base"]["dev"]["high"] < 0
    d = out["oracle_vs_base"]["dev"]
    out["verdict"] = (
        f"the oracle (the LM's own top-{cfg.k} of each pool) is "
        f"{format_interval(d, 4)} bits per byte from the base retriever on dev; "
        + ("a retriever can gain up to that much here." if out["headroom"] else
           "not better with an interval excluding zero: no retriever trained on these pools "
           "can show a gain, whatever the steps."))
    return out


@dataclasses.dataclass
class Study:
    """What every stage of a study reads: the models, the datastore, the examples of each
    split with their leakage exclusions, and the pools the base retriever scored."""
    cfg: object
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
    progress: bool = True
    frozen: dict = dataclasses.field(default_factory=dict)  # towers=query: base embeddings
    # filled by build_pools: per split the pool, the base's REPLUG log-likelihoods and
    # bytes (dev, test), each example's article and the bootstrap's settings
    pools: dict = dataclasses.field(default_factory=dict)
    base_ll: dict = dataclasses.field(default_factory=dict)
    bytes_: dict = dataclasses.field(default_factory=dict)
    articles: dict = dataclasses.field(default_factory=dict)
    kw: dict = dataclasses.field(default_factory=dict)

    def build_pools(self) -> None:
        """The base retriever's top-``pool_size`` of every example, scored by the LM once."""
        cfg = self.cfg
        paths = {"train": cfg.train_data, "dev": cfg.dev_data, "test": cfg.test_data}
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
                progress=self.progress)
        self.base_ll = {s: pool_logliks(self.pools[s], self.pools[s].branches.scores_NK,
                                        cfg.k, cfg.eval_temperature) for s in ("dev", "test")}
        self.bytes_ = {s: self.pools[s].branches.bytes_N for s in ("dev", "test")}
        # windows of one article are not independent: intervals resample whole articles
        self.articles = {s: [e.source_id or e.id for e in self.examples[s]]
                         for s in self.examples}
        self.kw = {s: dict(resamples=cfg.bootstrap_resamples, seed=cfg.seed,
                           clusters=(self.articles[s] if len(set(self.articles[s])) > 1
                                     else None))
                   for s in ("dev", "test")}  # one article: its windows are resampled

    def within_pool(self, params, s: str) -> dict:
        """REPLUG on split ``s`` with ``params``' top-k within each pool, vs the base."""
        doc_tower = (None, self.frozen) if self.cfg.towers == "query" else ("same", None)
        q, d = embed_pool(self.retriever, params, self.pools[s], self.examples[s], self.by_id,
                          *doc_tower)
        ll = pool_logliks(self.pools[s], np.einsum("ed,emd->em", q, d), self.cfg.k,
                          self.cfg.eval_temperature)
        return {"bpb": bits_per_byte(ll, self.bytes_[s]),
                "vs_base": bpb_difference(ll, self.base_ll[s], self.bytes_[s], **self.kw[s]),
                "logliks": ll.tolist()}


def open_study(cfg, work: pathlib.Path, tag: str, progress: bool) -> Study:
    """The LM, the retriever, the datastore (a built index, or the corpus embedded here) and
    each split's examples (a seeded sample across articles) with their leakage exclusions."""
    lm = load_lm(cfg.lm, cfg.lm_max_context)
    retriever = Retriever.load(cfg.retriever, max_length=cfg.doc_max_length,
                               query_max_length=cfg.query_max_length)
    base_index, texts = None, None
    if cfg.index:  # a built datastore (`replug index build`): only the query tower learns
        if cfg.towers != "query":
            raise ValueError("index= needs towers=query: a shared encoder would re-embed "
                             "the whole index")
        # enwiki:N (the first N enwiki articles) is indexed once in the work root
        base_index = lm_datastore.open_datastore(
            cfg.index, retriever, lm, cfg.passage_tokens, cache=pathlib.Path(cfg.workdir),
            progress=progress)[0]
        passages, by_id = base_index.passages, {}
    else:
        passages = chunk_documents(read_documents(cfg.corpus), size=cfg.passage_tokens,
                                   unit="tokens", tokenizer=lm.tokenizer)
        by_id = {p.id: p for p in passages}
    caps = {"train": cfg.max_train, "dev": cfg.max_dev, "test": cfg.max_test}
    paths = {"train": cfg.train_data, "dev": cfg.dev_data, "test": cfg.test_data}
    examples = {s: lm_examples(paths[s], lm.tokenizer, cfg.context_tokens,
                               cfg.continuation_tokens) for s in paths}
    for s, cap in caps.items():  # a seeded sample across articles, not the first ones
        if cap and len(examples[s]) > cap:
            keep = np.sort(np.random.default_rng([cfg.seed, len(s)]).choice(
                len(examples[s]), cap, replace=False))
            examples[s] = [examples[s][i] for i in keep]
    # one pass over the datastore (a store of 220k passages is read once, not per split)
    every = [e for s in paths for e in examples[s]]
    flat = iter(leakage_exclusions(every, passages, cfg.leakage))
    excluded = {s: [next(flat) for _ in examples[s]] for s in paths}
    if not cfg.index:
        texts = [corpus_text(p) for p in passages]
        base_index = Index.build(retriever.encode_passages(texts), passages,
                                 encoder=retriever.identity)
    prov = {"lm": lm.name, "lm_max_context": lm.max_context, "retriever": retriever.identity,
            "corpus": cfg.index or cfg.corpus, "corpus_checksum": base_index.store.checksum,
            "passage_tokens": cfg.passage_tokens, "context_tokens": cfg.context_tokens,
            "continuation_tokens": cfg.continuation_tokens, "leakage": cfg.leakage,
            "separator": "\n\n"}
    return Study(cfg, work, tag, lm, retriever, passages, by_id, examples, excluded,
                 base_index, texts, prov, progress)


def train_variants(study: Study) -> dict:
    """Every variant trained on the train pool (or its finished run reloaded), with its
    within-pool dev and test values; the best on dev so far keeps its parameters in
    ``best_params.npz``."""
    cfg, work, results = study.cfg, study.work, {}
    best_file = work / "best_params.npz"
    for v in variants(cfg):
        name = label(v)
        out = work / "runs" / f"{slug(name)}.json"
        if out.exists() and trained_with(json.loads(out.read_text()).get("config"), v):
            results[name] = json.loads(out.read_text())
            if study.tag:  # its test values are of the other test set: only the chosen's
                results[name]["test"] = None  # is recomputed (its parameters are kept)
            continue
        if study.tag:
            raise ValueError(f"{work}: no trained run of {name}; run --config {cfg.work} "
                             "first (work= reuses its runs)")
        fit = train_on_pool(study.retriever, study.pools["train"], study.examples["train"],
                            study.pools["dev"], study.examples["dev"], study.by_id, v,
                            progress=study.progress, frozen_docs=study.frozen)
        row = {"config": vars(v), "best_step": fit["best_step"],
               "steps_run": fit["steps_run"], "seconds": round(fit["seconds"], 1),
               "curve": fit["curve"]}
        for s in ("dev", "test"):
            row[s] = study.within_pool(fit["params"], s)
        best_so_far = min((r["dev"]["bpb"] for n, r in results.items()
                           if "shuffled-Q" not in n), default=math.inf)
        if not v.shuffle_q and (row["dev"]["bpb"] < best_so_far or not best_file.exists()):
            save_params(fit["params"], best_file, {"variant": name})
        results[name] = row
        write_json_atomic(row, out)
    return results


def chosen_params(study: Study, results: dict):
    """``(name, parameters)`` of the variant best on dev (the shuffled-Q control excluded)."""
    chosen = min((n for n in results if "shuffled-Q" not in n),
                 key=lambda n: results[n]["dev"]["bpb"])
    best_file = study.work / "best_params.npz"
    if json.loads(best_file.with_suffix(".json").read_text())["variant"] != chosen:
        raise ValueError(f"{best_file} holds another variant than the best on dev "
                         f"({chosen}); delete {study.work / 'runs'} and rerun")
    params = unflatten_params(dict(np.load(best_file, allow_pickle=False)),
                              study.retriever.params)
    return chosen, params


def end_to_end(study: Study, params, chosen: str):
    """The chosen retriever's top-k from the whole datastore (re-embedded with its parameters;
    with towers=query the documents keep their base embeddings), scored with the pairs the
    test pool already holds reused: ``(pool of those branches, their log-likelihoods, the LM
    alone's)``."""
    cfg, retriever, test = study.cfg, study.retriever, study.examples["test"]
    index = study.base_index if cfg.towers == "query" else Index.build(
        retriever.encode_passages(study.texts, params), study.passages,
        encoder=retriever.identity)
    res = index.search(retriever.encode_queries([e.query for e in test], params), cfg.k,
                       exclude_ids=study.excluded["test"])
    study.by_id.update({p.id: p for ps in res.passages for p in ps})
    full = pool_reusing(study.pools["test"], test, res.ids, res.scores, study.by_id, study.lm,
                        study.work / f"extra_test{study.tag}_{slug(chosen)}",
                        {**study.provenance, "split": "test", "retrieved_by": chosen,
                         "examples": [e.id for e in test]},
                        progress=study.progress)
    full_ll = pool_logliks(full, full.branches.scores_NK, cfg.k, cfg.eval_temperature)
    alone = np.array([r.logprobs.sum() for r in study.lm.score_continuations(
        [e.context for e in test], [e.continuation for e in test])], np.float64)
    return full, full_ll, alone


def end_to_end_rows(study: Study, full_ll, alone) -> tuple[dict, bool]:
    """LM alone, base and LSR bits per byte on test, the paired differences, the smallest
    detectable effect and the release rule's verdict; and whether the rule passes."""
    base, nbytes, kw = study.base_ll["test"], study.bytes_["test"], study.kw["test"]
    e2e = {"lm_alone_bpb": bits_per_byte(alone, nbytes),
           "base_bpb": bits_per_byte(base, nbytes),
           "lsr_bpb": bits_per_byte(full_ll, nbytes),
           "base_vs_lm_alone": bpb_difference(base, alone, nbytes, **kw),
           "lsr_vs_base": bpb_difference(full_ll, base, nbytes, **kw)}
    e2e["min_detectable_bpb"] = min_detectable(e2e["lsr_vs_base"])
    passes = release_passes(e2e["lsr_vs_base"], higher_is_better=False)  # bits/byte
    e2e["release_rule"] = ("passes: better than the base with an interval excluding zero"
                           if passes else "fails: not better than its base")
    return e2e, passes


def notes(study: Study, payload: dict, full, chosen: str) -> str:
    cfg, ex, e2e = study.cfg, study.examples, payload["end_to_end"]
    windows, store = setting(cfg)
    return (
        f"Within-pool REPLUG bits per byte (top-{cfg.k} of each example's base top-"
        f"{cfg.pool_size}, τ = {cfg.eval_temperature}), {len(ex['train'])} train / "
        f"{len(ex['dev'])} dev / {len(ex['test'])} test windows {windows}; the "
        f"datastore, {store}, never yields the evaluated article."
        + (f" The trained runs are `{cfg.work}`'s, reused (their within-pool test values "
           "belong to its test set: only the chosen variant's is shown here)." if study.tag
           else "")
        + " Lower is better; "
        f"intervals: paired bootstrap over articles (windows of one article resampled "
        f"together), {cfg.bootstrap_resamples} resamples. Every window's log-likelihood is "
        f"in the JSON (`per_example`, the variants' `logliks`). LM pairs scored: "
        f"{payload['lm_pairs_scored']} "
        f"({', '.join(f'{r:.2f}' for r in payload['pairs_per_second'])} pairs/s; the "
        f"end-to-end test took {full.provenance['pairs_reused']} of its pairs from the test "
        f"pool).\n\n"
        f"**End to end** (the chosen variant, {chosen}, by dev; top-{cfg.k} from the whole "
        f"datastore, {len(study.passages):,} passages): LM alone {e2e['lm_alone_bpb']:.4f}, "
        f"REPLUG with the base retriever {e2e['base_bpb']:.4f} "
        f"({format_interval(e2e['base_vs_lm_alone'], 4)} vs LM alone), REPLUG LSR "
        f"{e2e['lsr_bpb']:.4f} ({format_interval(e2e['lsr_vs_base'], 4)} vs base). Smallest "
        f"effect this test set detects (80 % power, 5 % level): "
        f"{e2e['min_detectable_bpb']:.4f} bits per byte. Release rule: {e2e['release_rule']}."
        f"\n\n**Before training** (no LM cost): {payload['diagnostics']['verdict']}")


def main(argv=None):
    args, cfg = parse_experiment_args(argv, __doc__, CONFIGS)
    if cfg.k > cfg.pool_size:
        raise ValueError(f"k={cfg.k} exceeds the pool of {cfg.pool_size} candidates")
    work = pathlib.Path(cfg.workdir) / (cfg.work or args.config)
    # work=another config: its pools and trained runs, tested on this config's test data
    # (its test pool and end-to-end pairs in folders named after this config)
    tag = f"_{args.config}" if cfg.work and cfg.work != args.config else ""
    (work / "runs").mkdir(parents=True, exist_ok=True)
    with Timer() as sw:
        study = open_study(cfg, work, tag, not args.no_progress)
        study.build_pools()
        diagnostics = headroom(study.pools, study.base_ll, study.bytes_, cfg, study.kw)
        if not diagnostics["headroom"]:
            print(f"lsr_study: {diagnostics['verdict']}", flush=True)
            if cfg.require_headroom:
                write_json_atomic({"config": vars(cfg), "diagnostics": diagnostics},
                                  work / f"diagnostics{tag}.json")
                return
        results = train_variants(study)
        chosen, params = chosen_params(study, results)
        if tag:
            results[chosen]["test"] = study.within_pool(params, "test")
        full, full_ll, alone = end_to_end(study, params, chosen)
    e2e, passes = end_to_end_rows(study, full_ll, alone)
    pools, examples, base_ll, bytes_ = study.pools, study.examples, study.base_ll, study.bytes_
    pairs = sum(p.provenance["pairs"] for p in pools.values()) + full.provenance["pairs"]
    rates = [p.provenance.get("pairs_per_second") for p in (*pools.values(), full)]
    payload = {"config": vars(cfg), "chosen": chosen, "end_to_end": e2e,
               "diagnostics": diagnostics,
               "examples": {s: len(examples[s]) for s in examples},
               "lm_pairs_scored": pairs,
               "end_to_end_pairs_reused": full.provenance["pairs_reused"],
               "pairs_per_second": [r for r in rates if r is not None],
               "base": {s: {"bpb": bits_per_byte(base_ll[s], bytes_[s])} for s in base_ll},
               "variants": {n: {k: v for k, v in r.items() if k != "curve"}
                            | {"curve": r["curve"]} for n, r in results.items()},
               # every window's log-likelihood under each system, with its id, article and
               # bytes: any difference can be re-bootstrapped (by article) from the JSON
               "per_example": {
                   "test": {"ids": [e.id for e in examples["test"]],
                            "articles": study.articles["test"],
                            "bytes": bytes_["test"].tolist(), "lm_alone": alone.tolist(),
                            "base": base_ll["test"].tolist(),
                            "lsr_end_to_end": full_ll.tolist()},
                   "dev": {"ids": [e.id for e in examples["dev"]],
                           "articles": study.articles["dev"], "bytes": bytes_["dev"].tolist(),
                           "base": base_ll["dev"].tolist()}},
               "seconds": sw.seconds, "provenance": provenance()}
    table = [("base retriever", "—", "—", f"{payload['base']['dev']['bpb']:.4f}",
              f"{payload['base']['test']['bpb']:.4f}", "—", "—")]
    for n, r in results.items():
        test = r["test"]  # None: a run of another config's, tested there (work=)
        table.append((n, f"{r['steps_run']}", f"{r['best_step']}", f"{r['dev']['bpb']:.4f}",
                      f"{test['bpb']:.4f}" if test else "—",
                      format_interval(r["dev"]["vs_base"], 4),
                      format_interval(test["vs_base"], 4) if test else "—"))
    if passes and cfg.release:
        release(study.retriever, params, cfg, chosen, payload, len(study.passages))
    out = write_results("lsr_study", args.config, payload, table,
                        ("variant", "steps run", "best step", "dev BPB", "test BPB",
                         "dev Δ vs base [95 % CI]", "test Δ vs base [95 % CI]"),
                        notes=notes(study, payload, full, chosen), root=args.out,
                        differences=DIFFERENCES)
    plot(results, payload, out / f"{args.config}.png")


def plot(results: dict, payload: dict, path: pathlib.Path) -> None:
    fig, ax = new_figure(figsize=(6, 3.5))
    for name, r in results.items():
        steps = [c["step"] for c in r["curve"]]
        ax.plot(steps, [c["dev_bpb"] for c in r["curve"]], marker="o", ms=3, label=name)
    ax.axhline(payload["base"]["dev"]["bpb"], color="k", ls="--", lw=1, label="base")
    ax.set_xlabel("LSR step")
    ax.set_ylabel("dev bits per byte (within pool)")
    ax.legend(fontsize=6)
    save_figure(fig, path)


def release(retriever, params, cfg, chosen: str, payload: dict, passages: int) -> None:
    """Write the chosen retriever (float16 safetensors, ``replug.json``) with a model card
    that leads with its end-to-end result and states how it was trained and tested
    (``payload``: the study's results, as in its JSON)."""
    settings = {"similarity": retriever.similarity, "query_max_length": cfg.query_max_length,
                "doc_max_length": cfg.doc_max_length, "trained_from": cfg.retriever}
    e2e, row, n = payload["end_to_end"], payload["variants"][chosen], payload["examples"]
    windows, store = setting(cfg)
    d = e2e["lsr_vs_base"]
    card = "\n".join([
        f"# REPLUG LSR retriever: `{cfg.retriever}` trained from `{cfg.lm}` (language "
        "modelling)", "",
        f"Better than its base on held-out test articles: {format_interval(d, 4)} bits per "
        f"byte (REPLUG, top-{cfg.k} from the whole datastore of {passages:,} passages, paired "
        f"95 % interval over {d.get('clusters', '?')} articles; the smallest effect this test "
        f"detects at 80 % power is {e2e['min_detectable_bpb']:.4f}).", "",
        f"- test, {n['test']} windows: LM alone {e2e['lm_alone_bpb']:.4f}, REPLUG with the base "
        f"retriever {e2e['base_bpb']:.4f}, with this one {e2e['lsr_bpb']:.4f} bits per byte",
        f"- trained by REPLUG LSR ({chosen}; best dev step {row['best_step']} of "
        f"{row['steps_run']} run, batch {cfg.batch_size}, Adam {cfg.learning_rate:g}) on "
        f"{n['train']} train windows, selected among the objectives and temperatures on "
        f"{n['dev']} dev windows; windows {windows}",
        f"- retrieval during training: the top-{cfg.k} of each window's base top-"
        f"{cfg.pool_size}, scored once by the LM; datastore: {store}",
        "- made by `python -m experiments.lsr_study`; every number, with each window's "
        "log-likelihood, is in `experiments/results/lsr_study/`", ""])
    if cfg.towers == "query":  # the trained query encoder beside the base passage encoder
        card += ("\nQuery tower only: the passage encoder is the base (`passage_encoder/`), "
                 f"so an index built with `{cfg.retriever}` serves it. Load both with "
                 "`Retriever.load(<this folder>)`, or the query encoder with "
                 "`SentenceTransformer(<this folder>)` and the passage encoder with "
                 "`SentenceTransformer(<this folder>/passage_encoder)`.\n")
    else:
        card += "\nLoad with `Retriever.load(<this folder>)` or `SentenceTransformer`.\n"
    write_release(retriever, params, cfg.release, settings, card, towers=cfg.towers)

if __name__ == "__main__":
    run(main)
