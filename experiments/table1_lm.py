"""Table 1 at laptop scale: bits per UTF-8 byte of the LM alone, + REPLUG, + REPLUG LSR, + the
random-document ensemble, + concatenation of the k documents.

The ``default`` config evaluates WikiText-103 test against a Wikipedia datastore (the enwiki
sample's 221k passages; see ``experiments/table1_datastore.py``). The earlier setting below is
the ``wikitext2_datastore`` config (a small in-domain datastore) and ``tiny``.

Earlier setting: WikiText-2 test articles evaluated with sliding windows
(``replug_jax.eval.perplexity``); the retrieval corpus is 128-token passages of WikiText-2 test
itself, and the leakage filter removes every passage of the evaluated article
(``leakage="document"``, the default; ``window`` hides only the passages overlapping the
window). Each row's difference from the LM alone comes with a paired bootstrap interval over
windows. Usage:
``python -m experiments.table1_lm [--config tiny] [--set k=5 num_documents=8]``.
"""

from __future__ import annotations

import dataclasses

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
from replug_jax.eval.perplexity import LMEvaluator
from replug_jax.eval.stats import bpb_difference, format_interval
from replug_jax.timing import Timer

DIFFERENCES = (
    "The paper evaluates on the Pile with a 367M-document Pile training corpus, Contriever and "
    "GPT-2/GPT-3/OPT/BLOOM, top-10 documents. Here: the first articles of WikiText-2 test, a "
    "retrieval corpus of 128-token passages of WikiText-2 test itself (no disjoint training "
    "corpus is available offline) with the leakage filter excluding every passage of the article "
    "being evaluated (leakage='document'), all-MiniLM-L6-v2 as retriever and SmolLM2-135M as LM. "
    "The corpus therefore holds the other WikiText-2 test articles, not a web-scale corpus, and "
    "a few windows per article are evaluated.")


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
        from experiments.table1_datastore import main_datastore

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
        root=args.out, differences=DIFFERENCES)
    fig, ax = new_figure(figsize=(5.5, 3))
    names = list(rows)
    ax.barh(names, [rows[m]["bits_per_byte"] for m in names], color="tab:blue")
    ax.set_xlabel("bits per UTF-8 byte (lower is better)")
    ax.set_xlim(min(rows[m]["bits_per_byte"] for m in names) * 0.95,
                max(rows[m]["bits_per_byte"] for m in names) * 1.02)
    ax.set_title(f"WikiText-2 test, {report['windows']} windows, k={cfg.k}")
    save_figure(fig, out / f"{args.config}.png")


if __name__ == "__main__":
    run(main)
