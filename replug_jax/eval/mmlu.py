"""MMLU (Hendrycks et al., 2021) in the paper's 5-shot setting (§6.2, Table 2).

The prompt is the original harness's: ``"The following are multiple choice questions (with
answers) about {subject}."`` followed by the ``shots`` first dev questions of the subject with
their answers and the test question ending in ``"Answer:"``. The prediction is the letter among
``" A"``…``" D"`` with the highest (ensemble) likelihood, so REPLUG and the LM alone are
compared on the same four numbers. The retrieval query is the question (optionally with its
options); retrieval never sees the demonstrations.

Accuracy is reported per subject, per category (humanities, social sciences, STEM, other, the
grouping of Table 2) as micro (over questions) and macro (over subjects) averages, and overall.
"""

from __future__ import annotations

import csv
import dataclasses
import pathlib
from typing import Sequence

import numpy as np

LETTERS = ("A", "B", "C", "D")

# The 57 subjects and their Table 2 category (the MMLU authors' grouping).
CATEGORIES = {
    "STEM": (
        "abstract_algebra", "astronomy", "college_biology", "college_chemistry",
        "college_computer_science", "college_mathematics", "college_physics",
        "computer_security", "conceptual_physics", "electrical_engineering",
        "elementary_mathematics", "high_school_biology", "high_school_chemistry",
        "high_school_computer_science", "high_school_mathematics", "high_school_physics",
        "high_school_statistics", "machine_learning"),
    "humanities": (
        "formal_logic", "high_school_european_history", "high_school_us_history",
        "high_school_world_history", "international_law", "jurisprudence", "logical_fallacies",
        "moral_disputes", "moral_scenarios", "philosophy", "prehistory", "professional_law",
        "world_religions"),
    "social sciences": (
        "econometrics", "high_school_geography", "high_school_government_and_politics",
        "high_school_macroeconomics", "high_school_microeconomics", "high_school_psychology",
        "human_sexuality", "professional_psychology", "public_relations", "security_studies",
        "sociology", "us_foreign_policy"),
    "other": (
        "anatomy", "business_ethics", "clinical_knowledge", "college_medicine", "global_facts",
        "human_aging", "management", "marketing", "medical_genetics", "miscellaneous",
        "nutrition", "professional_accounting", "professional_medicine", "virology"),
}
CATEGORY_OF = {s: c for c, subjects in CATEGORIES.items() for s in subjects}


@dataclasses.dataclass(frozen=True)
class Question:
    subject: str
    question: str
    options: tuple[str, str, str, str]
    answer: int  # index into LETTERS

    def block(self, with_answer: bool) -> str:
        lines = [self.question.strip()] + [f"{ltr}. {o}" for ltr, o in zip(LETTERS, self.options)]
        return "\n".join(lines) + "\nAnswer:" + (f" {LETTERS[self.answer]}\n\n" if with_answer
                                                 else "")


def read_subject(path: str | pathlib.Path, subject: str) -> list[Question]:
    """One MMLU CSV (``question, A, B, C, D, answer``, no header)."""
    path = pathlib.Path(path)
    out = []
    with path.open(newline="", encoding="utf-8") as f:
        for line_no, row in enumerate(csv.reader(f), 1):
            if len(row) != 6 or row[5].strip() not in LETTERS:
                raise ValueError(f"{path}:{line_no}: expected 'question,A,B,C,D,letter', got "
                                 f"{len(row)} fields")
            out.append(Question(subject, row[0], tuple(row[1:5]), LETTERS.index(row[5].strip())))
    return out


def load_mmlu(folder: str | pathlib.Path, split: str = "test",
              subjects: Sequence[str] | None = None) -> dict[str, list[Question]]:
    """``{subject: questions}`` from the release layout ``{split}/{subject}_{split}.csv``."""
    folder = pathlib.Path(folder)
    subjects = list(subjects) if subjects else sorted(CATEGORY_OF)
    unknown = [s for s in subjects if s not in CATEGORY_OF]
    if unknown:
        raise ValueError(f"unknown MMLU subjects {unknown}")
    out = {}
    for s in subjects:
        path = folder / split / f"{s}_{split}.csv"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing")
        out[s] = read_subject(path, s)
    return out


def prompt(question: Question, demonstrations: Sequence[Question]) -> str:
    head = ("The following are multiple choice questions (with answers) about "
            f"{question.subject.replace('_', ' ')}.\n\n")
    return head + "".join(d.block(True) for d in demonstrations) + question.block(False)


def query(question: Question, with_options: bool = False) -> str:
    if not with_options:
        return question.question.strip()
    return question.question.strip() + " " + " ".join(question.options)


def accuracy_table(correct: dict[str, list[bool]]) -> dict:
    """Per-subject accuracy, per-category micro/macro, and overall micro/macro."""
    per_subject = {s: float(np.mean(v)) for s, v in correct.items() if v}
    cats = {}
    for cat, subjects in CATEGORIES.items():
        present = [s for s in subjects if s in per_subject]
        if not present:
            continue
        flat = [x for s in present for x in correct[s]]
        cats[cat] = {"micro": float(np.mean(flat)),
                     "macro": float(np.mean([per_subject[s] for s in present])),
                     "questions": len(flat), "subjects": len(present)}
    flat = [x for v in correct.values() for x in v]
    return {"subjects": per_subject, "categories": cats,
            "overall": {"micro": float(np.mean(flat)) if flat else float("nan"),
                        "macro": float(np.mean(list(per_subject.values())))
                        if per_subject else float("nan"), "questions": len(flat)}}


def evaluate_mmlu(pipe, test: dict[str, list[Question]], dev: dict[str, list[Question]], *,
                  modes: Sequence[str] = ("none", "replug"), shots: int = 5,
                  k: int | None = None, query_with_options: bool = False,
                  progress: bool = True) -> dict:
    """Accuracy of each ``mode`` of ``pipe`` (a :class:`~replug_jax.replug.Replug`)."""
    from tqdm.auto import tqdm

    items = [(s, q) for s, qs in test.items() for q in qs]
    if not items:
        raise ValueError("no MMLU questions to evaluate")
    out = {}
    options = [" " + x for x in LETTERS]
    for mode in modes:
        correct: dict[str, list[bool]] = {s: [] for s in test}
        calls = tokens = 0
        for s, q in tqdm(items, desc=f"mmlu:{mode}", disable=not progress):
            res = pipe.answer_choice(prompt(q, dev[s][:shots]), options,
                                     query(q, query_with_options), mode=mode, k=k)
            correct[s].append(res["choice"] == q.answer)
            calls += res["cost"].get("lm_calls", 0)
            tokens += res["cost"].get("input_tokens", 0)
        out[mode] = {**accuracy_table(correct), "lm_calls": calls, "input_tokens": tokens}
    return out


@dataclasses.dataclass
class MMLUEvaluator:
    """MMLU (Table 2): accuracy per subject and category for each mode, ``run(pipe) -> dict``."""

    test: dict
    dev: dict
    modes: Sequence[str] = ("none", "replug")
    shots: int = 5
    query_with_options: bool = False
    progress: bool = True
    name: str = "mmlu"

    def run(self, pipe) -> dict:
        return evaluate_mmlu(pipe, self.test, self.dev, modes=self.modes, shots=self.shots,
                             query_with_options=self.query_with_options,
                             progress=self.progress)
