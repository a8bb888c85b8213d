"""The QA study's numbers across folds (``lsr_qa``): each retriever against the base with
article-clustered intervals, the recall endpoint on every test question, EM / F1, and the
release rule."""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments.configs.lsr_qa import PRIMARY_ENDPOINT, RECALL_ENDPOINT
from experiments.lib.lsr_common import min_detectable
from experiments.lib.lsr_qa_data import SPLITS
from replug_jax.eval.qa import exact_match, f1_score
from replug_jax.eval.stats import paired_bootstrap
from replug_jax.train.release import passes as release_passes

BASE = "base retriever"


def compare(a, b, articles, cfg) -> dict:
    """Mean of ``a`` − mean of ``b`` over the same questions, 95 % interval resampling whole
    articles (questions, if they all come from one article)."""
    return paired_bootstrap(np.asarray(a, np.float64), np.asarray(b, np.float64),
                            clusters=articles if len(set(articles)) > 1 else None,
                            resamples=cfg.bootstrap_resamples, seed=cfg.seed)


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


def _pooled(folds: list[dict], cfg) -> tuple[str, list, dict, dict]:
    """The chosen name (one variant, or "chosen on dev in each fold"), the folds' choices, and
    every retriever's test log-likelihoods and hits over all folds' questions together."""
    names = list(folds[0]["ll"])
    ll = {n: np.concatenate([f["ll"][n] for f in folds]) for n in names}
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
    return chosen, picks, ll, hits


def _rows(folds, cfg, ll: dict, hits: dict, art: list) -> dict:
    """A row per retriever: τ per fold, dev and test log-likelihoods, recall@k, and (not the
    base) its differences from the base."""
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
    return rows


def across_folds(folds: list[dict], cfg, study) -> tuple[dict, dict, str]:
    """All folds' test questions together: per retriever its rows, the primary endpoint
    (the variant chosen on dev in each fold − the base), the diagnostics and EM / F1."""
    cat = lambda key, name: np.concatenate([f[key][name] for f in folds])  # noqa: E731
    test_qs = [q for f in folds for q in f["questions"]["test"]]
    art = [q.article for q in test_qs]
    chosen, picks, ll, hits = _pooled(folds, cfg)
    rows = _rows(folds, cfg, ll, hits, art)
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
                if all(f["test_pool_size"] > cfg.train.k for f in folds) else None}  # else: no room
    runs = {(n if len(folds) == 1 else f"fold {i}: {n}"): r
            for i, f in enumerate(folds) for n, r in f["runs"].items()}
    alone = np.concatenate([f["alone"] for f in folds])
    payload = {
        "config": dataclasses.asdict(cfg), "chosen": chosen, "recall_test": wide,
        "primary_endpoint": (PRIMARY_ENDPOINT if wide is None else RECALL_ENDPOINT),
        "chosen_per_fold": picks, "primary": primary,
        "min_detectable_nats": min_detectable(primary),
        "detectable_effect_stated": cfg.detectable_effect, "passes": passes,
        "release_rule": release_rule_text(passes, wide is not None, cfg.loglik_margin),
        "systems": rows, "oracle_vs_base": headroom,
        "lm_alone_test_loglik": float(alone.mean()),
        "qa": answer_scores(folds, test_qs, art, cfg), "folds": len(folds),
        "questions": {s: sum(len(f["questions"][s]) for f in folds) for s in SPLITS},
        "questions_per_fold": {s: [len(f["questions"][s]) for f in folds] for s in SPLITS},
        "articles": {s: len({q.article for f in folds for q in f["questions"][s]})
                     for s in SPLITS},
        "datastore_passages": len(study.store), "runs": runs,
        "per_example": {"test": {
            "ids": [q.id for q in test_qs], "articles": art, "lm_alone": alone.tolist(),
            "loglik": {n: np.round(v, 5).tolist() for n, v in ll.items()},
            "hits": {n: {str(r): h.astype(int).tolist() for r, h in hs.items()}
                     for n, hs in hits.items()}}}}
    return payload, rows, chosen
