"""LSR training examples: language modelling (x = 128 tokens, y = the next 128, §5.2) and
question answering (x = question, y = answer), behind one :class:`Example` type.

Iteration is a pure function of the step: batch ``s`` holds examples ``[s·B, (s+1)·B)`` of the
concatenation of per-epoch permutations seeded by ``(seed, epoch)``, so resuming at any step
needs nothing but the step number.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Sequence

import numpy as np

from replug_jax.fileio import read_jsonl, read_jsonl_lines
from replug_jax.prompts import qa_prompt
from replug_jax.retrieval.corpus import document_id
from replug_jax.retrieval.store import gold_of


@dataclasses.dataclass(frozen=True)
class Example:
    id: str
    query: str  # the retrieval query
    context: str  # the LM input that follows the document
    continuation: str  # the ground truth y
    # the gold, when known (QA with gold passages): gold_doc, the corpus's own document id
    # (every passage cut from it counts), or gold_passage, a tuple of passage ids;
    # resolve_gold makes both a tuple of passage ids
    gold_doc: int | str | tuple[int, ...] | None = None
    source_id: str | None = None  # the document the example was cut from (lm task)
    span: tuple[int, int] | None = None  # its characters in that document (leakage filter)


def qa_examples(path: str | pathlib.Path,
                demonstrations: Sequence[tuple[str, str]] = ()) -> list[Example]:
    """``{"id","question","answer","gold_doc"? | "gold_passage"?}`` lines -> examples with
    query = the question, x = the plain question prompt of
    :func:`~replug_jax.prompts.qa_prompt` (after the few-shot ``demonstrations``, as at
    inference) and y = ``" " + answer``."""
    out = []
    for i, row in enumerate(read_jsonl(path)):
        if "question" not in row or "answer" not in row:
            raise ValueError(f"{path}: line {i + 1} needs 'question' and 'answer'")
        out.append(Example(str(row.get("id", i)), row["question"],
                           qa_prompt(row["question"], demonstrations=demonstrations,
                                     chat=False),
                           " " + str(row["answer"]).strip(),
                           gold_of(row, f"{path}: line {i + 1}")))
    return out


def read_demonstrations(path: str | pathlib.Path) -> list[tuple[str, str]]:
    """Few-shot ``(question, answer)`` pairs from ``{"question","answer"}`` JSONL lines."""
    rows = read_jsonl(path)
    for i, row in enumerate(rows):
        if "question" not in row or "answer" not in row:
            raise ValueError(f"{path}: line {i + 1} needs 'question' and 'answer'")
    return [(r["question"], str(r["answer"]).strip()) for r in rows]


def lm_examples(path: str | pathlib.Path, tokenizer, context_tokens: int = 128,
                continuation_tokens: int = 128) -> list[Example]:
    """``{"id","text"}`` lines split into windows: x = ``context_tokens`` tokens, y = the next
    ``continuation_tokens`` (the paper's 128 + 128). The query is x. Each example records its
    source row and character span, so a corpus holding the same text can be filtered
    (:func:`~replug_jax.retrieval.corpus.leakage_exclusions`)."""
    out = []
    width = context_tokens + continuation_tokens
    for lineno, row in read_jsonl_lines(path):
        text = row.get("text") or ""
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        for w, start in enumerate(range(0, len(offsets) - width + 1, width)):
            a = offsets[start][0]
            b = offsets[start + context_tokens][0]
            c = offsets[start + width - 1][1]
            source = document_id(row, lineno)  # as the corpus reader names the same row
            out.append(Example(f"{source}:{w}", text[a:b], text[a:b], text[b:c],
                               source_id=source, span=(a, c)))
    if not out:
        raise ValueError(f"{path}: no text long enough for {width}-token windows")
    return out


def batch_indices(step: int, batch_size: int, n: int, seed: int) -> np.ndarray:
    """Example indices of batch ``step``: deterministic, resumable from the step alone."""
    if n == 0:
        raise ValueError("no training examples")
    start = step * batch_size
    out = np.empty(batch_size, np.int64)
    for j in range(batch_size):
        pos = start + j
        epoch, offset = divmod(pos, n)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        out[j] = perm[offset]
    return out


def resolve_gold(examples: Sequence[Example], store) -> list[Example]:
    """``examples`` with every ``gold_doc`` as the tuple of passage ids it names in ``store``
    (:func:`~replug_jax.retrieval.store.gold_passages`: the corpus's document id, whatever its
    type; refused in one line when it names none)."""
    from replug_jax.retrieval.store import gold_passages

    ids = gold_passages([e.gold_doc for e in examples], store, [e.id for e in examples])
    return [e if e.gold_doc == g else dataclasses.replace(e, gold_doc=g)
            for e, g in zip(examples, ids)]
