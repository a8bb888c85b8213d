"""REPLUG LSR on QA, cross-fitted: a retriever the LM taught, tested on questions it never
trained on (pre-registration in ``experiments/configs/lsr_qa.py``; questions, folds and
datastore in :mod:`experiments.lib.lsr_qa_data`).

1. **Datastore**: SQuAD: every SQuAD paragraph (train and the dev articles here); NQ: the 624
   gold passages; plus enwiki passages as distractors, searched exactly as one index
   (:class:`experiments.lib.squad.MergedDatastore`, built in the work folder).
2. **Pools**: each question's top-``pool_size`` passages by the base retriever, scored once
   by the frozen LM (``log p(answer | d ∘ question)`` per token; document KV reuse shares each
   paragraph across the questions that retrieve it; resumable part by part).
3. **Diagnostics at no LM cost**: the oracle ceiling (the LM's own top-k of each pool) against
   the base on dev and test; the shuffled-Q control trained like the first variant.
4. **Training**, in each fold (SQuAD: one, by article; NQ: K by question), on the train pool
   for every objective × (γ, β), early-stopped on dev
   (:func:`replug_jax.train.pool.train_on_pool`, only the query tower learning by default).
5. **Test, end to end**: every retriever (base, each variant) retrieves its top-k for every
   test question from the whole datastore; the pairs the test pool lacks (their union over
   retrievers) are scored once; τ is fitted on the dev pool per retriever; the primary
   endpoint, recall@k and EM/F1 are compared with the base over all folds' test questions,
   intervals bootstrapped over articles (NQ: questions).

``--config confirm`` is the registered confirmatory test of the variant ``default``'s results
pointed to, on questions of SQuAD train articles no split held (reusing ``default``'s pools
and trained variant). ``python -m experiments.lib.lsr_qa_report --config NAME`` rewrites a
finished run's report from its JSON.

Usage: ``python -m experiments.lsr_qa [--config default|confirm|confirm_recall|nq|tiny]
[--set key=value] [--stage pools|all]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import numpy as np

from experiments.lib import lm_datastore
from experiments.lib.common import load_lm, parse_experiment_args, provenance, run
from experiments.configs.lsr_qa import CONFIGS, PRIMARY_ENDPOINT, RECALL_ENDPOINT
from experiments.lib.lsr_common import (
    label,
    min_detectable,
    save_params,
    slug,
    trained_with,
    variants,
)
from experiments.lib.lsr_qa_data import (
    SPLITS,
    base_retrieval,
    examples_of,
    generate_answers,
    nq_transfer,
    open_study,
)
from experiments.lib.lsr_qa_report import chosen_name, release, write_report
from replug_jax.eval.qa import exact_match, f1_score
from replug_jax.eval.stats import paired_bootstrap
from replug_jax.fileio import write_json_atomic
from replug_jax.lm.score_store import ScoreStore, scorer_identity
from replug_jax.retrieval.encoder import Retriever
from replug_jax.timing import Timer
from replug_jax.train.pool import (
    build_pool,
    embed_pool,
    oracle_logliks,
    pool_logliks,
    score_pairs,
    train_on_pool,
)
from replug_jax.train.refresh import unflatten_params
from replug_jax.train.release import passes as release_passes

BASE = "base retriever"


def retrieve(store, retriever, params, questions, k: int):
    return store.search(retriever.encode_queries([q.question for q in questions], params), k)


def fit_tau(pool, scores_EM, k: int, grid) -> tuple[float, float]:
    """(τ, dev mean log-likelihood at τ): the τ of ``grid`` that maximises REPLUG's mean dev
    log-likelihood of the retriever's top-k within the dev pools."""
    means = [float(np.mean(pool_logliks(pool, scores_EM, k, t))) for t in grid]
    best = int(np.argmax(means))
    return float(grid[best]), means[best]


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
    scored = {"lp": lp, "length": length_E, "branches": (res.ids[:, :k] >= 0).sum(1),
              "scores": res.scores[:, :k]}
    return lm_datastore.window_logliks(scored, tau=tau)


def compare(a, b, articles, cfg) -> dict:
    """Mean of ``a`` − mean of ``b`` over the same questions, 95 % interval resampling whole
    articles (questions, if they all come from one article)."""
    return paired_bootstrap(np.asarray(a, np.float64), np.asarray(b, np.float64),
                            clusters=articles if len(set(articles)) > 1 else None,
                            resamples=cfg.bootstrap_resamples, seed=cfg.seed)


def score_pools(study, examples, lm, retriever, cfg, work, progress, store, carry):
    """Each pool set's pools (its questions' top-``pool_size`` by the base retriever, kept in
    ``carry``, scored once by the LM through the content-keyed ``store``), the base retrieval
    and the passages by id."""
    by_id, pools, base_res = {}, {}, {}
    roles = [(n, s == "test") for f in study.folds for s, (n, _) in f.items()]
    test_only = {n for n, t in roles if t} - {n for n, t in roles if not t}
    for name, qs in study.pool_sets.items():
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


def train_variants(cfg, retriever, pools, examples, by_id, frozen, run_dir, progress,
                   dev_recall=None) -> dict:
    """Every variant trained on the fold's train pool, early-stopped on its dev pool or on
    ``dev_recall(params)`` (or read back from ``run_dir`` when an earlier run trained it with
    the same settings)."""
    runs = {}
    for v in variants(cfg):
        name = label(v)
        out = run_dir / f"{slug(name)}.json"
        params_file = out.with_suffix(".npz")
        if not (out.exists() and trained_with(json.loads(out.read_text()).get("config"), v)):
            fit = train_on_pool(retriever, pools["train"], examples["train"], pools["dev"],
                                examples["dev"], by_id, v, progress=progress,
                                frozen_docs=frozen, dev_recall=dev_recall)
            save_params(fit["params"], params_file, {"variant": name})
            write_json_atomic({"config": vars(v), "best_step": fit["best_step"],
                               "steps_run": fit["steps_run"], "curve": fit["curve"],
                               "seconds": round(fit["seconds"], 1)}, out)
        runs[name] = json.loads(out.read_text())
        runs[name]["params"] = unflatten_params(
            dict(np.load(params_file, allow_pickle=False)), retriever.params)
    return runs


def run_fold(f, study, cfg, lm, retriever, pools_all, examples_all, base_all, by_id, frozen,
             work, progress, store=None) -> dict:
    """Train and test one fold: per retriever, τ fitted on dev, the end-to-end test
    log-likelihoods, gold-paragraph hits and (base and chosen) greedy answers."""
    split = study.folds[f]
    pools = {s: pools_all[n].subset(rows) for s, (n, rows) in split.items()}
    examples = {s: [examples_all[n][i] for i in rows] for s, (n, rows) in split.items()}
    test_qs = study.questions(f, "test")
    for s in ("train", "dev"):
        embed_pool(retriever, None, pools[s], examples[s], by_id, None, frozen)
    base_scores = {s: pools[s].branches.scores_NK for s in ("dev", "test")}
    out = {"questions": {s: study.questions(f, s) for s in split},
           "base_ll": {s: pool_logliks(pools[s], base_scores[s], cfg.k) for s in base_scores},
           "oracle": {s: oracle_logliks(pools[s], cfg.k) for s in base_scores},
           "tau": {}, "dev_ll": {}, "ll": {}, "hits": {}, "answers": {},
           "test_pool_size": pools["test"].doc_ids_EM.shape[1]}
    (work / "runs").mkdir(parents=True, exist_ok=True)
    dev_qs = study.questions(f, "dev")
    dev_gold = np.array([q.paragraph for q in dev_qs])

    def dev_recall(params) -> float:  # the gold paragraph at rank 1 of the whole datastore
        return float(np.mean(retrieve(study.store, retriever, params, dev_qs, 1).ids[:, 0]
                             == dev_gold))

    runs = train_variants(cfg, retriever, pools, examples, by_id, frozen, work / "runs",
                          progress, dev_recall if cfg.select_on == "recall@1" else None)
    out["runs"], out["chosen"] = runs, chosen_name(runs)
    # EM / F1 on test questions spread evenly over the fold's (article-grouped) list
    n_gen = min(-(-cfg.max_generate // len(study.folds)), len(test_qs))
    out["gen_rows"] = np.unique(np.linspace(0, len(test_qs) - 1, n_gen).round().astype(int))
    gold = np.array([q.paragraph for q in test_qs])
    base_test = base_all[split["test"][0]]
    tag = "" if split["test"][0] == "test" else f"{split['test'][0]}_"  # answers file names
    results = {}
    for name, params in {BASE: None, **{n: r["params"] for n, r in runs.items()}}.items():
        dev_s = (base_scores["dev"] if params is None else
                 pool_scores(retriever, params, pools["dev"], examples["dev"], by_id, frozen))
        out["tau"][name], out["dev_ll"][name] = fit_tau(pools["dev"], dev_s, cfg.k,
                                                        cfg.tau_grid)
        rows = split["test"][1]
        results[name] = res = (
            dataclasses.replace(base_test, ids=base_test.ids[rows],
                                scores=base_test.scores[rows],
                                passages=[base_test.passages[i] for i in rows])
            if params is None else retrieve(study.store, retriever, params, test_qs,
                                            max(cfg.k, *cfg.recall_ks)))
        out["hits"][name] = {r: (res.ids[:, :r] == gold[:, None]).any(1).astype(float)
                             for r in cfg.recall_ks}
        if study.recall_test is not None:  # recall on every test question, LM pool or not
            wide = retrieve(study.store, retriever, params, study.recall_test,
                            max(cfg.recall_ks))
            every_gold = np.array([q.paragraph for q in study.recall_test])
            out.setdefault("recall_hits", {})[name] = {
                r: (wide.ids[:, :r] == every_gold[:, None]).any(1).astype(float)
                for r in cfg.recall_ks}
    logprobs = pair_logprobs(results, examples["test"], pools["test"], lm, by_id, work, cfg.k,
                             progress, cfg.part_size, store)
    length = pools["test"].branches.token_mask_NT.sum(1)
    for name, res in results.items():
        out["ll"][name] = end_to_end(res, logprobs, length, out["tau"][name], cfg.k)
        if out["gen_rows"].size and name in (BASE, out["chosen"]):
            g = out["gen_rows"]
            sub = dataclasses.replace(res, ids=res.ids[g], scores=res.scores[g],
                                      passages=[res.passages[i] for i in g])
            out["answers"][BASE if name == BASE else "chosen"] = generate_answers(
                lm, [examples["test"][i] for i in g], sub, out["tau"][name], cfg.k,
                cfg.max_new_tokens, work / f"answers_{tag}{slug(name).replace(' ', '_')}.json",
                progress=progress)
    out["alone"] = np.array([r.total for r in lm.score_continuations(
        [e.context for e in examples["test"]], [e.continuation for e in examples["test"]])],
        np.float64)
    return out


def _stage_arg(ap) -> None:
    ap.add_argument("--stage", choices=("pools", "all"), default="all",
                    help="pools: build the datastore and score every pool (resumable), then "
                         "stop before any training; all: the whole study")
    ap.add_argument("--carry", type=pathlib.Path, default=None, metavar="DIR",
                    help="where the study keeps what is costly to make and small to keep "
                         "(default: the work folder): DIR/lm_scores, the LM's pair scores "
                         "keyed by their text (pairs found there are never scored again), and "
                         "DIR/retrievals, the base retriever's top passages of each pool set; "
                         "copy or commit it to resume the scoring on another machine without "
                         "encoding the datastore again")


def main(argv=None):
    args, cfg = parse_experiment_args(argv, __doc__, CONFIGS, extra=_stage_arg)
    if cfg.k > min(cfg.pool_size, cfg.test_pool_size or cfg.pool_size):
        raise ValueError(f"k={cfg.k} exceeds the pool of {cfg.pool_size} (test "
                         f"{cfg.test_pool_size or cfg.pool_size}) candidates")
    if cfg.towers != "query":
        raise ValueError("lsr_qa trains the query tower only (towers=query): a shared encoder "
                         "would re-embed the whole datastore for every variant's test")
    progress = not args.no_progress
    work = pathlib.Path(cfg.workdir) / (cfg.work or args.config)
    work.mkdir(parents=True, exist_ok=True)
    with Timer() as sw:
        lm = load_lm(cfg.lm, cfg.lm_max_context)
        retriever = Retriever.load(cfg.retriever)
        study = open_study(cfg, retriever, lm, work, progress)
        examples = {n: examples_of(qs) for n, qs in study.pool_sets.items()}
        carry = args.carry or work
        store = ScoreStore(carry / "lm_scores", scorer_identity(lm))
        pools, base_res, by_id = score_pools(study, examples, lm, retriever, cfg, work,
                                             progress, store, carry)
        if args.stage == "pools":
            for name, pool in pools.items():
                print(f"pool {name}: {len(pool)} questions, {pool.provenance['pairs']} pairs "
                      f"({pool.provenance.get('pairs_per_second', '?')} pairs/s)")
            return
        frozen: dict = {}  # base embeddings of the pool passages, encoded once
        single = len(study.folds) == 1
        folds = [run_fold(f, study, cfg, lm, retriever, pools, examples, base_res, by_id,
                          frozen, work if single else work / f"fold{f}", progress, store)
                 for f in range(len(study.folds))]
    payload, rows, chosen = summarize(folds, cfg, study)
    if getattr(cfg, "transfer_nq", False) and len(folds) == 1:  # reported, not gated
        payload["transfer_nq"] = nq_transfer(cfg, retriever, folds[0]["runs"][chosen]["params"],
                                             work, progress, base=BASE)
    payload.update(lm_pairs_scored=sum(p.provenance["pairs"] for p in pools.values()),
                   pairs_per_second=[p.provenance["pairs_per_second"] for p in pools.values()
                                     if "pairs_per_second" in p.provenance],
                   seconds=sw.seconds, provenance=provenance())
    if payload["passes"] and cfg.release and single:
        payload["released"] = str(release(retriever, folds[0]["runs"][chosen]["params"], cfg,
                                          chosen, rows, payload))
    write_report(payload, rows, cfg, args, chosen)


def recall_endpoint(cfg, folds: list[dict], hits: dict, study, art: list) -> dict:
    """The primary endpoint of a recall study: recall@r on every test question
    (``study.recall_test``, or the LM's test questions), each retriever against the base,
    clustered by article."""
    hits_all = folds[0].get("recall_hits") or {n: hits[n] for n in hits}
    wide_art = [q.article for q in study.recall_test] if study.recall_test is not None else art
    return {"questions": len(wide_art), "articles": len(set(wide_art)),
            "recall": {n: {str(r): float(h[r].mean()) for r in cfg.recall_ks}
                       for n, h in hits_all.items()},
            "vs_base": {n: {str(r): compare(h[r], hits_all[BASE][r], wide_art, cfg)
                            for r in cfg.recall_ks}
                        for n, h in hits_all.items() if n != BASE}}


def answer_scores(folds: list[dict], test_qs: list, art: list, cfg) -> dict:
    """EM / F1 of the base's and the chosen retriever's generated answers on the test rows
    that generated, and chosen − base (clustered by article) when both did."""
    qa, offset, gen = {}, 0, []
    for f in folds:
        gen += (offset + f["gen_rows"]).tolist()
        offset += len(f["questions"]["test"])
    refs = [test_qs[i].answers for i in gen]
    for who in (BASE, "chosen"):
        preds = [a for f in folds for a in f["answers"].get(who, [])]
        if len(preds) == len(gen) and gen:
            qa[who] = {"em": [exact_match(p, a) for p, a in zip(preds, refs)],
                       "f1": [f1_score(p, a) for p, a in zip(preds, refs)],
                       "predictions": preds, "test_rows": gen}
    if len(qa) == 2:
        qa["chosen_vs_base"] = {m: compare(qa["chosen"][m], qa[BASE][m], [art[i] for i in gen],
                                           cfg) for m in ("em", "f1")}
    return qa


def release_rule_text(passes: bool, gated: bool, margin: float) -> str:
    """The release rule's verdict in words (``gated``: the log-likelihood's lower bound must
    also stay above −margin)."""
    if passes:
        return ("passes: the chosen retriever beats its base with a 95 % interval excluding "
                "zero" + (" and its gold-answer log-likelihood's lower bound is above "
                          f"−{margin:g} nats" if gated else ""))
    return ("fails: not better than its base with an interval excluding zero"
            + (", or the gold-answer log-likelihood's lower bound is below "
               f"−{margin:g} nats" if gated else "") + "; nothing is released")


def summarize(folds: list[dict], cfg, study) -> tuple[dict, dict, str]:
    """All folds' test questions together: per retriever its rows, the primary endpoint
    (the variant chosen on dev in each fold − the base), the diagnostics and EM / F1."""
    cat = lambda key, name: np.concatenate([f[key][name] for f in folds])  # noqa: E731
    test_qs = [q for f in folds for q in f["questions"]["test"]]
    art = [q.article for q in test_qs]
    names = list(folds[0]["ll"])
    ll = {n: cat("ll", n) for n in names}
    hits = {n: {r: np.concatenate([f["hits"][n][r] for f in folds]) for r in cfg.recall_ks}
            for n in names}
    picks = [f["chosen"] for f in folds]
    chosen = picks[0] if len(set(picks)) == 1 else "chosen on dev in each fold"
    if chosen not in ll:  # the folds chose different variants: their choices together
        ll[chosen] = np.concatenate([f["ll"][c] for f, c in zip(folds, picks)])
        hits[chosen] = {r: np.concatenate([f["hits"][c][r] for f, c in zip(folds, picks)])
                        for r in cfg.recall_ks}
        for f, c in zip(folds, picks):
            f["tau"][chosen], f["dev_ll"][chosen] = f["tau"][c], f["dev_ll"][c]
    rows = {}
    for n in ll:
        rows[n] = {"tau_per_fold": [f["tau"][n] for f in folds],
                   "dev_loglik": float(np.mean([f["dev_ll"][n] for f in folds])),
                   "test_loglik": float(np.mean(ll[n])),
                   **{f"recall@{r}": float(h.mean()) for r, h in hits[n].items()}}
        if len(folds) == 1:
            rows[n]["tau"] = folds[0]["tau"][n]
        if n != BASE:
            rows[n]["vs_base"] = compare(ll[n], ll[BASE], art, cfg)
            for r in cfg.recall_ks:
                rows[n][f"recall@{r}_vs_base"] = compare(hits[n][r], hits[BASE][r], art, cfg)
    primary = rows[chosen]["vs_base"]
    passes = release_passes(primary, higher_is_better=True)
    wide = None
    if getattr(cfg, "primary", "loglik") == "recall@1":
        wide = recall_endpoint(cfg, folds, hits, study, art)
        gate = rows[chosen]["vs_base"]
        primary = wide["vs_base"][chosen]["1"]
        passes = release_passes(primary, higher_is_better=True) and \
            gate["low"] > -cfg.loglik_margin
    dev_art = [q.article for f in folds for q in f["questions"]["dev"]]
    headroom = {"dev": compare(cat("oracle", "dev"), cat("base_ll", "dev"), dev_art, cfg),
                "test": compare(cat("oracle", "test"), cat("base_ll", "test"), art, cfg)
                if all(f["test_pool_size"] > cfg.k for f in folds) else None}  # else: no room
    qa = answer_scores(folds, test_qs, art, cfg)
    runs = {(n if len(folds) == 1 else f"fold {i}: {n}"): {k: v for k, v in r.items()
                                                         if k != "params"}
            for i, f in enumerate(folds) for n, r in f["runs"].items()}
    payload = {
        "config": vars(cfg), "chosen": chosen, "recall_test": wide,
        "primary_endpoint": (PRIMARY_ENDPOINT if wide is None else RECALL_ENDPOINT),
        "chosen_per_fold": picks, "primary": primary,
        "min_detectable_nats": min_detectable(primary),
        "detectable_effect_stated": cfg.detectable_effect, "passes": passes,
        "release_rule": release_rule_text(passes, wide is not None, cfg.loglik_margin),
        "systems": rows, "oracle_vs_base": headroom,
        "lm_alone_test_loglik": float(np.concatenate([f["alone"] for f in folds]).mean()),
        "qa": qa, "folds": len(folds),
        "questions": {s: sum(len(f["questions"][s]) for f in folds) for s in SPLITS},
        "questions_per_fold": {s: [len(f["questions"][s]) for f in folds] for s in SPLITS},
        "articles": {s: len({q.article for f in folds for q in f["questions"][s]})
                     for s in SPLITS},
        "datastore_passages": len(study.store), "runs": runs,
        "per_example": {"test": {
            "ids": [q.id for q in test_qs], "articles": art,
            "lm_alone": np.concatenate([f["alone"] for f in folds]).tolist(),
            "loglik": {n: np.round(v, 5).tolist() for n, v in ll.items()},
            "hits": {n: {str(r): h.astype(int).tolist() for r, h in hs.items()}
                     for n, hs in hits.items()}}}}
    return payload, rows, chosen


if __name__ == "__main__":
    run(main)
