"""Figure 4 at laptop scale: perplexity against the number of ensembled documents (1, 2, 5, 10,
20) for retrieved documents and for random ones (the paper's §7.1 control).

The ``default`` config plots bits per byte for k = 1…10 on WikiText-103 test against the enwiki
datastore from Table 1's cached scores (:func:`figure4_datastore`, helpers in
``experiments/table1_lm.py``); the description
below is the earlier ``wikitext2_datastore`` setting.

Each window is scored once with the top-``max(ks)`` retrieved documents and once with
``max(ks)`` random ones; the ensemble with ``k`` documents is then formed from the first ``k``
branches. This is exact, not an approximation: the top-k of the top-20 is the top-k, and
``λ = softmax(s)`` restricted to k documents is the renormalised restriction of the weights
(``retrieval_log_weights`` of the log-weights). Same data and leakage filter as Table 1.
Usage: ``python -m experiments.figure4_num_docs [--config tiny]``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

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
from experiments.table1_lm import (
    DATASTORE_DIFFERENCES,
    article_clusters,
    fmt_level,
    header_notes,
    level,
    ll,
    scored_windows,
)
from replug_jax.core.ensemble import mixture_logprobs, perplexity, retrieval_log_weights
from replug_jax.eval.perplexity import LMEvaluator
from replug_jax.branches import first
from replug_jax.eval.stats import bpb_difference, format_interval
from replug_jax.eval.temperature import cross_fit_logliks
from replug_jax.process import Timer

DIFFERENCES = (
    "The paper's Figure 4 ensembles up to 100 documents with GPT-2/Codex on the Pile. Here: "
    "k up to 20 with SmolLM2-135M on WikiText-2 test windows, the corpus and leakage filter of "
    "Table 1 (see table1_lm/README.md).")


def logliks_by_k(results, ks) -> dict[int, list[float]]:
    """Per-window log-likelihood of the ensemble of each window's first ``k`` branches."""
    out = {}
    for k in ks:
        out[k] = []
        for r in results:
            kk = min(k, len(r.weights))
            log_w = np.asarray(retrieval_log_weights(np.log(np.asarray(r.weights[:kk]))[None]))
            mix = np.asarray(mixture_logprobs(r.branch_logprobs[None, :kk], log_w))[0]
            out[k].append(float(mix.sum()))
    return out


def main(argv=None):
    args, cfg = parse_experiment_args(argv, __doc__, CONFIGS)
    if cfg.datastore != "wikitext2":

        return figure4_datastore(args, cfg)
    ks = sorted(set(cfg.ks))
    lm = load_lm(cfg.lm, cfg.max_context)
    with Timer() as sw:
        docs, passages, settings = wikitext_setup(cfg, lm)
        pipe = build_pipe(cfg, cfg.retriever, lm, passages)
        report = LMEvaluator(docs, settings, modes=("none", "replug", "random"), k=max(ks),
                             batch_size=cfg.batch_size, progress=not args.no_progress,
                             keep_results=True).run(pipe)
    logliks = {mode: logliks_by_k(report["modes"][mode]["results"], ks)
               for mode in ("replug", "random")}
    num_tokens = report["modes"]["none"]["num_tokens"]
    curves = {mode: {k: float(perplexity(sum(v), num_tokens)) for k, v in by_k.items()}
              for mode, by_k in logliks.items()}
    num_bytes = [r.num_bytes for r in report["modes"]["none"]["results"]]
    alone_logliks = [r.loglik for r in report["modes"]["none"]["results"]]
    versus = {mode: {k: bpb_difference(v, alone_logliks, num_bytes, seed=cfg.seed)
                     for k, v in by_k.items()} for mode, by_k in logliks.items()}
    versus["replug_vs_random"] = {k: bpb_difference(logliks["replug"][k], logliks["random"][k],
                                                    num_bytes, seed=cfg.seed) for k in ks}
    alone = report["modes"]["none"]["perplexity"]
    table = [(k, f"{curves['replug'][k]:.3f}", f"{curves['random'][k]:.3f}", f"{alone:.3f}",
              *(format_interval(versus[m][k], 4) for m in ("replug", "random",
                                                           "replug_vs_random")))
             for k in ks]
    payload = {"config": dataclasses.asdict(cfg), "seconds": sw.seconds, "ks": ks,
               "perplexity": {m: {str(k): v for k, v in c.items()} for m, c in curves.items()},
               "perplexity_lm_alone": alone, "windows": report["windows"],
               "bits_per_byte_vs_lm_alone": {m: {str(k): v for k, v in c.items()}
                                             for m, c in versus.items()},
               "tokens": report["modes"]["none"]["num_tokens"],
               "window_settings": report["settings"], "provenance": provenance()}
    out = write_results(
        "figure4_num_docs", args.config, payload, table,
        ("k", "perplexity, retrieved", "perplexity, random", "LM alone",
         "Δ bits/byte retrieved vs LM alone [95 % CI]",
         "Δ bits/byte random vs LM alone [95 % CI]",
         "Δ bits/byte retrieved vs random [95 % CI]"),
        notes=(f"{report['windows']} windows from {len(docs)} WikiText-2 test articles, leakage "
               f"filter '{cfg.leakage}'; LM {cfg.lm}, retriever {cfg.retriever}; "
               f"{sw.seconds:.0f} s. Intervals: paired bootstrap over windows."),
        root=args.out, differences=DIFFERENCES)
    fig, ax = new_figure(figsize=(5, 3.2))
    ax.plot(ks, [curves["replug"][k] for k in ks], "o-", label="retrieved (REPLUG)")
    ax.plot(ks, [curves["random"][k] for k in ks], "s--", label="random documents")
    ax.axhline(alone, color="gray", lw=1, ls=":", label="LM alone")
    ax.set_xscale("log")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("number of ensembled documents k")
    ax.set_ylabel("perplexity")
    ax.legend()
    save_figure(fig, out / f"{args.config}.png")



def figure4_datastore(args, cfg):
    """Figure 4: bits per byte against k for retrieved (τ = 1 and cross-fitted τ) and random
    passages, from the same cached scores as Table 1."""
    ks = sorted(k for k in set(cfg.ks) if k <= cfg.k)
    with Timer() as sw:
        st, scored = scored_windows(cfg, args, ("none", "replug", "random"))
    nbytes = scored["none"].bytes_N.astype(np.float64)
    kw = {"clusters": article_clusters(st.article_of), "seed": cfg.seed}
    alone = ll(scored["none"])
    curves, versus, taus = {}, {}, {}
    for k in ks:
        cross, taus[k] = cross_fit_logliks(first(scored["replug"], k), cfg.tau_folds, cfg.seed,
                                           grid=cfg.tau_grid, groups=st.article_of)
        for name, v in (("retrieved, τ=1", ll(scored["replug"], k=k)),
                        ("retrieved, τ cross-fitted", cross),
                        ("random", ll(scored["random"], k=k))):
            curves.setdefault(name, {})[k] = level(v, nbytes, kw["clusters"], cfg.seed)
            versus.setdefault(name, {})[k] = bpb_difference(v, alone, nbytes, **kw)
        versus.setdefault("retrieved − random", {})[k] = bpb_difference(
            ll(scored["replug"], k=k), ll(scored["random"], k=k), nbytes, **kw)
    level_alone = level(alone, nbytes, kw["clusters"], cfg.seed)
    table = [(k, *(fmt_level(curves[n][k]) for n in curves),
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
        notes=header_notes(cfg, st, sw.seconds)
        + f" LM alone: {fmt_level(level_alone)} bits per byte.",
        root=args.out, differences=DATASTORE_DIFFERENCES)
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


if __name__ == "__main__":
    run(main)
