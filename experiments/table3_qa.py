"""Table 3 at laptop scale: NQ few-shot QA with no retrieval, concatenation, REPLUG, random
documents (and REPLUG LSR given a trained retriever): gold-answer log-likelihood, EM and F1.

Setting: questions from ``nq_gold_passages`` (624 NQ questions with their gold Wikipedia
passage); the retrieval corpus is all 624 passages, so the gold passage is always retrievable
(the paper retrieves from a full Wikipedia dump, which is not available here). The retrieval
query is the question alone; the LM sees few-shot demonstrations taken from questions outside
the evaluated set. With ``corpus_file`` the corpus is that JSONL instead (e.g. the 624 gold
passages plus distractors, ``prepare.nq --distractors``); with ``demonstrations_file`` the
demonstrations come from that file (``prepare.nq --shots``). Given an LSR retriever, every
difference REPLUG LSR − REPLUG (log-likelihood, EM, F1, gold passage in the top k) is reported
with its paired-bootstrap 95 % interval over questions.
Usage: ``python -m experiments.table3_qa [--config tiny] [--set k=10]``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np

from experiments.lib.common import (
    load_lm,
    load_retriever,
    new_figure,
    parse_experiment_args,
    provenance,
    run,
    save_figure,
    write_results,
)
from experiments.configs.table3_qa import CONFIGS
from experiments.lib.datasets import load_nq, load_nq_open
from replug_jax.eval.qa import QAEvaluator
from replug_jax.eval.stats import format_interval, paired_bootstrap
from replug_jax.replug import Replug
from replug_jax.retrieval.corpus import Passage, read_documents
from replug_jax.retrieval import index_in_memory
from replug_jax.process import Timer
from replug_jax.train.data import read_demonstrations


def select_questions(cfg, questions: list[str]) -> list[int]:
    """The evaluated questions: the first ``num_questions``, or those of ``question_file``
    (minus the few-shot demonstrations when they are the last ``shots`` questions)."""
    if cfg.question_file:
        demo_ids = (set() if cfg.demonstrations_file
                    else set(range(len(questions) - cfg.shots, len(questions))))
        return [i for i in load_question_file(cfg.question_file, questions)
                if i not in demo_ids][:cfg.num_questions]
    return list(range(min(cfg.num_questions, len(questions) - cfg.shots)))


def demonstrations(cfg, questions, answers) -> list[tuple[str, str]]:
    """``shots`` (question, answer) pairs: from ``demonstrations_file``, else the last
    ``shots`` NQ questions (never evaluated)."""
    if cfg.demonstrations_file:
        shots = read_demonstrations(cfg.demonstrations_file)
        if len(shots) < cfg.shots:
            raise SystemExit(f"{cfg.demonstrations_file}: {len(shots)} demonstrations, "
                             f"shots={cfg.shots} asked")
        return shots[:cfg.shots]
    return [(questions[-1 - j], answers[-1 - j][0]) for j in range(cfg.shots)]


def corpus_from_file(path: str, num_gold: int) -> tuple[list[Passage], dict[int, int]]:
    """The passages of a JSONL corpus and ``{NQ question index: passage position}`` for the
    gold passages it holds (records whose id is the question's index, as ``prepare.nq``
    writes them)."""
    docs = read_documents(path)
    passages = [Passage(i, d.text, d.title, d.id, 0, len(d.text)) for i, d in enumerate(docs)]
    position = {d.id: i for i, d in enumerate(docs)}
    gold = {q: position[str(q)] for q in range(num_gold) if str(q) in position}
    return passages, gold


def evaluate(cfg, retriever_source: str, passages, questions, answers, lm, label: str,
             progress: bool = True, partial=None, gold_doc=None) -> tuple[dict, dict]:
    """Rows per mode and their per-question records (:class:`replug_jax.eval.qa.QAEvaluator`).
    ``partial``: a JSONL file of per-question records, appended as they are computed and
    reused on a rerun, so an interrupted run resumes where it stopped. ``gold_doc``: question
    index → gold passage id (default: the passage of the same index, for ``nq_gold``)."""
    retriever = load_retriever(retriever_source)
    index = index_in_memory(passages, retriever)
    pipe = Replug(lm, retriever, index, k=cfg.k, retrieval_temperature=cfg.temperature,
                  seed=cfg.seed)
    selected = select_questions(cfg, questions)
    lsr = label != "replug"  # the LSR retriever only changes the REPLUG row
    if gold_doc is None and cfg.dataset == "nq_gold":
        gold_doc = {i: i for i in selected}
    evaluator = QAEvaluator(
        questions, answers, selected, demonstrations=demonstrations(cfg, questions, answers),
        layout=cfg.layout, modes=("replug",) if lsr else cfg.modes,
        generate_modes=cfg.generate_modes,
        likelihood=cfg.likelihood, max_new_tokens=cfg.max_new_tokens, gold_doc=gold_doc,
        partial=partial, label=label if cfg.layout == "document_first"
        else f"{label}:{cfg.layout}", row_names={"replug": "replug_lsr"} if lsr else None,
        progress=progress)
    rows = evaluator.run(pipe)
    return rows, evaluator.records


def paired_differences(base: list[dict], other: list[dict], resamples: int = 10_000) -> dict:
    """``other`` − ``base`` per metric measured on both (REPLUG LSR − REPLUG, one layout −
    another), with paired-bootstrap 95 % intervals over questions (per-question ``records``
    of two rows, the same questions in order)."""
    out = {}
    for key, name in (("loglik", "mean_answer_loglik"), ("em", "exact_match"), ("f1", "f1"),
                      ("gold_hit", "gold_recall_at_k")):
        a = [r.get(key) for r in other]
        b = [r.get(key) for r in base]
        if any(x is None for x in a + b) or not np.all(np.isfinite(np.array(a + b, float))):
            continue
        out[name] = paired_bootstrap(np.array(a, float), np.array(b, float),
                                     resamples=resamples)
    return out


DIFFERENCES = (
    "The paper retrieves from a December 2018 Wikipedia dump with Contriever and prompts Codex "
    "16-shot, evaluating EM on the NQ test set. Here the corpus is the 624 gold passages of "
    "`nq_gold_passages` (so the gold passage is always retrievable and the distractors are "
    "other questions' passages), the retriever is all-MiniLM-L6-v2, the LM is SmolLM2-135M "
    "(GGUF, float32), prompts are 4-shot, and the headline figure is the mean log-likelihood of "
    "the gold answer because a 135M model's exact match is near zero in every setting.")


def load_question_file(path: str, all_questions: list[str]) -> list[int]:
    """Indices (into the 624 NQ questions) of the questions listed in a JSONL file with a
    ``gold_doc`` field, as written by ``experiments/prepare/nq.py`` (e.g. its dev split)."""
    from replug_jax.fileio import read_jsonl

    rows = read_jsonl(path)
    out = []
    for row in rows:
        i = int(row["gold_doc"])
        if not 0 <= i < len(all_questions) or all_questions[i] != row["question"]:
            raise SystemExit(f"{path}: question {row.get('id')} does not match nq_gold_passages")
        out.append(i)
    return out


def load_data(cfg, lm):
    """``(passages, questions, answers, gold_doc)`` of the config's dataset (``gold_doc``: the
    gold passage per selected question when the corpus comes from ``corpus_file``)."""
    if cfg.dataset == "nq_open":
        passages, questions, answers = load_nq_open(cfg.corpus, lm.tokenizer)
    elif cfg.dataset == "nq_gold":
        passages, questions, answers = load_nq()
    else:
        raise SystemExit(f"dataset must be nq_gold or nq_open, got {cfg.dataset!r}")
    gold_doc = None
    if cfg.corpus_file:
        if cfg.dataset != "nq_gold":
            raise SystemExit("corpus_file replaces the nq_gold corpus; nq_open uses `corpus`")
        passages, gold = corpus_from_file(cfg.corpus_file, len(questions))
        gold_doc = {i: gold[i] for i in select_questions(cfg, questions) if i in gold}
    return passages, questions, answers, gold_doc


def evaluate_rows(cfg, data, lm, progress: bool, partial):
    """Every row (REPLUG's modes, the LSR retriever's, the other layout's) and its records;
    ``layout_diffs``: compare_layout − layout per mode, paired on the same questions."""
    passages, questions, answers, gold_doc = data
    rows, records = evaluate(cfg, cfg.retriever, passages, questions, answers, lm, "replug",
                             progress, partial, gold_doc)
    if cfg.lsr_retriever:
        lsr_rows, lsr_records = evaluate(cfg, cfg.lsr_retriever, passages, questions, answers,
                                         lm, "lsr", progress, partial, gold_doc)
        rows.update(lsr_rows)
        records.update(lsr_records)
    layout_diffs = {}
    if cfg.compare_layout:  # the same questions in the other layout, paired
        alt_rows, alt_records = evaluate(
            dataclasses.replace(cfg, layout=cfg.compare_layout), cfg.retriever, passages,
            questions, answers, lm, "replug", progress, partial, gold_doc)
        for mode in alt_rows:
            rows[f"{mode} ({cfg.compare_layout})"] = alt_rows[mode]
            records[f"{mode} ({cfg.compare_layout})"] = alt_records[mode]
            layout_diffs[mode] = paired_differences(records[mode], alt_records[mode])
    return rows, records, layout_diffs


def _cell(r: dict, key: str) -> str:
    """The value to 3 decimals, or a dash where a mode did not measure it (no generation,
    no retrieval)."""
    value = r.get(key)
    return "—" if value is None or np.isnan(value) else f"{value:.3f}"


def _notes(cfg, n: int, seconds: float, differences: dict, layout_diffs: dict) -> str:
    return (f"{n} questions ({cfg.dataset}), k={cfg.k}, {cfg.shots}-shot, LM {cfg.lm}, "
            f"retriever {cfg.retriever}"
            + (f", LSR retriever {cfg.lsr_retriever}" if cfg.lsr_retriever else "")
            + f", τ = {cfg.temperature}; {seconds:.0f} s."
            + "".join(f"\n\nREPLUG LSR − REPLUG, {name}: {format_interval(d)} (paired "
                      f"bootstrap 95 %, {d['items']} questions)"
                      for name, d in differences.items())
            + "".join(f"\n\n{cfg.compare_layout} − {cfg.layout}, {mode}, {name}: "
                      f"{format_interval(d)} (paired bootstrap 95 %, {d['items']} questions)"
                      for mode, ds in layout_diffs.items() for name, d in ds.items()))


def main(argv=None):
    args, cfg = parse_experiment_args(argv, __doc__, CONFIGS)
    lm = load_lm(cfg.lm, cfg.max_context)
    data = load_data(cfg, lm)
    passages, questions = data[0], data[1]
    folder = args.out / "table3_qa"
    folder.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode()
                         ).hexdigest()[:12]
    partial = folder / f".{args.config}.{key}.partial.jsonl"  # same config -> resumes
    with Timer() as sw:
        rows, records, layout_diffs = evaluate_rows(cfg, data, lm, not args.no_progress,
                                                    partial)
    n = len(select_questions(cfg, questions))
    differences = (paired_differences(records["replug"], records["replug_lsr"])
                   if "replug" in records and "replug_lsr" in records else {})
    payload = {"config": dataclasses.asdict(cfg), "results": rows, "seconds": sw.seconds,
               "lsr_minus_replug": differences,
               "layout_differences": layout_diffs,  # compare_layout − layout, per mode
               "per_question": {row: {key: [r.get(key) for r in recs]
                                      for key in ("loglik", "em", "f1") if key in recs[0]}
                                for row, recs in records.items() if recs},
               "predictions": {row: [r.get("prediction") for r in recs]
                               for row, recs in records.items()
                               if any("prediction" in r for r in recs)},
               "provenance": provenance(), "questions": n,
               "corpus_passages": len(passages),
               "setting": (f"NQ-open dev questions, corpus '{cfg.corpus}' ({len(passages)} "
                           "Wikipedia passages, most questions' evidence absent)"
                           if cfg.dataset == "nq_open" else
                           "NQ questions with the 624 gold passages as the retrieval corpus")
               + (f" (+ the rest of {cfg.corpus_file})" if cfg.corpus_file else "")
               + f"; {cfg.shots}-shot plain prompts; query = question"}
    table = [(mode, *(_cell(r, key) for key in ("mean_answer_loglik", "exact_match", "f1",
                                                "mean_gold_weight", "gold_recall_at_k")),
              r["lm_calls"]) for mode, r in rows.items()]
    out = write_results("table3_qa", args.config, payload, table,
                        ("mode", "mean gold-answer loglik", "EM", "F1", "gold λ",
                         "gold in top-k", "LM rows"),
                        notes=_notes(cfg, n, sw.seconds, differences, layout_diffs),
                        root=args.out, differences=DIFFERENCES)
    fig, ax = new_figure(figsize=(5, 3))
    modes = list(rows)
    ax.bar(modes, [rows[m].get("mean_answer_loglik", np.nan) for m in modes], color="tab:blue")
    ax.set_ylabel("mean gold-answer log-likelihood")
    ax.set_title(f"NQ, {n} questions, k={cfg.k}")
    save_figure(fig, out / f"{args.config}.png")
    partial.unlink(missing_ok=True)


if __name__ == "__main__":
    run(main)
