"""Table 1 and Figure 4 against a real datastore: WikiText-103 test windows, the enwiki sample's
passages, and the format control (``python -m experiments.table1_lm`` and
``python -m experiments.figure4_num_docs`` with the ``default`` config run this).

Rows, each a function of the cached branch log-probs (``experiments/lib/lm_datastore.py``): the LM
alone; REPLUG with the top-k (k = 1…K; τ = 1 as the paper, and τ cross-fitted over article
folds); top-1; k random datastore passages; the concatenation of the top-k; and, for the format
control, REPLUG and random passages from the other WikiText test articles (same format as the
evaluated text, other content). Bits per byte with 95 % intervals bootstrapped over **articles**
(whole articles resampled, 10,000 times); every difference paired on the same windows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments.lib import lm_datastore
from experiments.lib.common import load_lm, new_figure, provenance, save_figure, write_results
from replug_jax.eval.stats import bpb_difference, format_interval
from replug_jax.timing import Timer

DIFFERENCES = (
    "The paper evaluates on the Pile with a Pile-training datastore of 367M documents, "
    "Contriever and GPT-2/GPT-3/OPT/BLOOM. Here: WikiText-103 test (all 60 articles, windows "
    "spread over each) scored by SmolLM2-135M with x = y = 128 tokens and the prior 128 tokens "
    "as query; the datastore is a 10,000-article sample of the May 2015 English Wikipedia "
    "(title-disjoint from the evaluated articles, not content-disjoint: see the leakage line) "
    "in 100-word passages with titles, retrieved by all-MiniLM-L6-v2 (cosine, exact search); "
    "the format control's second datastore is the other WikiText-103 test articles in 128-token "
    "passages. The `wikitext2_datastore` and `tiny` rows are the earlier small in-domain "
    "datastore (WikiText-2 test articles retrieving from each other).")


def _scored(cfg, args, sources):
    lm = load_lm(cfg.lm, cfg.max_context)
    st = lm_datastore.setup(cfg, lm, progress=not args.no_progress)
    return st, lm_datastore.score_windows(cfg, st, sources, progress=not args.no_progress)


def _articles(article_of: np.ndarray):
    """Cluster labels for the bootstrap: whole articles, or the windows themselves when they
    all come from one article."""
    return article_of if len(np.unique(article_of)) > 1 else None


def _level(ll, nbytes, clusters, seed):
    """Bits per byte of one system with its article-clustered interval."""
    return bpb_difference(ll, np.zeros_like(ll), nbytes, clusters=clusters, seed=seed)


def _fmt_level(d: dict) -> str:
    return f"{d['difference']:.4f} [{d['low']:.4f}, {d['high']:.4f}]"


def _header_notes(cfg, st, seconds) -> str:
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


def rows_of(cfg, st, scored) -> tuple[dict, list]:
    """Per-window log-likelihood of every Table 1 row, and the τ chosen per fold."""
    k = cfg.k
    ll = lm_datastore.window_logliks
    tau_N, taus = lm_datastore.fitted_tau(scored["replug"], st.article_of, cfg.tau_grid,
                                          cfg.tau_folds, cfg.seed)
    rows = {"LM alone": ll(scored["none"]),
            f"REPLUG (k={k}, τ=1)": ll(scored["replug"]),
            f"REPLUG (k={k}, τ cross-fitted)": ll(scored["replug"], tau=tau_N),
            "top-1 document": ll(scored["replug"], k=1),
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
        st, scored = _scored(cfg, args, sources)
    rows, taus = rows_of(cfg, st, scored)
    nbytes = scored["none"]["bytes"].astype(np.float64)
    clusters = _articles(st.article_of)
    kw = {"clusters": clusters, "seed": cfg.seed}
    alone = rows["LM alone"]
    levels = {name: _level(v, nbytes, clusters, cfg.seed) for name, v in rows.items()}
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
    table = [(name, _fmt_level(levels[name]),
              f"{100 * (levels[name]['difference'] - base) / base:+.1f} %",
              format_interval(versus[name], 4) if name in versus else "")
             for name in rows]
    notes = (_header_notes(cfg, st, sw.seconds)
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
                        notes=notes, root=args.out, differences=DIFFERENCES)
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


def figure4_datastore(args, cfg):
    """Figure 4: bits per byte against k for retrieved (τ = 1 and cross-fitted τ) and random
    passages, from the same cached scores as Table 1."""
    ks = sorted(k for k in set(cfg.ks) if k <= cfg.k)
    with Timer() as sw:
        st, scored = _scored(cfg, args, ("none", "replug", "random"))
    ll = lm_datastore.window_logliks
    nbytes = scored["none"]["bytes"].astype(np.float64)
    kw = {"clusters": _articles(st.article_of), "seed": cfg.seed}
    alone = ll(scored["none"])
    curves, versus, taus = {}, {}, {}
    for k in ks:
        sub = dict(scored["replug"], branches=np.minimum(scored["replug"]["branches"], k))
        tau_N, taus[k] = lm_datastore.fitted_tau(sub, st.article_of, cfg.tau_grid,
                                                 cfg.tau_folds, cfg.seed)
        for name, v in (("retrieved, τ=1", ll(scored["replug"], k=k)),
                        ("retrieved, τ cross-fitted", ll(sub, tau=tau_N)),
                        ("random", ll(scored["random"], k=k))):
            curves.setdefault(name, {})[k] = _level(v, nbytes, kw["clusters"], cfg.seed)
            versus.setdefault(name, {})[k] = bpb_difference(v, alone, nbytes, **kw)
        versus.setdefault("retrieved − random", {})[k] = bpb_difference(
            ll(scored["replug"], k=k), ll(scored["random"], k=k), nbytes, **kw)
    level_alone = _level(alone, nbytes, kw["clusters"], cfg.seed)
    table = [(k, *(_fmt_level(curves[n][k]) for n in curves),
              *(format_interval(versus[n][k], 4) for n in versus)) for k in ks]
    payload = {"config": dataclasses.asdict(cfg), "seconds": sw.seconds, "ks": ks,
               "bits_per_byte": {n: {str(k): v for k, v in c.items()} for n, c in curves.items()},
               "bits_per_byte_lm_alone": level_alone,
               "bits_per_byte_vs_lm_alone": {n: {str(k): v for k, v in c.items()}
                                             for n, c in versus.items()},
               "tau_per_fold": {str(k): v for k, v in taus.items()},
               "windows": len(st.windows), "leakage": st.leakage,
               "per_window": {"article": st.article_of.tolist(),
                              "bytes": nbytes.astype(int).tolist(),
                              "loglik_lm_alone": np.round(alone, 5).tolist(),
                              "loglik_retrieved_tau1": {
                                  str(k): np.round(ll(scored["replug"], k=k), 5).tolist()
                                  for k in ks}},
               "provenance": provenance()}
    out = write_results(
        "figure4_num_docs", args.config, payload, table,
        ("k", *(f"bits/byte, {n} [95 % CI]" for n in curves),
         *(f"Δ {n} vs LM alone" if "−" not in n else f"Δ {n}" for n in versus)),
        notes=_header_notes(cfg, st, sw.seconds)
        + f" LM alone: {_fmt_level(level_alone)} bits per byte.",
        root=args.out, differences=DIFFERENCES)
    fig, ax = new_figure(figsize=(5.5, 3.4))
    for (name, c), style in zip(curves.items(), ("o-", "^-", "s--")):
        mid = np.array([c[k]["difference"] for k in ks])
        ax.plot(ks, mid, style, label=name)
        ax.fill_between(ks, [c[k]["low"] for k in ks], [c[k]["high"] for k in ks], alpha=0.15)
    ax.axhline(level_alone["difference"], color="gray", lw=1, ls=":", label="LM alone")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("number of ensembled documents k")
    ax.set_ylabel("bits per byte")
    ax.legend(fontsize=8)
    save_figure(fig, out / f"{args.config}.png")
