"""The retrieval temperature τ of REPLUG's weights ``λ = softmax(s(d, x) / τ)`` (paper §3.2):
one LM pass per retriever serves the whole sweep.

Every (example, document) branch is scored once at the top-k of the retriever and its per-token
log-probabilities kept (``ScoredBranches``; the LM's pairs in the score store, resumable); the
mixture is then evaluated
for each τ, for uniform weights and for the top-1 document alone, and τ is fitted by a bounded
1-D search maximising the log-likelihood of the fit split. Every difference is reported with a
paired bootstrap 95 % interval over questions or windows. The fitted τ of the retriever named
by ``record`` is written into its folder (``replug.json`` and model card), where
:class:`~replug_jax.replug.Replug` picks it up by default.

Usage: ``python -m experiments.inference_temperature --config nq|wikitext``.
"""

from __future__ import annotations

import pathlib

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
from experiments.configs.inference_temperature import CONFIGS
from replug_jax.core.ensemble import bits_per_byte
from replug_jax.eval.perplexity import WindowSettings, leakage_exclusions, sliding_windows
from replug_jax.eval.stats import bpb_difference, format_interval, paired_bootstrap
from replug_jax.branches import ScoredBranches, mixture_logliks
from replug_jax.eval.temperature import cross_fit_logliks, fit_temperature
from replug_jax.fileio import read_jsonl
from replug_jax.lm.score_store import ScoreStore, StoredLM, scorer_identity
from replug_jax.prompts import qa_prompt
from replug_jax.replug import Replug
from replug_jax.retrieval.corpus import Passage, chunk_documents, read_documents
from replug_jax.retrieval.encoder import Retriever
from replug_jax.retrieval import index_in_memory
from replug_jax.process import Timer
from replug_jax.train.data import read_demonstrations

DIFFERENCES = (
    "The paper uses τ = 1 at inference with cosine similarities from Contriever and a 175B LM. "
    "Here all-MiniLM-L6-v2 retrieves for SmolLM2-135M on NQ dev questions (4-shot prompts, "
    "624 gold passages + 3528 distractor passages) and on WikiText-2 test-article windows "
    "(128-token passages of all articles, a window never retrieving its own article's "
    "passages by default, plus the same distractors); τ is a post-hoc 1-D fit, not in the "
    "paper.")

BOUNDS = (1e-3, 10.0)


def parse_retrievers(specs) -> list[tuple[str, str]]:
    out = []
    for spec in specs:
        label, sep, source = str(spec).partition("=")
        if not sep or not label or not source:
            raise ValueError(f"retrievers are label=source pairs, got {spec!r}")
        out.append((label, source))
    if len({label for label, _ in out}) != len(out):
        raise ValueError(f"retriever labels must be distinct: {specs}")
    return out


def load_corpus(cfg, lm) -> list[Passage]:
    docs = read_documents(cfg.corpus)
    if cfg.chunk_tokens <= 0:
        return [Passage(i, d.text, d.title, d.id, 0, len(d.text)) for i, d in enumerate(docs)]
    return chunk_documents(docs, size=cfg.chunk_tokens, unit="tokens", tokenizer=lm.tokenizer)


def examples(cfg, lm, split: str, passages) -> dict:
    """``{"contexts","targets","queries","exclude","ids","gold"}`` of one split."""
    cap = cfg.num_examples or None
    if cfg.dataset == "nq":
        shots = read_demonstrations(cfg.demonstrations) if cfg.demonstrations else []
        rows = read_jsonl(cfg.questions)[:cap]
        return {"contexts": [qa_prompt(r["question"], demonstrations=shots, chat=False)
                             for r in rows],
                "targets": [" " + str(r["answer"]).strip() for r in rows],
                "queries": [r["question"] for r in rows], "exclude": None,
                "ids": [str(r.get("id", i)) for i, r in enumerate(rows)],
                "gold": [r.get("gold_doc") for r in rows]}
    if cfg.dataset != "wikitext":
        raise ValueError(f"dataset must be nq or wikitext, got {cfg.dataset!r}")
    settings = WindowSettings(cfg.context_tokens, cfg.stride, cfg.context_tokens,
                              cfg.context_tokens, cfg.leakage,
                              cfg.max_windows_per_document or None)
    path = cfg.fit_articles if split == "fit" else cfg.test_articles
    windows = [w for d in read_documents(path) for w in sliding_windows(d, lm.tokenizer,
                                                                         settings)][:cap]
    return {"contexts": [w.context for w in windows], "targets": [w.target for w in windows],
            "queries": [w.query for w in windows],
            "exclude": leakage_exclusions(windows, passages, cfg.leakage),
            "ids": [f"{w.source_id}@{w.target_span[0]}" for w in windows], "gold": None}


def score_split(pipe: Replug, data: dict, mode: str, progress: bool, desc: str,
                batch: int = 4):
    """A split's scored branches (mode replug) or ``[N]`` log-likelihoods (mode none); the
    pipeline's LM reads and writes the score store, so a rerun scores no pair again."""
    from tqdm.auto import tqdm

    results = []
    n = len(data["contexts"])
    for i in tqdm(range(0, n, batch), desc=desc, disable=not progress):
        sl = slice(i, i + batch)
        results += pipe.score(data["contexts"][sl], data["targets"][sl], data["queries"][sl],
                              mode=mode, exclude_ids=None if data["exclude"] is None else
                              data["exclude"][sl], reliance=False)
    if mode == "replug":
        return ScoredBranches.from_results(results, data["ids"])
    return np.array([r.loglik for r in results], np.float64)


def metric(cfg, logliks, num_bytes) -> float:
    if cfg.dataset == "nq":
        return float(np.mean(logliks))  # mean gold-answer log-likelihood (nats)
    return float(bits_per_byte(np.sum(logliks), np.sum(num_bytes)))


def difference(cfg, a, b, num_bytes) -> dict:
    """a − b in the table's metric, with the paired bootstrap interval."""
    kw = dict(resamples=cfg.bootstrap_resamples, seed=cfg.seed)
    if cfg.dataset == "nq":
        return paired_bootstrap(a, b, **kw)
    return bpb_difference(a, b, num_bytes, **kw)


def score_all(cfg, retrievers, work: pathlib.Path, progress: bool) -> dict:
    """One LM pass per retriever and split: the splits, the LM alone's log-likelihoods, each
    retriever's scored branches and, where the gold passage is known, its hits at ranks 1
    and 5. Every pair the LM scores goes to ``work/lm_scores/``
    (:class:`~replug_jax.lm.score_store.StoredLM`): a run resumes, and a rerun (a report
    written again, another τ grid) scores no pair again."""
    lm = load_lm(cfg.lm, cfg.max_context)
    lm = StoredLM(lm, ScoreStore(work / "lm_scores", scorer_identity(lm)))
    passages = load_corpus(cfg, lm)
    # NQ fits τ on the reported questions (cross-fitted); WikiText on separate articles
    splits = ("report",) if cfg.dataset == "nq" else ("fit", "report")
    data = {s: examples(cfg, lm, s, passages) for s in splits}
    report = data["report"]
    plain = score_split(Replug(lm, mode="none"), report, "none", progress, "lm_alone")
    caches, hits_at = {}, {}
    with_gold = report["gold"] is not None and all(g is not None for g in report["gold"])
    for label, source in retrievers:
        retriever = Retriever.load(source)
        pipe = Replug(lm, retriever, index_in_memory(passages, retriever), k=cfg.k,
                      retrieval_temperature=1.0)
        caches[label] = {s: score_split(pipe, data[s], "replug", progress, f"{label}_{s}")
                         for s in splits}
        if with_gold:
            hits = pipe.index.search(retriever.encode_queries(report["queries"]), 5)
            hits_at[label] = {f"recall@{r}": np.array(
                [g in row[:r] for g, row in zip(report["gold"], hits.ids)], np.float64)
                for r in (1, 5)}
    return {"data": data, "plain": plain, "caches": caches, "hits_at": hits_at}


def recall_rows(cfg, hits_at: dict, retrievers) -> dict:
    """Recall of the gold passage per retriever, paired against the first retriever's."""
    recalls = {}
    first = retrievers[0][0]
    for label, per in hits_at.items():
        recalls[label] = {key: float(np.mean(v)) for key, v in per.items()}
        if label != first:
            recalls[label]["vs_base"] = {key: paired_bootstrap(
                v, hits_at[first][key], resamples=cfg.bootstrap_resamples, seed=cfg.seed)
                for key, v in per.items()}
    return recalls


def scheme_rows(cfg, caches: dict, retrievers) -> tuple[dict, dict]:
    """``(rows, fits)``: per retriever, the report split's log-likelihoods under every weighting
    (each τ, uniform, top-1, the fitted τ), and its τ fitted on the fit split."""
    rows, fits = {}, {}
    for label, _ in retrievers:
        c = caches[label]
        fits[label] = fit_temperature(c["fit"] if "fit" in c else c["report"], BOUNDS)
        per = {}
        for scheme in [*cfg.temperatures, "uniform", "top1", "fitted"]:
            if scheme == "fitted":
                if cfg.dataset == "nq":  # each question scored at the τ fitted on the others
                    ll, taus = cross_fit_logliks(c["report"], 2, cfg.seed, BOUNDS)
                    note = f"cross-fit τ {', '.join(f'{t:.3g}' for t in taus)}"
                else:
                    ll = mixture_logliks(c["report"], fits[label]["temperature"])
                    note = f"τ = {fits[label]['temperature']:.3g} (fit on dev articles)"
            else:
                ll = mixture_logliks(c["report"], scheme)
                note = f"τ = {scheme}" if isinstance(scheme, float) else scheme
            per[str(scheme)] = {"logliks": ll, "note": note}
        rows[label] = per
    return rows, fits


def dev_rows(cfg, scored: dict, retrievers) -> dict:
    """The dev articles at τ = 1 (WikiText): where a training curve is read."""
    base_label = retrievers[0][0]
    dev_bytes = np.array([len(t.encode("utf-8")) for t in scored["data"]["fit"]["targets"]],
                         np.int64)
    dev_ll = {label: mixture_logliks(scored["caches"][label]["fit"], 1.0)
              for label, _ in retrievers}
    return {label: {"metric": metric(cfg, ll, dev_bytes), "windows": len(ll),
                    **({"vs_base": difference(cfg, ll, dev_ll[base_label], dev_bytes)}
                       if label != base_label else {})}
            for label, ll in dev_ll.items()}


def compared_rows(cfg, rows: dict, plain, num_bytes, base_label: str) -> tuple[dict, list]:
    """``(payload rows, table rows)``: each weighting's metric, against τ = 1 (or, at τ = 1,
    the LM alone) and against the base retriever at the same weighting."""
    out, table = {}, []
    for label, per in rows.items():
        ref = per["1.0"]["logliks"] if "1.0" in per else None
        for scheme, entry in per.items():
            ll = entry["logliks"]
            row = {"metric": metric(cfg, ll, num_bytes), "weights": entry["note"]}
            if ref is not None and scheme != "1.0":
                row["vs_tau1"] = difference(cfg, ll, ref, num_bytes)
            if scheme == "1.0":
                row["vs_lm_alone"] = difference(cfg, ll, plain, num_bytes)
            if label != base_label:
                row["vs_base"] = difference(cfg, ll, rows[base_label][scheme]["logliks"],
                                            num_bytes)
            out[f"{label}/{scheme}"] = row
            versus = row.get("vs_tau1") or row.get("vs_lm_alone")
            table.append((label, entry["note"], f"{row['metric']:.4f}",
                          ("vs LM alone " if "vs_lm_alone" in row else "") +
                          (format_interval(versus, 4) if versus else ""),
                          format_interval(row["vs_base"], 4) if "vs_base" in row else ""))
    return out, table


def notes(cfg, payload: dict, work, base_label: str) -> str:
    fits, recalls = payload["fits"], payload["recall"]
    unit = "questions" if cfg.dataset == "nq" else "windows"
    return (f"{payload['examples']} {'questions' if cfg.dataset == 'nq' else 'test windows'}, "
            f"k = {cfg.k}; one LM pass per retriever (its pairs kept in `{work}/lm_scores`). "
            f"Fitted τ (bounds {BOUNDS}): " + "; ".join(
                f"{label} {f['temperature']:.3g}" + (" (at a bound)" if f["at_bound"] else "")
                for label, f in fits.items()) + f". Intervals: paired bootstrap over {unit}, "
            f"{cfg.bootstrap_resamples} resamples. "
            + ("Higher is better." if cfg.dataset == "nq" else "Lower is better.")
            + (" Recall of the gold passage: " + "; ".join(
                f"{label} {recall_text(r)}" for label, r in recalls.items())
                if recalls else "")
            + (" Dev articles at τ = 1 (bits per byte): " + "; ".join(
                f"{label} {d['metric']:.4f}"
                + (f" ({format_interval(d['vs_base'], 4)} vs {base_label})"
                   if "vs_base" in d else "")
                for label, d in payload["dev"].items()) + "." if "dev" in payload else ""))


def main(argv=None):
    args, cfg = parse_experiment_args(argv, __doc__, CONFIGS)
    retrievers = parse_retrievers(cfg.retrievers)
    if cfg.steps and (len(cfg.steps) != len(retrievers) or cfg.dataset != "wikitext"):
        raise ValueError(f"steps gives one training step per retriever of a wikitext run: "
                         f"{len(cfg.steps)} steps for {len(retrievers)} retrievers")
    if cfg.record and cfg.record not in dict(retrievers):
        raise ValueError(f"record={cfg.record!r} names no retriever of {cfg.retrievers}")
    work = pathlib.Path(cfg.workdir) / args.config
    with Timer() as sw:
        scored = score_all(cfg, retrievers, work, not args.no_progress)
    report, plain = scored["data"]["report"], scored["plain"]
    num_bytes = np.array([len(t.encode("utf-8")) for t in report["targets"]], np.int64)
    rows, fits = scheme_rows(cfg, scored["caches"], retrievers)
    base_label = retrievers[0][0]
    payload = {"config": {k: v for k, v in vars(cfg).items()}, "examples": len(num_bytes),
               "lm_alone": metric(cfg, plain, num_bytes), "fits": fits,
               "recall": recall_rows(cfg, scored["hits_at"], retrievers),
               "rows": {}, "seconds": sw.seconds, "provenance": provenance()}
    if "fit" in scored["data"]:
        payload["dev"] = dev_rows(cfg, scored, retrievers)
    name = "mean gold-answer log-lik" if cfg.dataset == "nq" else "bits per byte"
    payload["rows"], table = compared_rows(cfg, rows, plain, num_bytes, base_label)
    table.insert(0, ("LM alone", "—", f"{payload['lm_alone']:.4f}", "", ""))
    out = write_results(
        "inference_temperature", args.config, payload, table,
        ("retriever", "weights", name, "Δ vs τ = 1 [95 % CI]", f"Δ vs {base_label} [95 % CI]"),
        notes=notes(cfg, payload, work, base_label), root=args.out, differences=DIFFERENCES)
    plot(cfg, rows, payload, out / f"{args.config}.png", name)
    if cfg.steps:
        plot_curve(cfg, retrievers, payload, out / f"{args.config}_curve.png")
    if cfg.record:
        record(cfg, dict(retrievers)[cfg.record], cfg.record, fits[cfg.record], payload, name,
               args.config)


def recall_text(r: dict) -> str:
    text = ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k != "vs_base")
    if "vs_base" in r:
        text += " (vs base: " + ", ".join(f"{k} {format_interval(d)}"
                                          for k, d in r["vs_base"].items()) + ")"
    return text


def plot(cfg, rows, payload, path, name):
    fig, ax = new_figure(figsize=(5.5, 3.5))
    for label in rows:
        taus = sorted(t for t in cfg.temperatures)
        vals = [payload["rows"][f"{label}/{t}"]["metric"] for t in taus]
        line, = ax.plot(taus, vals, marker="o", label=f"{label}: softmax(s/τ)")
        ax.axhline(payload["rows"][f"{label}/uniform"]["metric"], color=line.get_color(), ls=":",
                   lw=1, label=f"{label}: uniform")
    ax.axhline(payload["lm_alone"], color="gray", ls="--", lw=1, label="LM alone")
    ax.set_xscale("log")
    ax.set_xlabel("retrieval temperature τ")
    ax.set_ylabel(name)
    ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_curve(cfg, retrievers, payload, path):
    """Dev and test bits per byte (τ = 1) of each retriever against its LSR training step."""
    labels = [label for label, _ in retrievers]
    fig, ax = new_figure(figsize=(5, 3.2))
    ax.plot(cfg.steps, [payload["dev"][lb]["metric"] for lb in labels], marker="o",
            label="dev articles")
    ax.plot(cfg.steps, [payload["rows"][f"{lb}/1.0"]["metric"] for lb in labels], marker="s",
            label="test articles")
    ax.set_xlabel("LSR training step")
    ax.set_ylabel("REPLUG bits per byte (τ = 1)")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def record(cfg, source: str, label: str, fit: dict, payload: dict, name: str, variant: str):
    """Store the fitted τ with the retriever (replug.json + model card)."""
    from replug_jax.train.export import record_temperature

    folder = pathlib.Path(source)
    if not (folder / "replug.json").is_file():
        raise ValueError(f"record={label!r}: {source} is not an exported retriever folder")
    keep = {k: v for k, v in payload["rows"].items() if k.startswith(f"{label}/")}
    lines = [f"τ = {fit['temperature']:.4g}, fitted by `python -m experiments.inference_"
             f"temperature --config {variant}` ({cfg.dataset}, "
             f"{'dev questions' if cfg.dataset == 'nq' else 'dev articles'}; bounds "
             f"{fit['bounds']}{', at a bound' if fit['at_bound'] else ''}). `Replug` uses it "
             "unless given a temperature.", "",
             f"| weights | {name} | Δ vs τ = 1 [95 % CI] | Δ vs base [95 % CI] |",
             "|---|---|---|---|"]
    for key, row in keep.items():
        lines.append(f"| {row['weights']} | {row['metric']:.4f} | "
                     f"{format_interval(row['vs_tau1'], 4) if 'vs_tau1' in row else ''} | "
                     f"{format_interval(row['vs_base'], 4) if 'vs_base' in row else ''} |")
    if payload["recall"].get(label):
        lines += ["", f"Gold-passage recall: {recall_text(payload['recall'][label])}"]
    record_temperature(folder, fit["temperature"], {
        "dataset": cfg.dataset, "variant": variant, "examples": payload["examples"],
        "loglik": fit["loglik"], "bounds": fit["bounds"], "at_bound": fit["at_bound"]},
        "\n".join(lines))


if __name__ == "__main__":
    run(main)
