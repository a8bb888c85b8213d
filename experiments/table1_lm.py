"""Table 1 at laptop scale: bits per UTF-8 byte of the LM alone, + REPLUG, + REPLUG LSR, + the
random-document ensemble, + concatenation of the k documents.

The ``default`` config evaluates WikiText-103 test against a real datastore
(:func:`main_datastore`): WikiText-103 test windows, the enwiki sample's 221k passages, and the
format control. Rows, each a function of the cached branch log-probs
(``experiments/lib/lm_datastore.py``): the LM alone; REPLUG with the top-k (k = 1…K; τ = 1 as
the paper, and τ cross-fitted over article folds); top-1; k random datastore passages; the
concatenation of the top-k; and, for the format control, REPLUG and random passages from the
other WikiText test articles (same format as the evaluated text, other content). Bits per byte
with 95 % intervals bootstrapped over **articles** (whole articles resampled, 10,000 times);
every difference paired on the same windows (``experiments/figure4_num_docs.py`` draws
Figure 4 from the same scores).

The earlier setting (the ``wikitext2_datastore`` config and ``tiny``): WikiText-2 test
articles evaluated with sliding windows (``replug_jax.eval.perplexity``); the retrieval corpus
is 128-token passages of WikiText-2 test itself, and the leakage filter removes every passage of
the evaluated article (``leakage="document"``, the default; ``window`` hides only the passages
overlapping the window). Each row's difference from the LM alone comes with a paired bootstrap
interval over windows. Usage:
``python -m experiments.table1_lm [--config tiny] [--set k=5 num_documents=8]``.
"""

from __future__ import annotations

import dataclasses

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
from experiments.configs.table1_lm import CONFIGS
from experiments.lib.datasets import build_pipe, wikitext_setup
from replug_jax.branches import first, mixture_logliks
from replug_jax.eval.perplexity import LMEvaluator
from replug_jax.eval.stats import bpb_difference, format_interval
from replug_jax.eval.temperature import cross_fit_logliks
from replug_jax.process import Timer

WIKITEXT2_DIFFERENCES = (
    "The paper evaluates on the Pile with a 367M-document Pile training corpus, Contriever and "
    "GPT-2/GPT-3/OPT/BLOOM, top-10 documents. Here: the first articles of WikiText-2 test, a "
    "retrieval corpus of 128-token passages of WikiText-2 test itself (no disjoint training "
    "corpus is available offline) with the leakage filter excluding every passage of the article "
    "being evaluated (leakage='document'), all-MiniLM-L6-v2 as retriever and SmolLM2-135M as LM. "
    "The corpus therefore holds the other WikiText-2 test articles, not a web-scale corpus, and "
    "a few windows per article are evaluated.")


DATASTORE_DIFFERENCES = (
    "The paper evaluates on the Pile with a Pile-training datastore of 367M documents, "
    "Contriever and GPT-2/GPT-3/OPT/BLOOM. Here: WikiText-103 test (all 60 articles, windows "
    "spread over each) scored by SmolLM2-135M with x = y = 128 tokens and the prior 128 tokens "
    "as query; the datastore is a 10,000-article sample of the May 2015 English Wikipedia "
    "(title-disjoint from the evaluated articles, not content-disjoint: see the leakage line) "
    "in 100-word passages with titles, retrieved by all-MiniLM-L6-v2 (cosine, exact search); "
    "the format control's second datastore is the other WikiText-103 test articles in 128-token "
    "passages. The `wikitext2_datastore` and `tiny` rows are the earlier small in-domain "
    "datastore (WikiText-2 test articles retrieving from each other).")


# -- the WikiText-2 setting ----------------------------------------------------------------------

def per_window(rows: dict, a: str, b: str):
    """Per-window log-likelihoods of modes ``a`` and ``b`` and the windows' byte counts."""
    res_a, res_b = rows[a]["results"], rows[b]["results"]
    return ([r.loglik for r in res_a], [r.loglik for r in res_b], [r.num_bytes for r in res_a])


def differences(rows: dict, base: str) -> dict:
    """Bits per byte of every mode minus ``base``'s, with paired bootstrap intervals."""
    return {mode: bpb_difference(*per_window(rows, mode, base))
            for mode in rows if mode != base}


def main(argv=None):
    args, cfg = parse_experiment_args(argv, __doc__, CONFIGS)
    if cfg.datastore != "wikitext2":
        return main_datastore(args, cfg)
    lm = load_lm(cfg.lm, cfg.max_context)
    with Timer() as sw:
        docs, passages, settings = wikitext_setup(cfg, lm)
        pipe = build_pipe(cfg, cfg.retriever, lm, passages)
        evaluator = LMEvaluator(docs, settings, modes=cfg.modes, batch_size=cfg.batch_size,
                                progress=not args.no_progress, keep_results=True)
        report = evaluator.run(pipe)
        rows = dict(report["modes"])
        if cfg.lsr_retriever:
            lsr = build_pipe(cfg, cfg.lsr_retriever, lm, passages)
            rows["replug_lsr"] = dataclasses.replace(evaluator, modes=("replug",)).run(
                lsr)["modes"]["replug"]
    base = rows["none"]["bits_per_byte"] if "none" in rows else None
    versus = differences(rows, "none") if "none" in rows else {}
    table = []
    for mode, r in rows.items():
        change = (f"{100 * (r['bits_per_byte'] - base) / base:+.1f} %"
                  if base is not None else "")
        table.append((mode, f"{r['bits_per_byte']:.4f}", change,
                      format_interval(versus[mode], 4) if mode in versus else "",
                      f"{r['perplexity']:.2f}", r["num_tokens"], r["num_bytes"],
                      int(r["cost"].get("lm_calls", 0))))
    pairs = {"replug_vs_random": ("replug", "random"),
             "replug_lsr_vs_replug": ("replug_lsr", "replug")}
    for name, (a, b) in pairs.items():
        if a in rows and b in rows:
            versus[name] = bpb_difference(*per_window(rows, a, b), seed=cfg.seed)
    window_bytes = [r.num_bytes for r in next(iter(rows.values()))["results"]]
    per_window_logliks = {mode: [r.loglik for r in rows[mode].pop("results")] for mode in rows}
    payload = {"config": dataclasses.asdict(cfg), "seconds": sw.seconds,
               "windows": report["windows"], "documents": [d.title for d in docs],
               "corpus_passages": len(passages),
               "mean_excluded_passages": report["mean_excluded_passages"],
               "window_settings": report["settings"], "results": rows,
               "bits_per_byte_vs_lm_alone": versus, "per_window_loglik": per_window_logliks,
               "per_window_bytes": window_bytes,
               "provenance": provenance()}
    out = write_results(
        "table1_lm", args.config, payload, table,
        ("mode", "bits per byte", "vs LM alone", "Δ bits/byte vs LM alone [95 % CI]",
         "perplexity", "tokens", "bytes", "LM rows"),
        notes=(f"{report['windows']} windows of {cfg.stride} tokens from {len(docs)} WikiText-2 "
               f"test articles; context {cfg.context_tokens}, query {cfg.query_tokens} tokens, "
               f"first {cfg.skip_first} tokens of each article context only; leakage filter "
               f"'{cfg.leakage}' (mean {report['mean_excluded_passages']:.1f} passages excluded "
               f"per window); corpus {len(passages)} passages of {cfg.passage_tokens} tokens; "
               f"k={cfg.k}, τ={cfg.temperature}; LM {cfg.lm}, retriever {cfg.retriever}; "
               f"{sw.seconds:.0f} s. Intervals: paired bootstrap over windows (10,000 "
               f"resamples)"
               + "".join(f"; {label}: {format_interval(versus[name], 4)} bits/byte"
                         for name, label in (("replug_vs_random", "REPLUG − random documents"),
                                             ("replug_lsr_vs_replug", "REPLUG LSR − REPLUG"))
                         if name in versus) + "."),
        root=args.out, differences=WIKITEXT2_DIFFERENCES)
    fig, ax = new_figure(figsize=(5.5, 3))
    names = list(rows)
    ax.barh(names, [rows[m]["bits_per_byte"] for m in names], color="tab:blue")
    ax.set_xlabel("bits per UTF-8 byte (lower is better)")
    ax.set_xlim(min(rows[m]["bits_per_byte"] for m in names) * 0.95,
                max(rows[m]["bits_per_byte"] for m in names) * 1.02)
    ax.set_title(f"WikiText-2 test, {report['windows']} windows, k={cfg.k}")
    save_figure(fig, out / f"{args.config}.png")



# -- the real datastore (the default) -----------------------------------------------------------

def scored_windows(cfg, args, sources):
    lm = load_lm(cfg.lm, cfg.max_context)
    st = lm_datastore.setup(cfg, lm, progress=not args.no_progress)
    return st, lm_datastore.score_windows(cfg, st, sources, progress=not args.no_progress)


def article_clusters(article_of: np.ndarray):
    """Cluster labels for the bootstrap: whole articles, or the windows themselves when they
    all come from one article."""
    return article_of if len(np.unique(article_of)) > 1 else None


def level(ll, nbytes, clusters, seed):
    """Bits per byte of one system with its article-clustered interval."""
    return bpb_difference(ll, np.zeros_like(ll), nbytes, clusters=clusters, seed=seed)


def fmt_level(d: dict) -> str:
    return f"{d['difference']:.4f} [{d['low']:.4f}, {d['high']:.4f}]"


def header_notes(cfg, st, seconds) -> str:
    leak = st.leakage
    return (f"{len(st.windows)} windows of {cfg.stride} tokens from {len(st.documents)} "
            f"{cfg.eval_text} test articles (at most "
            f"{int(np.bincount(st.article_of).max())} per article); context "
            f"{cfg.context_tokens}, query {cfg.query_tokens} tokens; datastore "
            f"`{cfg.datastore}` ({st.datastore_passages:,} passages), control datastore "
            f"`{cfg.control_datastore or '-'}` ({st.control_passages:,} passages, the evaluated "
            f"article excluded); LM {cfg.lm}, retriever {cfg.retriever}; {seconds:.0f} s. "
            f"Leakage: {100 * leak['windows_with_a_leaking_passage']:.1f} % of windows share a "
            f"word {leak['ngram']}-gram with some datastore passage (mean "
            f"{leak['leaking_passages_per_window']:.2f} passages per window); those passages "
            f"are {'removed from' if cfg.drop_leaking else 'kept in'} retrieval. Intervals: "
            "95 %, bootstrap over articles (10,000 resamples), paired.")


def ll(branches, k: int | None = None, tau: float = 1.0) -> np.ndarray:
    """Per-window log-likelihoods of the mixture of each window's first ``k`` branches."""
    return mixture_logliks(branches if k is None else first(branches, k), tau)


def rows_of(cfg, st, scored) -> tuple[dict, list]:
    """Per-window log-likelihood of every Table 1 row, and the τ chosen per fold."""
    k, replug = cfg.k, scored["replug"]
    cross, taus = cross_fit_logliks(replug, cfg.tau_folds, cfg.seed, grid=cfg.tau_grid,
                                    groups=st.article_of)
    rows = {"LM alone": ll(scored["none"]),
            f"REPLUG (k={k}, τ=1)": ll(replug),
            f"REPLUG (k={k}, τ cross-fitted)": cross,
            "top-1 document": ll(replug, k=1),
            f"random datastore passages (k={k})": ll(scored["random"]),
            f"concatenation of the top-{k}": ll(scored["concat"])}
    if "control_replug" in scored:
        kc = lm_datastore.source_k(cfg, "control_replug")
        if kc != k:  # the datastore's rows at the control's k: the first kc branches
            rows[f"REPLUG (k={kc}, τ=1)"] = ll(scored["replug"], k=kc)
            rows[f"random datastore passages (k={kc})"] = ll(scored["random"], k=kc)
        rows[f"REPLUG on WikiText test articles (k={kc})"] = ll(scored["control_replug"])
        rows[f"random WikiText test passages (k={kc})"] = ll(scored["control_random"])
    return rows, taus


def main_datastore(args, cfg):
    sources = [s for s in lm_datastore.SOURCES
               if cfg.control_datastore or not s.startswith("control")]
    with Timer() as sw:
        st, scored = scored_windows(cfg, args, sources)
    rows, taus = rows_of(cfg, st, scored)
    nbytes = scored["none"].bytes_N.astype(np.float64)
    clusters = article_clusters(st.article_of)
    kw = {"clusters": clusters, "seed": cfg.seed}
    alone = rows["LM alone"]
    levels = {name: level(v, nbytes, clusters, cfg.seed) for name, v in rows.items()}
    versus = {name: bpb_difference(v, alone, nbytes, **kw)
              for name, v in rows.items() if name != "LM alone"}
    k = cfg.k
    replug, random = rows[f"REPLUG (k={k}, τ=1)"], rows[f"random datastore passages (k={k})"]
    pairs = {"REPLUG − random datastore passages": bpb_difference(replug, random, nbytes, **kw),
             "REPLUG τ cross-fitted − REPLUG τ=1": bpb_difference(
                 rows[f"REPLUG (k={k}, τ cross-fitted)"], replug, nbytes, **kw),
             "REPLUG − concatenation": bpb_difference(
                 replug, rows[f"concatenation of the top-{k}"], nbytes, **kw)}
    if cfg.control_datastore:  # format × content, every system at the control's k
        kc = lm_datastore.source_k(cfg, "control_replug")
        wt_replug = rows[f"REPLUG on WikiText test articles (k={kc})"]
        wt_random = rows[f"random WikiText test passages (k={kc})"]
        ds_replug = rows[f"REPLUG (k={kc}, τ=1)" if kc != k else f"REPLUG (k={k}, τ=1)"]
        ds_random = rows[f"random datastore passages (k={kc})"]
        pairs |= {f"format (k={kc}): random WikiText − random datastore passages":
                  bpb_difference(wt_random, ds_random, nbytes, **kw),
                  f"content, datastore (k={kc}): REPLUG − random datastore passages":
                  bpb_difference(ds_replug, ds_random, nbytes, **kw),
                  f"content, WikiText (k={kc}): REPLUG − random WikiText passages":
                  bpb_difference(wt_replug, wt_random, nbytes, **kw),
                  f"REPLUG datastore − REPLUG WikiText (k={kc})":
                  bpb_difference(ds_replug, wt_replug, nbytes, **kw)}
    base = levels["LM alone"]["difference"]
    table = [(name, fmt_level(levels[name]),
              f"{100 * (levels[name]['difference'] - base) / base:+.1f} %",
              format_interval(versus[name], 4) if name in versus else "")
             for name in rows]
    notes = (header_notes(cfg, st, sw.seconds)
             + f" τ cross-fitted over {cfg.tau_folds} article folds from {list(cfg.tau_grid)}: "
             f"chosen {taus}.\n\nPaired differences (bits per byte, 95 % CI over articles):\n\n"
             + "\n".join(f"- {name}: {format_interval(d, 4)}" for name, d in pairs.items()))
    payload = {"config": dataclasses.asdict(cfg), "seconds": sw.seconds,
               "windows": len(st.windows), "articles": [d.title for d in st.documents],
               "datastore_passages": st.datastore_passages,
               "control_passages": st.control_passages, "leakage": st.leakage,
               "bits_per_byte": levels, "bits_per_byte_vs_lm_alone": versus,
               "paired_differences": pairs, "tau_per_fold": taus,
               "per_window": {"article": st.article_of.tolist(),
                              "window": [[w.source_id, *w.target_span] for w in st.windows],
                              "bytes": nbytes.astype(int).tolist(),
                              "loglik": {n: np.round(v, 5).tolist() for n, v in rows.items()}},
               "provenance": provenance()}
    out = write_results("table1_lm", args.config, payload, table,
                        ("row", "bits per byte [95 % CI]", "vs LM alone",
                         "Δ bits/byte vs LM alone [95 % CI]"),
                        notes=notes, root=args.out, differences=DATASTORE_DIFFERENCES)
    fig, ax = new_figure(figsize=(6.5, 3.4))
    names = list(rows)[::-1]
    mid = [levels[n]["difference"] for n in names]
    err = np.array([[levels[n]["difference"] - levels[n]["low"] for n in names],
                    [levels[n]["high"] - levels[n]["difference"] for n in names]])
    ax.barh(names, mid, xerr=err, color="tab:blue", capsize=3)
    ax.set_xlim(min(levels[n]["low"] for n in names) * 0.97,
                max(levels[n]["high"] for n in names) * 1.01)
    ax.set_xlabel("bits per UTF-8 byte (lower is better), 95 % CI over articles")
    ax.set_title(f"{cfg.eval_text} test, {len(st.windows)} windows, "
                 f"{len(np.unique(st.article_of))} articles")
    save_figure(fig, out / f"{args.config}.png")


if __name__ == "__main__":
    run(main)
