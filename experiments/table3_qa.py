"""Table 3 at laptop scale: NQ few-shot QA with no retrieval, concatenation, REPLUG, random
documents (and REPLUG LSR given a trained retriever): gold-answer log-likelihood, EM and F1.

Setting: questions from ``nq_gold_passages`` (624 NQ questions with their gold Wikipedia
passage); the retrieval corpus is all 624 passages, so the gold passage is always retrievable
(the paper retrieves from a full Wikipedia dump, which is not available here). The retrieval
query is the question alone; the LM sees few-shot demonstrations taken from questions outside
the evaluated set. Usage: ``python -m experiments.table3_qa [--config tiny] [--set k=10]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json

import numpy as np

from experiments.common import (
    Stopwatch,
    add_standard_args,
    load_lm,
    load_retriever,
    new_figure,
    pick_config,
    provenance,
    run,
    save_figure,
    write_results,
)
from experiments.configs.table3_qa import CONFIGS
from experiments.data import load_nq, load_nq_open
from replug_jax.eval.qa import QAEvaluator
from replug_jax.replug import Replug
from replug_jax.retrieval.index import index_in_memory


def select_questions(cfg, questions: list[str]) -> list[int]:
    """The evaluated questions: the first ``num_questions``, or those of ``question_file``
    (minus the few-shot demonstrations, which are the last ``shots`` questions)."""
    if cfg.question_file:
        demo_ids = set(range(len(questions) - cfg.shots, len(questions)))
        return [i for i in load_question_file(cfg.question_file, questions)
                if i not in demo_ids][:cfg.num_questions]
    return list(range(min(cfg.num_questions, len(questions) - cfg.shots)))


def evaluate(cfg, retriever_source: str, passages, questions, answers, lm, label: str,
             progress: bool = True, partial=None) -> dict:
    """Rows per mode (:class:`replug_jax.eval.qa.QAEvaluator`). ``partial``: a JSONL file of
    per-question records, appended as they are computed and reused on a rerun, so an
    interrupted run resumes where it stopped."""
    retriever = load_retriever(retriever_source)
    index = index_in_memory(passages, retriever)
    pipe = Replug(lm, retriever, index, k=cfg.k, temperature=cfg.temperature, seed=cfg.seed)
    selected = select_questions(cfg, questions)
    lsr = label != "replug"  # the LSR retriever only changes the REPLUG row
    return QAEvaluator(
        questions, answers, selected,
        demonstrations=[(questions[-1 - j], answers[-1 - j][0]) for j in range(cfg.shots)],
        modes=("replug",) if lsr else cfg.modes, generate_modes=cfg.generate_modes,
        likelihood=cfg.likelihood, max_new_tokens=cfg.max_new_tokens,
        gold_doc={i: i for i in selected} if cfg.dataset == "nq_gold" else None,
        partial=partial, label=label, row_names={"replug": "replug_lsr"} if lsr else None,
        progress=progress).run(pipe)


DIFFERENCES = (
    "The paper retrieves from a December 2018 Wikipedia dump with Contriever and prompts Codex "
    "16-shot, evaluating EM on the NQ test set. Here the corpus is the 624 gold passages of "
    "`nq_gold_passages` (so the gold passage is always retrievable and the distractors are "
    "other questions' passages), the retriever is all-MiniLM-L6-v2, the LM is SmolLM2-135M "
    "(GGUF, float32), prompts are 4-shot, and the headline figure is the mean log-likelihood of "
    "the gold answer because a 135M model's exact match is near zero in every setting.")


def load_question_file(path: str, all_questions: list[str]) -> list[int]:
    """Indices (into the 624 NQ questions) of the questions listed in a JSONL file with a
    ``gold_doc`` field, as written by ``experiments/prepare_nq.py`` (e.g. its dev split)."""
    from replug_jax.fileio import read_jsonl

    rows = read_jsonl(path)
    out = []
    for row in rows:
        i = int(row["gold_doc"])
        if not 0 <= i < len(all_questions) or all_questions[i] != row["question"]:
            raise SystemExit(f"{path}: question {row.get('id')} does not match nq_gold_passages")
        out.append(i)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_standard_args(ap, CONFIGS)
    args = ap.parse_args(argv)
    cfg = pick_config(CONFIGS, args.config, args.set)
    lm = load_lm(cfg.lm, cfg.max_context)
    if cfg.dataset == "nq_open":
        passages, questions, answers = load_nq_open(cfg.corpus, lm.tokenizer)
    elif cfg.dataset == "nq_gold":
        passages, questions, answers = load_nq()
    else:
        raise SystemExit(f"dataset must be nq_gold or nq_open, got {cfg.dataset!r}")
    folder = args.out / "table3_qa"
    folder.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True).encode()
                         ).hexdigest()[:12]
    partial = folder / f".{args.config}.{key}.partial.jsonl"  # same config -> resumes
    with Stopwatch() as sw:
        rows = evaluate(cfg, cfg.retriever, passages, questions, answers, lm, "replug",
                        not args.no_progress, partial)
        if cfg.lsr_retriever:
            rows.update(evaluate(cfg, cfg.lsr_retriever, passages, questions, answers, lm,
                                 "lsr", not args.no_progress, partial))
    n = len(select_questions(cfg, questions))
    payload = {"config": dataclasses.asdict(cfg), "results": rows, "seconds": sw.seconds,
               "provenance": provenance(), "questions": n,
               "corpus_passages": len(passages),
               "setting": (f"NQ-open dev questions, corpus '{cfg.corpus}' ({len(passages)} "
                           "Wikipedia passages, most questions' evidence absent)"
                           if cfg.dataset == "nq_open" else
                           "NQ questions with the 624 gold passages as the retrieval corpus")
               + f"; {cfg.shots}-shot plain prompts; query = question"}

    def cell(r, key):  # "—" where a mode did not measure it (no generation, no retrieval)
        value = r.get(key)
        return "—" if value is None or np.isnan(value) else f"{value:.3f}"

    table = [(mode, *(cell(r, key) for key in ("mean_answer_loglik", "exact_match", "f1",
                                               "mean_gold_weight", "gold_recall_at_k")),
              r["lm_calls"]) for mode, r in rows.items()]
    out = write_results("table3_qa", args.config, payload, table,
                        ("mode", "mean gold-answer loglik", "EM", "F1", "gold λ",
                         "gold in top-k", "LM rows"),
                        notes=f"{n} questions ({cfg.dataset}), k={cfg.k}, {cfg.shots}-shot, "
                              f"LM {cfg.lm}, "
                              f"retriever {cfg.retriever}"
                              + (f", LSR retriever {cfg.lsr_retriever}" if cfg.lsr_retriever
                                 else "") + f"; {sw.seconds:.0f} s.",
                        root=args.out, differences=DIFFERENCES)
    fig, ax = new_figure(figsize=(5, 3))
    modes = list(rows)
    ax.bar(modes, [rows[m]["mean_answer_loglik"] for m in modes], color="tab:blue")
    ax.set_ylabel("mean gold-answer log-likelihood")
    ax.set_title(f"NQ, {n} questions, k={cfg.k}")
    save_figure(fig, out / f"{args.config}.png")
    partial.unlink(missing_ok=True)


if __name__ == "__main__":
    run(main)
