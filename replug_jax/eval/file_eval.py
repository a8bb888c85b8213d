"""``replug eval``: every mode of one or two retrieval setups on a user's file, each example
scored once per row and kept, and paired intervals between rows.

A **system** is a :class:`~replug_jax.replug.Replug` pipeline under a label (the base
retriever, and optionally a second one to compare). A **row** is a system in one mode
(``none``, ``replug``, ``top1``, ``concat``, ``random``); ``none`` does not retrieve, so it is
run once. Every row scores the same examples, so differences between rows are paired:

- QA (:class:`~replug_jax.eval.qa.QAEvaluator` per system): the gold answer's log-likelihood
  (``log Σ_k λ_k p(y | d_k ∘ x)``, §3.2, per token), exact match and F1 of greedy answers, and
  the gold passage's recall in the top k when the file names it;
- text: bits per byte over sliding windows (:mod:`~replug_jax.eval.perplexity`).

Each per-example record is appended to ``records.jsonl`` under a key of everything that
decides it (file, LM, retriever, index, k, τ, layout, lengths), so an interrupted run
resumes and a changed setting never reuses a stale record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib
from typing import Sequence

from replug_jax.eval.datasets import EvalData
from replug_jax.eval.perplexity import WindowSettings, sliding_windows
from replug_jax.eval.qa import QAEvaluator
from replug_jax.prompts import answer_continuation
from replug_jax.eval.stats import bpb_difference, paired_bootstrap
from replug_jax.retrieval.corpus import Document, leakage_exclusions

EVAL_MODES = ("none", "replug", "top1", "concat", "random")
RECORDS = "records.jsonl"


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """How a file is evaluated. ``chat_layout`` applies to LMs with a chat template (see
    ``replug ask``); ``generate`` adds greedy answers (EM/F1) to QA; ``likelihood=False``
    (QA) scores no gold answer: with ``generate=False`` that is retrieval alone, gold-passage
    recall with no LM call; ``windows`` and ``leakage`` apply to text."""

    modes: tuple[str, ...] = ("none", "replug", "top1", "concat")
    generate: bool = True
    likelihood: bool = True
    max_new_tokens: int = 16
    chat_layout: str = "inside"
    windows: WindowSettings = WindowSettings(context_tokens=128, stride=128, query_tokens=128,
                                             skip_first=32, leakage="none")
    batch_size: int = 4
    confidence: float = 0.95
    resamples: int = 10_000
    seed: int = 0

    def __post_init__(self):
        bad = [m for m in self.modes if m not in EVAL_MODES]
        if bad or not self.modes:
            raise ValueError(f"modes must be among {EVAL_MODES}, got {list(self.modes)}")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"a mode is listed twice: {list(self.modes)}")
        if not self.likelihood and not self.generate and "none" in self.modes:
            raise ValueError("retrieval alone (no likelihood, no generation) measures the "
                             "retrieved passages: mode none retrieves nothing; drop it")


def system_key(data: EvalData, pipe, settings: EvalSettings, mode: str) -> str:
    """What decides a row's records: the file, the pipeline's settings for ``mode`` (LM,
    retriever, index, k, τ) and how examples are prompted or windowed."""
    s = pipe.settings(mode, pipe.k)
    if mode == "none":  # the LM alone: no retriever, index, k or τ decides anything
        s = {"mode": mode, "lm": s["lm"], "lm_placement": s["lm_placement"],
             "max_context": s["max_context"]}
    # an in-process LM's weights (its name alone could hide new weights under an old name)
    weights = getattr(getattr(pipe.lm, "lm", None), "fingerprint", None)
    parts = {"data": data.checksum, "settings": s, "lm_weights": weights,
             "separator": pipe.separator,
             "seed": pipe.seed, "chat_layout": settings.chat_layout,
             # gold answers scored as the LM writes them (no space after a chat header)
             "answer_scoring": "as_written",
             "generate": settings.generate, "max_new_tokens": settings.max_new_tokens,
             "windows": dataclasses.asdict(settings.windows)}
    if not settings.likelihood:  # records without the answer's log-likelihood
        parts["likelihood"] = False
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _qa_layout(pipe, chat_layout: str) -> str:
    tokenizer = getattr(pipe.lm, "tokenizer", None)
    return f"chat_{chat_layout}" if getattr(tokenizer, "chat_template", None) else \
        "document_first"


def resolve_gold_ids(data: EvalData, index) -> dict[int, tuple[int, ...]]:
    """Item index -> the passage ids its gold (``gold_doc`` or ``gold_passage``) names in
    ``index``'s store (refused in one line when it names none)."""
    from replug_jax.retrieval.store import gold_passages

    named = [(i, it) for i, it in enumerate(data.items) if it.gold_doc is not None]
    if not named or index is None:
        return {}
    ids = gold_passages([it.gold_doc for _, it in named], index.passages,
                        [it.id for _, it in named])
    return {i: g for (i, _), g in zip(named, ids)}


def qa_rows(data: EvalData, systems: dict, settings: EvalSettings, records: pathlib.Path,
            progress: bool = True) -> tuple[dict, dict]:
    """``({row: summary}, {row: per-item records})`` of a QA file: every system in every mode
    (``none`` once, under the first system)."""
    rows, per_item = {}, {}
    for n, (label, pipe) in enumerate(systems.items()):
        modes = [m for m in settings.modes if n == 0 or m != "none"]
        names = {m: m if n == 0 else f"{m}@{label}" for m in modes}
        gold = resolve_gold_ids(data, pipe.index) or None  # one pass over the store per system
        if gold is None and not (settings.likelihood or settings.generate):
            raise ValueError(f"{data.path}: retrieval alone measures gold-passage recall, and "
                             "no question names a gold passage (gold_doc or gold_passage)")
        for mode in modes:  # one evaluator per row: each row has its own key
            ev = QAEvaluator([it.question for it in data.items],
                             [list(it.answers) for it in data.items], range(len(data)),
                             layout=_qa_layout(pipe, settings.chat_layout), modes=[mode],
                             generate_modes=[mode] if settings.generate else [],
                             likelihood=settings.likelihood,
                             max_new_tokens=settings.max_new_tokens,
                             gold_doc=gold,
                             partial=records, label=f"{names[mode]}:"
                             f"{system_key(data, pipe, settings, mode)}",
                             row_names={mode: names[mode]}, progress=progress,
                             batch_size=settings.batch_size,
                             ids=[it.id for it in data.items])
            rows.update(ev.run(pipe))
            per_item.update(ev.records)
    return rows, per_item


def _windows(data: EvalData, pipe, settings: EvalSettings):
    docs = [Document(it.id, it.text) for it in data.items]
    tokenizer = getattr(pipe.lm, "tokenizer", None)
    if tokenizer is None:
        raise ValueError("a text file is cut into windows with the LM's tokenizer: give a "
                         "served LM its tokenizer (--api-tokenizer)")
    windows, owner = [], []
    for i, d in enumerate(docs):
        ws = sliding_windows(d, tokenizer, settings.windows)
        windows += ws
        owner += [i] * len(ws)
    if not windows:
        raise ValueError(f"no text is longer than skip_first={settings.windows.skip_first} "
                         "tokens: nothing to evaluate (lower --skip-first)")
    return windows, owner


def _read_done(path: pathlib.Path, label: str) -> dict:
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by an interruption
                continue
            if rec.get("label") == label:
                out[rec["i"]] = rec
    return out


def text_rows(data: EvalData, systems: dict, settings: EvalSettings, records: pathlib.Path,
              progress: bool = True) -> tuple[dict, dict]:
    """``({row: summary}, {row: per-window records})`` of a text file (windows of
    ``settings.windows``; each record holds ``loglik``, ``num_bytes``, ``num_tokens`` and
    the index of its text)."""
    from tqdm.auto import tqdm

    rows, per_item = {}, {}
    for n, (label, pipe) in enumerate(systems.items()):
        windows, owner = _windows(data, pipe, settings)
        passages = pipe.index.passages if pipe.index is not None else []
        exclusions = leakage_exclusions(windows, passages, settings.windows.leakage)
        for mode in [m for m in settings.modes if n == 0 or m != "none"]:
            name = mode if n == 0 else f"{mode}@{label}"
            key = f"{name}:{system_key(data, pipe, settings, mode)}"
            done = _read_done(records, key)
            todo = [j for j in range(len(windows)) if j not in done]
            bar = tqdm(total=len(windows), initial=len(windows) - len(todo),
                       desc=f"eval:{name}", disable=not progress)
            for start in range(0, len(todo), settings.batch_size):
                batch = todo[start:start + settings.batch_size]
                res = pipe.score([windows[j].context for j in batch],
                                 [windows[j].target for j in batch],
                                 [windows[j].query for j in batch], mode=mode,
                                 exclude_ids=[exclusions[j] for j in batch], reliance=False)
                with open(records, "a") as f:
                    for j, r in zip(batch, res):
                        done[j] = {"label": key, "i": j, "text": owner[j], "loglik": r.loglik,
                                   "num_bytes": r.num_bytes, "num_tokens": r.num_tokens}
                        f.write(json.dumps(done[j]) + "\n")
                bar.update(len(batch))
            bar.close()
            recs = [done[j] for j in range(len(windows))]
            ll = sum(r["loglik"] for r in recs)
            nbytes, ntok = sum(r["num_bytes"] for r in recs), sum(r["num_tokens"] for r in recs)
            rows[name] = {"bits_per_byte": -ll / (math.log(2) * max(nbytes, 1)),
                          "perplexity": math.exp(-ll / max(ntok, 1)), "windows": len(recs),
                          "num_tokens": ntok, "num_bytes": nbytes}
            per_item[name] = recs
    return rows, per_item


def _pairs(rows: Sequence[str], systems: Sequence[str]) -> list[tuple[str, str]]:
    """``(row, reference)`` pairs: every retrieval row against the LM alone, and each row of a
    compared system against the same mode of the first."""
    out = [(r, "none") for r in rows if r != "none" and "none" in rows]
    for label in systems[1:]:
        out += [(r, r.removesuffix(f"@{label}")) for r in rows if r.endswith(f"@{label}")]
    return out


def comparisons(data: EvalData, per_item: dict, systems: Sequence[str],
                settings: EvalSettings) -> list[dict]:
    """Paired bootstrap intervals (clustered by ``group`` for QA, by text for windows) of
    every row against its reference: bits per byte for text; log-likelihood, EM, F1, the
    answer contained in the prediction, and gold recall for QA (each where both rows have
    it)."""
    kw = dict(confidence=settings.confidence, resamples=settings.resamples, seed=settings.seed)
    out = []
    for row, ref in _pairs(list(per_item), list(systems)):
        a, b = per_item[row], per_item[ref]
        if data.kind == "text":
            clusters = [data.groups[r["text"]] if data.groups else r["text"] for r in a]
            clustered = len(set(clusters)) > 1
            d = bpb_difference([r["loglik"] for r in a], [r["loglik"] for r in b],
                               [r["num_bytes"] for r in a],
                               clusters=clusters if clustered else None, **kw)
            unit = ("groups" if data.groups else "texts") if clustered else "windows"
            out.append({"row": row, "reference": ref, "metric": "bits_per_byte", **d,
                        "resampled": unit})
            continue
        for metric, field in (("answer_loglik", "loglik"), ("exact_match", "em"), ("f1", "f1"),
                              ("answer_contained", "contains"), ("acc", "acc"),
                              ("gold_recall", "gold_hit")):
            # the items both rows measured (gold recall: those naming a gold passage)
            both = [i for i, (x, y) in enumerate(zip(a, b)) if field in x and field in y]
            groups = [data.groups[i] for i in both] if data.groups else None
            if len(both) < 2:
                continue
            clustered = bool(groups) and len(set(groups)) > 1
            out.append({"row": row, "reference": ref, "metric": metric, **paired_bootstrap(
                [float(a[i][field]) for i in both], [float(b[i][field]) for i in both],
                clusters=groups if clustered else None, **kw),
                "resampled": "groups" if clustered else "questions"})
    return out


def evaluate_file(data: EvalData, systems: dict, settings: EvalSettings,
                  out_dir: str | pathlib.Path, progress: bool = True) -> dict:
    """Evaluate ``data`` with ``systems`` (``{label: Replug}``, the first the reference) and
    write ``results.json``, ``summary.md``, ``records.jsonl`` and (with matplotlib)
    ``results.png`` into ``out_dir``; returns the report that ``results.json`` holds."""
    from replug_jax.eval.file_report import write_report

    if not systems:
        raise ValueError("no system to evaluate")
    retrieving = [m for m in settings.modes if m != "none"]
    for label, pipe in systems.items():
        if retrieving and pipe.index is None:
            raise ValueError(f"modes {retrieving} need an index (system {label!r})")
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = qa_rows if data.kind == "qa" else text_rows
    rows, per_item = run(data, systems, settings, out / RECORDS, progress)
    first = next(iter(systems.values()))
    report = {"file": data.path, "kind": data.kind, "examples": len(data),
              "clusters": len(set(data.groups)) if data.groups else None,
              "settings": {"modes": list(settings.modes), "k": first.k,
                           "chat_layout": settings.chat_layout if data.kind == "qa" else None,
                           "qa_layout": _qa_layout(first, settings.chat_layout)
                           if data.kind == "qa" else None,
                           "windows": dataclasses.asdict(settings.windows)
                           if data.kind == "text" else None,
                           "confidence": settings.confidence},
              "systems": {label: _system(pipe) for label, pipe in systems.items()},
              "rows": rows,
              "comparisons": comparisons(data, per_item, list(systems), settings)}
    write_report(report, out)
    return report


def _system(pipe) -> dict:
    s = pipe.settings(pipe.mode, pipe.k)
    return {k: s.get(k) for k in ("lm", "retriever", "index", "retrieval_temperature",
                                  "retrieval_temperature_source")}


__all__ = ["EVAL_MODES", "EvalSettings", "comparisons", "evaluate_file", "qa_rows",
           "resolve_gold_ids", "system_key", "text_rows"]


def branch_cache(data: EvalData, pipe, settings: EvalSettings, progress: bool = True):
    """Every example's branches scored once in mode ``replug`` (the gold answer of a question
    in the prompt ``replug eval`` uses, or every window of a text), as a
    :class:`~replug_jax.branches.ScoredBranches`: any τ is then evaluated without the LM."""
    from tqdm.auto import tqdm

    from replug_jax.branches import ScoredBranches

    if data.kind == "qa":
        ev = QAEvaluator([it.question for it in data.items],
                         [list(it.answers) for it in data.items], range(len(data)),
                         layout=_qa_layout(pipe, settings.chat_layout))
        tokenizer = getattr(pipe.lm, "tokenizer", None)
        prompts = [ev.prompt(i, tokenizer) for i in range(len(data))]
        items = [(p, c, it.question, answer_continuation(it.answers[0], ev.layout), None)
                 for (p, c), it in zip(prompts, data.items)]
    else:
        windows, _ = _windows(data, pipe, settings)
        passages = pipe.index.passages if settings.windows.leakage != "none" else []
        exclusions = leakage_exclusions(windows, passages, settings.windows.leakage)
        items = [("", w.context, w.query, w.target, ex) for w, ex in zip(windows, exclusions)]
    results = []
    for start in tqdm(range(0, len(items), settings.batch_size), desc="scoring branches",
                      disable=not progress):
        chunk = items[start:start + settings.batch_size]
        prefixes = [c[0] for c in chunk]
        excluded = [c[4] for c in chunk]
        results += pipe.score([c[1] for c in chunk], [c[3] for c in chunk],
                              [c[2] for c in chunk], mode="replug", reliance=False,
                              exclude_ids=None if data.kind == "qa" else excluded,
                              prefixes=prefixes if any(prefixes) else None)
    return ScoredBranches.from_results(results, [str(i) for i in range(len(items))])


def fit_temperature_on_file(data: EvalData, pipe, settings: EvalSettings,
                            bounds: tuple[float, float] = (1e-3, 10.0),
                            progress: bool = True) -> dict:
    """τ maximising the log-likelihood of ``data`` under REPLUG (Eq. 2 weights, §3.2 mixture),
    with the evidence a reader needs: the log-likelihood per example at τ = 1 and at the fit,
    a 2-fold cross-fitted estimate of the fit on unseen examples, and the bounds."""
    from replug_jax.branches import mixture_logliks
    from replug_jax.eval.temperature import cross_fit_logliks, fit_temperature

    cache = branch_cache(data, pipe, settings, progress)
    fit = fit_temperature(cache, bounds)
    n = len(cache)
    out = {"temperature": fit["temperature"], "at_bound": fit["at_bound"],
           "bounds": list(bounds), "data": data.path, "data_checksum": data.checksum,
           "kind": data.kind, "examples": len(data), "scored": n, "lm": pipe.settings(
               "replug", pipe.k)["lm"], "k": pipe.k,
           "loglik_per_example_at_1": float(mixture_logliks(cache, 1.0).sum() / n),
           "loglik_per_example_at_fit": fit["loglik"] / n}
    if n >= 4:
        held, taus = cross_fit_logliks(cache, folds=2, seed=settings.seed, bounds=bounds)
        groups = data.groups if data.kind == "qa" else None
        clustered = groups is not None and len(set(groups)) > 1
        # the gain of the fit over τ = 1 on examples it was not fitted on, paired
        gain = paired_bootstrap(held, mixture_logliks(cache, 1.0),
                                clusters=groups if clustered else None,
                                confidence=settings.confidence, resamples=settings.resamples,
                                seed=settings.seed)
        out.update(cross_fitted_loglik_per_example=float(held.sum() / n),
                   cross_fitted_temperatures=taus,
                   cross_fitted_at_bound=[bool(min(abs(math.log(t / b)) for b in bounds)
                                               < 1e-3) for t in taus],
                   gain_over_tau_1={**gain, "resampled": "groups" if clustered else
                                    ("questions" if data.kind == "qa" else "windows")})
    return out
