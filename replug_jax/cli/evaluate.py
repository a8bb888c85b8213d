"""``replug eval`` and ``replug fit-tau``: REPLUG on the user's own questions or texts."""

from __future__ import annotations

import pathlib

from replug_jax.cli.common import (
    command,
    emit,
    existing_file,
    index_dir,
    non_negative_int,
    positive_float,
    positive_int,
    open_unit_interval,
)
from replug_jax.cli.infer import add_pipeline_args, make_lm, make_pipeline


def modes_list(text: str) -> tuple[str, ...]:
    import argparse

    from replug_jax.eval.file_eval import EVAL_MODES

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in EVAL_MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"modes are a comma-separated list of {EVAL_MODES}, "
                                         f"got {text!r}")
    if len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"a mode is listed twice: {text!r}")
    return modes


def _settings(args, modes=("replug",)):
    from replug_jax.eval.file_eval import EvalSettings
    from replug_jax.eval.perplexity import WindowSettings

    return EvalSettings(
        modes=modes, likelihood=not getattr(args, "retrieval_only", False),
        generate=not (getattr(args, "no_generate", False) or getattr(args, "retrieval_only",
                                                                      False)),
        max_new_tokens=getattr(args, "max_new_tokens", 16), chat_layout=args.chat_layout,
        windows=WindowSettings(context_tokens=args.context_tokens, stride=args.window_tokens,
                               query_tokens=args.context_tokens, skip_first=args.skip_first,
                               leakage=args.leakage),
        batch_size=args.batch, confidence=getattr(args, "confidence", 0.95),
        resamples=getattr(args, "resamples", 10_000), seed=args.seed)


def _same_corpus(index, other) -> None:
    """Two systems compared on one file must retrieve from the same passages (their own
    embeddings of them): refused in one line when the indexes' corpora differ."""
    import json

    sums = []
    for d in (index, other):
        try:
            sums.append(json.loads((pathlib.Path(d) / "manifest.json").read_text())
                        .get("corpus_checksum"))
        except (OSError, ValueError) as err:
            raise ValueError(f"{d}: no readable index manifest ({err})") from None
    if None not in sums and sums[0] != sums[1]:
        raise ValueError(f"--compare-index {other} holds another corpus than --index {index} "
                         f"(checksums {sums[1][:12]} vs {sums[0][:12]}): a comparison needs "
                         "the same passages")


def _read_data(args):
    from replug_jax.eval.datasets import read_eval_file

    if args.sample and args.limit is None:
        raise ValueError("--sample draws --limit examples: give --limit N")
    return read_eval_file(args.file, limit=args.limit,
                          sample_seed=args.seed if args.sample else None)


def cmd_eval(args) -> int:
    from replug_jax.eval.file_eval import evaluate_file

    if args.compare_retriever is None and args.compare_index is not None:
        raise ValueError("--compare-index names the index of --compare-retriever: give both")
    if args.compare_retriever is not None and args.compare_label == args.label:
        raise ValueError(f"--compare-label {args.compare_label!r} equals --label: the two "
                         "systems' rows would share one name; give them different labels")
    if args.retrieval_only:  # the LM alone retrieves nothing: its row is dropped
        args.modes = tuple(m for m in args.modes if m != "none")
        if not args.modes:
            raise ValueError("--retrieval-only measures retrieving modes; --modes none has none")
    if args.compare_retriever is not None and args.modes == ("none",):
        raise ValueError("--compare-retriever compares retrieving modes; --modes none has none")
    if args.compare_index is not None and args.index is not None:
        _same_corpus(args.index, args.compare_index)
    if args.output.exists() and not args.output.is_dir():
        raise ValueError(f"--output {args.output} is a file; name a folder")
    data = _read_data(args)
    if args.retrieval_only and data.kind != "qa":
        raise ValueError(f"{args.file}: --retrieval-only measures gold-passage recall of "
                         "questions; this file holds texts")
    retrieve = any(m != "none" for m in args.modes)
    first = make_pipeline(args, retrieve=retrieve)
    systems = {args.label: first}
    if args.compare_retriever is not None:
        systems[args.compare_label] = make_pipeline(
            args, lm=first.lm, index=args.compare_index or args.index,
            retriever=args.compare_retriever, retrieve=True)
    report = evaluate_file(data, systems, _settings(args, args.modes), args.output,
                           progress=not args.json)
    from replug_jax.eval.file_report import summary_markdown

    skipped = report["files"].get("plot_skipped")
    emit(args, report, summary_markdown(report) + f"\nwritten to {args.output}/"
         + (f" (no results.png: {skipped})" if skipped else ""))
    return 0


def cmd_fit_tau(args) -> int:
    from replug_jax.eval.file_eval import fit_temperature_on_file

    if args.index is None:
        raise ValueError("fit-tau needs --index: τ is fitted for a retriever and its index")
    low, high = args.bounds
    if not low < high:
        raise ValueError(f"--bounds LOW HIGH needs LOW < HIGH, got {low:g} {high:g}")
    if args.store == "retriever" and not (pathlib.Path(args.retriever or "")
                                          / "replug.json").is_file():
        raise ValueError("--store retriever needs --retriever to name a folder exported by "
                         "replug-jax (with replug.json); use --store index otherwise")
    data = _read_data(args)
    pipe = make_pipeline(args, lm=make_lm(args), retrieve=True)
    fit = fit_temperature_on_file(data, pipe, _settings(args), tuple(args.bounds),
                                  progress=not args.json)
    where = None
    if args.store == "index":
        from replug_jax.retrieval import fitted_tau

        where = str(fitted_tau.write(args.index, fit["temperature"], pipe.retriever.identity,
                                     fit))
    elif args.store == "retriever":
        from replug_jax.train.export import record_temperature

        folder = pathlib.Path(args.retriever)
        record_temperature(folder, fit["temperature"], fit, _card_text(fit))
        where = str(folder / "replug.json")
    fit["stored_in"] = where
    emit(args, fit, _card_text(fit) + (f"\nstored in {where}" if where else
                                       "\nnot stored (--store none)"))
    return 0


def _card_text(fit: dict) -> str:
    lines = [f"τ = {fit['temperature']:.4g} fitted on {fit['scored']} "
             f"{'answers' if fit['kind'] == 'qa' else 'windows'} of {fit['data']} with "
             f"{fit['lm']}, k = {fit['k']}" + (" (at a bound of the search: widen --bounds)"
                                               if fit["at_bound"] else ""),
             f"log-likelihood per example: {fit['loglik_per_example_at_1']:.4f} at τ = 1, "
             f"{fit['loglik_per_example_at_fit']:.4f} at the fit"]
    if "cross_fitted_loglik_per_example" in fit:
        lines.append(f"cross-fitted (2 folds, each scored at the other's τ: "
                     f"{', '.join(f'{t:.3g}' for t in fit['cross_fitted_temperatures'])}): "
                     f"{fit['cross_fitted_loglik_per_example']:.4f}"
                     + (" (a fold's fit at a bound of the search)"
                        if any(fit["cross_fitted_at_bound"]) else ""))
        g = fit["gain_over_tau_1"]
        lines.append(f"gain over τ = 1 on examples the fit did not see: "
                     f"{g['difference']:+.4f} [{g['low']:+.4f}, {g['high']:+.4f}] per example "
                     f"({round(100 * g['confidence'])} % paired bootstrap over "
                     f"{g.get('clusters', g['items'])} {g['resampled']})")
    return "\n".join(lines)


def _add_data_args(p, what: str) -> None:
    p.add_argument("file", type=existing_file,
                   help=f"{what}: JSONL of {{question, answer, id?, gold_doc? or "
                   "gold_passage?, group?} "
                   "(QA) or {text, id?, group?} (texts), or a .txt file (one text); formats in "
                   "docs/data.md")
    p.add_argument("--limit", type=positive_int, default=None,
                   help="use only the first N examples (FlashRAG's protocol: the first 1000)")
    p.add_argument("--sample", action="store_true",
                   help="with --limit: draw the N examples with --seed across the file's "
                        "groups instead of taking the first N (an article-ordered file's "
                        "first questions come from one or two articles)")
    p.add_argument("--batch", type=positive_int, default=4, help="examples per pipeline call")
    p.add_argument("--chat-layout", choices=("inside", "before"), default="inside",
                   help="QA with a chat LM: each passage inside the user's turn (default) or "
                        "in front of the chat prompt, as in `replug ask`")
    p.add_argument("--window-tokens", type=positive_int, default=128,
                   help="texts: target tokens per window, also the retrieval stride "
                        "(default 128, the paper's)")
    p.add_argument("--context-tokens", type=positive_int, default=128,
                   help="texts: tokens before each window given to the LM and used as the "
                        "retrieval query (default 128)")
    p.add_argument("--skip-first", type=positive_int, default=32,
                   help="texts: leading tokens of each text used only as context (default 32)")
    p.add_argument("--leakage", choices=("none", "window", "document"), default="none",
                   help="texts that are also in the corpus: never retrieve passages of the "
                        "same document overlapping the window (window) or at all (document); "
                        "matched by the text's id and the corpus's document ids (default none)")


def add_parsers(sub) -> None:
    ev = command(sub, "eval", cmd_eval,
                 help="evaluate a file of questions or texts in every mode, with paired "
                      "intervals",
                 description="Score every example of a QA file (gold-answer log-likelihood, "
                 "EM/F1 of greedy answers, gold-passage recall) or a text file (bits per byte) "
                 "in each mode, and a second retriever's too, with paired bootstrap intervals "
                 "between rows (clustered by the file's group field). Writes results.json, "
                 "summary.md, results.png and per-example records.jsonl to --output; a rerun "
                 "resumes from the records.")
    _add_data_args(ev, "the examples")
    ev.add_argument("--modes", type=modes_list, default=("none", "replug", "top1", "concat"),
                    help="comma-separated modes (default none,replug,top1,concat; also random)")
    ev.add_argument("--output", type=pathlib.Path, required=True,
                    help="folder for results.json, summary.md, results.png, records.jsonl")
    ev.add_argument("--no-generate", action="store_true",
                    help="QA: score the gold answers only, no greedy answers (no EM/F1)")
    ev.add_argument("--retrieval-only", action="store_true",
                    help="QA with gold passages (gold_doc or gold_passage): each retrieving "
                         "mode's passages, their weights λ and gold-passage recall (top1: "
                         "recall@1), with no LM call (no log-likelihood, no answers; the LM's "
                         "tokenizer still fits the prompts); mode none is dropped")
    ev.add_argument("--max-new-tokens", type=non_negative_int, default=16,
                    help="QA: answer length limit (default 16)")
    ev.add_argument("--compare-retriever", default=None,
                    help="a second query encoder (e.g. one trained by train-lsr) run in every "
                         "retrieving mode and compared with the first, mode by mode")
    ev.add_argument("--compare-index", type=index_dir, default=None,
                    help="the index of --compare-retriever when its passage encoder differs "
                         "(default: --index; a query-tower-only retriever shares it)")
    ev.add_argument("--label", default="base", help="name of the first system (default base)")
    ev.add_argument("--compare-label", default="trained",
                    help="name of the second system's rows, mode@label (default trained)")
    ev.add_argument("--confidence", type=open_unit_interval, default=0.95,
                    help="interval coverage (default 0.95)")
    ev.add_argument("--resamples", type=positive_int, default=10_000,
                    help="bootstrap resamples (default 10000)")
    add_pipeline_args(ev, mode=False)

    fit = command(sub, "fit-tau", cmd_fit_tau,
                  help="fit the retrieval temperature τ on a dev file and store it",
                  description="Score every example's k branches once, find the τ of "
                  "λ = softmax(s/τ) that maximises the file's REPLUG log-likelihood (QA: the "
                  "gold answers; texts: every window), report it against τ = 1 with a "
                  "cross-fitted estimate, and store it with the index (ask, generate, score "
                  "and eval then use it for this query encoder).")
    _add_data_args(fit, "dev examples")
    fit.add_argument("--bounds", type=positive_float, nargs=2, default=(1e-3, 10.0),
                     metavar=("LOW", "HIGH"), help="search interval of τ (default 0.001 10)")
    fit.add_argument("--store", choices=("index", "retriever", "none"), default="index",
                     help="where τ is kept: beside the index (default), in an exported "
                          "retriever's replug.json and card (--retriever FOLDER), or nowhere")
    add_pipeline_args(fit, mode=False)

