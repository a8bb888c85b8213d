"""Open-domain QA: the standard SQuAD/DPR answer normalisation, exact match and F1, and the
few-shot QA evaluator of Table 3."""

from __future__ import annotations

import collections
import dataclasses
import json
import pathlib
import re
import string
from typing import Sequence

import numpy as np

from replug_jax.prompts import answer_continuation

_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer (alias)."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(a) for a in answers))


def f1_score(prediction: str, answers: Sequence[str]) -> float:
    """Best token-overlap F1 against the gold answers."""
    pred = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        common = collections.Counter(pred) & collections.Counter(gold)
        overlap = sum(common.values())
        if not pred or not gold:
            best = max(best, float(pred == gold))
            continue
        if overlap == 0:
            continue
        precision, recall = overlap / len(pred), overlap / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def contains_answer(prediction: str, answers: Sequence[str]) -> float:
    """1.0 if a normalised gold answer occurs in the normalised prediction as whole words: a
    chat LM's full-sentence answer counts when it holds one ("14" is not in "140 km", unlike
    FlashRAG's ``acc``, :func:`substring_match`)."""
    pred = f" {normalize_answer(prediction)} "
    return float(any(f" {normalize_answer(a)} " in pred for a in answers
                     if normalize_answer(a)))


# FlashRAG's names for its QA metrics (flashrag/evaluator/metrics.py), computed as it defines
# them on the same normalisation (lower-case, punctuation and a/an/the dropped, whitespace
# collapsed): `em` is :func:`exact_match`; `f1` is :func:`f1_score` except that a "yes",
# "no" or "noanswer" on either side scores 0 unless both are equal; `acc` ("sub-string EM")
# is a normalised gold answer anywhere in the normalised prediction, inside a word too.
FLASHRAG_METRICS = ("em", "f1", "acc")
_CLOSED = ("yes", "no", "noanswer")


def substring_match(prediction: str, answers: Sequence[str]) -> float:
    """FlashRAG's ``acc``: 1.0 if a normalised gold answer is a substring of the normalised
    prediction (characters, not words: "14" is in "140 km")."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(a) in pred for a in answers))


def flashrag_f1(prediction: str, answers: Sequence[str]) -> float:
    """FlashRAG's ``f1``: the best token F1 over the gold answers, where a closed answer
    (yes / no / noanswer) on either side counts only when both are the same, and an empty
    side scores 0."""
    pred = normalize_answer(prediction)
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer)
        if (pred in _CLOSED or gold in _CLOSED) and pred != gold:
            continue
        common = collections.Counter(pred.split()) & collections.Counter(gold.split())
        overlap = sum(common.values())
        if overlap:
            precision, recall = overlap / len(pred.split()), overlap / len(gold.split())
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def first_line(generation: str) -> str:
    """The answer part of a generation: its first non-empty line."""
    for line in generation.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


@dataclasses.dataclass
class QAEvaluator:
    """Few-shot QA (Table 3): the gold answer's log-likelihood under each mode of the
    pipeline, and exact match / F1 of greedy answers for ``generate_modes``;
    ``run(pipe) -> {mode: row}``.

    ``selected`` are the evaluated question indices; the prompt of question ``i`` is
    ``demonstrations`` (question, answer pairs) then the question, and the retrieval query is
    the question alone; ``layout`` (``prompts.QA_LAYOUTS``) puts the demonstrations after the
    document (``document_first``, the paper's ``d ∘ demonstrations ∘ question``) or before it
    (``demonstrations_first``: a prefix every branch shares). ``gold_doc`` maps a question
    index to its gold passage id, or to the tuple of passage ids of its gold document, when
    known (the gold passages' mean weight λ and recall@k are then reported). With
    ``partial``, every per-question record is appended to that JSONL file as it is computed
    and reused on a rerun with the same ``label``: an interrupted evaluation resumes where it
    stopped. After ``run``, ``records[row]`` holds each row's per-question records in
    ``selected`` order (for paired
    intervals between rows or between runs).
    """

    questions: Sequence[str]
    answers: Sequence[Sequence[str]]
    selected: Sequence[int]
    demonstrations: Sequence[tuple[str, str]] = ()
    layout: str = "document_first"
    modes: Sequence[str] = ("none", "replug")
    generate_modes: Sequence[str] = ()
    likelihood: bool = True
    max_new_tokens: int = 16
    gold_doc: dict | None = None
    partial: str | pathlib.Path | None = None
    label: str = "replug"
    row_names: dict | None = None  # mode -> the name of its row (default: the mode)
    progress: bool = True
    name: str = "qa"
    batch_size: int = 1  # questions per LM call (scoring, and generation)
    ids: Sequence[str] | None = None  # each question's id, written into its records
    records: dict = dataclasses.field(default_factory=dict, init=False)

    def __post_init__(self):
        from replug_jax.prompts import QA_LAYOUTS

        if self.layout not in QA_LAYOUTS:
            raise ValueError(f"layout must be one of {QA_LAYOUTS}, got {self.layout!r}")
        if self.layout.startswith("chat_") and self.demonstrations:
            raise ValueError(f"layout {self.layout!r} is zero-shot: give no demonstrations")

    def prompt(self, i: int, tokenizer=None) -> tuple[str, str]:
        """``(prefix, prompt)`` of question ``i`` in the evaluator's layout (the chat layouts
        need the LM's ``tokenizer``)."""
        from replug_jax.prompts import demonstrations_text, qa_branch_input, qa_prompt

        if self.layout.startswith("chat_"):
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(f"layout {self.layout!r} needs an LM with a chat template")
            context, prefix = qa_branch_input(self.questions[i], tokenizer,
                                              self.layout.removeprefix("chat_"))
            return prefix or "", context
        if self.layout == "demonstrations_first":
            return (demonstrations_text(self.demonstrations),
                    qa_prompt(self.questions[i], chat=False))
        return "", qa_prompt(self.questions[i], demonstrations=self.demonstrations, chat=False)

    def _questions(self, pipe, mode: str, idx: Sequence[int],
                   prompts: dict[int, tuple[str, str]]) -> list[dict]:
        """The records of questions ``idx``, scored in one call and answered in another. A
        record's ``cost`` is its share of its call's cost (``shared_by`` questions)."""
        questions = [self.questions[i] for i in idx]
        answers = [list(self.answers[i]) for i in idx]
        prefixes = [prompts[i][0] for i in idx]
        texts = [prompts[i][1] for i in idx]
        # the paper's layout (document, then demonstrations) as prefixes: any pipe takes them
        shared = {"prefixes": prefixes} if any(prefixes) else {}
        # each record names its example, as lm-eval-harness's --log_samples does
        recs = [{**({"id": str(self.ids[i])} if self.ids is not None else {}),
                 "question": self.questions[i], "answers": list(self.answers[i]),
                 "cost": {"lm_calls": 0, "input_tokens": 0}}
                for i in idx]
        if self.likelihood:
            gold = [answer_continuation(a[0], self.layout) for a in answers]
            scored = pipe.score(texts, gold, questions, mode=mode,
                                reliance=False, **shared)
            for rec, i, s in zip(recs, idx, scored):
                rec.update(loglik=s.loglik, cost=_share(s.cost, len(idx)))
                self._retrieved(rec, i, mode, s.doc_ids, s.weights)
        elif mode not in self.generate_modes and mode != "none":  # retrieval alone, no LM call
            branches, _ = pipe.branches(texts, questions, mode=mode, **shared)
            for rec, i, b in zip(recs, idx, branches):
                self._retrieved(rec, i, mode, [p.id for p in b.passages],
                                np.exp(b.log_weights))
        if mode in self.generate_modes:
            generated = pipe.generate(texts, self.max_new_tokens, stop=["\n"], queries=questions,
                                      mode=mode, **shared)
            for rec, gold, g in zip(recs, answers, generated):
                pred = first_line(g.text)
                rec.update(prediction=pred, em=exact_match(pred, gold), f1=f1_score(pred, gold),
                           contains=contains_answer(pred, gold),
                           acc=substring_match(pred, gold), f1_flashrag=flashrag_f1(pred, gold))
                if not self.likelihood:
                    rec["cost"] = _share(g.cost, len(idx))
        return recs

    def _retrieved(self, rec: dict, i: int, mode: str, doc_ids, weights) -> None:
        """Question ``i``'s passages and their weights λ into ``rec``, and, where it names a
        gold passage, the weight λ put on it and whether it was retrieved."""
        if mode == "none":
            return
        rec.update(doc_ids=[int(d) for d in doc_ids],
                   weights=[round(float(w), 6) for w in weights])
        if self.gold_doc is not None and i in self.gold_doc:
            gold = self.gold_doc[i]  # a passage id, or every passage of one document
            gold = set(gold) if isinstance(gold, (tuple, list, set)) else {gold}
            w = dict(zip(rec["doc_ids"], (float(x) for x in weights)))
            rec.update(gold_weight=float(sum(w.get(g, 0.0) for g in gold)),
                       gold_hit=bool(gold & w.keys()))

    def _done(self) -> dict:
        path = pathlib.Path(self.partial) if self.partial is not None else None
        if path is None or not path.exists():
            return {}
        out = {}
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the interruption
                continue
            if rec.pop("label") == self.label:
                out[(rec.pop("mode"), rec.pop("i"))] = rec
        return out

    def run(self, pipe) -> dict:
        from tqdm.auto import tqdm

        tokenizer = getattr(getattr(pipe, "lm", None), "tokenizer", None)
        prompts = {i: self.prompt(i, tokenizer) for i in self.selected}
        done = self._done()
        out = {}
        for mode in self.modes:
            todo = [i for i in self.selected if (mode, i) not in done]
            bar = tqdm(total=len(self.selected), initial=len(self.selected) - len(todo),
                       desc=f"{self.label}:{mode}", disable=not self.progress)
            for start in range(0, len(todo), self.batch_size):
                idx = todo[start:start + self.batch_size]
                recs = self._questions(pipe, mode, idx, prompts)
                for i, rec in zip(idx, recs):
                    done[(mode, i)] = rec
                if self.partial is not None:
                    with open(self.partial, "a") as f:
                        f.writelines(json.dumps({"label": self.label, "mode": mode, "i": i,
                                                 **rec}) + "\n" for i, rec in zip(idx, recs))
                bar.update(len(idx))
            bar.close()
            records = [done[(mode, i)] for i in self.selected]
            row = (self.row_names or {}).get(mode, mode)
            out[row] = summarize_records(records)
            self.records[row] = records
        return out


def _share(cost: dict, n: int) -> dict:
    """One question's share of a call's cost (``cost["shared_by"]`` results; a pipe that does
    not say so is taken to have scored ``n`` together)."""
    together = cost.get("shared_by", n) or 1
    return {"lm_calls": cost["lm_calls"] / together,
            "input_tokens": cost["input_tokens"] / together}


def summarize_records(records: Sequence[dict]) -> dict:
    """One mode's row: mean gold-answer log-likelihood, cost, EM/F1 and the gold passage's
    weight and recall when measured."""
    costs = [r["cost"] for r in records]
    row = {"lm_calls": int(round(sum(c["lm_calls"] for c in costs))),
           "input_tokens": int(round(sum(c["input_tokens"] for c in costs)))}
    if records and all("loglik" in r for r in records):  # not measured: generation or retrieval
        row["mean_answer_loglik"] = float(np.mean([r["loglik"] for r in records]))
    ems = [r["em"] for r in records if "em" in r]
    if ems:
        row.update(exact_match=float(np.mean(ems)),
                   f1=float(np.mean([r["f1"] for r in records if "f1" in r])))
    if records and all("contains" in r for r in records):  # (records written before it lack it)
        row["answer_contained"] = float(np.mean([r["contains"] for r in records]))
    if records and all("acc" in r for r in records):  # FlashRAG's names and definitions
        row["flashrag"] = {"em": float(np.mean([r["em"] for r in records])),
                           "f1": float(np.mean([r["f1_flashrag"] for r in records])),
                           "acc": float(np.mean([r["acc"] for r in records]))}
    gold_w = [r["gold_weight"] for r in records if "gold_weight" in r]
    if gold_w:
        row.update(mean_gold_weight=float(np.mean(gold_w)),
                   gold_recall_at_k=float(np.mean([r["gold_hit"] for r in records
                                                   if "gold_hit" in r])))
    return row
