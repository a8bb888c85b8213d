"""Open-domain QA metrics: the standard SQuAD/DPR answer normalisation, exact match and F1."""

from __future__ import annotations

import collections
import re
import string
from typing import Sequence

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


def first_line(generation: str) -> str:
    """The answer part of a generation: its first non-empty line."""
    for line in generation.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""
