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


@dataclasses.dataclass(frozen=True)
class Example:
    id: str
    query: str  # the retrieval query
    context: str  # the LM input that follows the document
    continuation: str  # the ground truth y
    # the gold passage, when known (QA with gold passages): an int is a passage id, a string
    # the corpus's own document id (every passage cut from it counts); resolve_gold makes
    # both a tuple of passage ids
    gold_doc: int | str | tuple[int, ...] | None = None
    source_id: str | None = None  # the document the example was cut from (lm task)
    span: tuple[int, int] | None = None  # its characters in that document (leakage filter)


def qa_examples(path: str | pathlib.Path,
                demonstrations: Sequence[tuple[str, str]] = ()) -> list[Example]:
    """``{"id","question","answer","gold_doc"?}`` lines -> examples with query = the question,
    x = the plain question prompt of :func:`~replug_jax.prompts.qa_prompt` (after the few-shot
    ``demonstrations``, as at inference) and y = ``" " + answer``."""
    out = []
    for i, row in enumerate(read_jsonl(path)):
        if "question" not in row or "answer" not in row:
            raise ValueError(f"{path}: line {i + 1} needs 'question' and 'answer'")
        out.append(Example(str(row.get("id", i)), row["question"],
                           qa_prompt(row["question"], demonstrations=demonstrations,
                                     chat=False),
                           " " + str(row["answer"]).strip(),
                           row.get("gold_doc")))
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
    (a :class:`~replug_jax.retrieval.store.PassageStore`): a ``gold_doc`` is a document id of
    the corpus, whatever its JSON type (``7`` and ``"7"`` name the same document: DPR's
    ``psgs_w100.tsv`` numbers its passages from 1, and a corpus without ids numbers its lines
    from 1), and every passage cut from that document counts. A value that names no document
    is refused in one line, rather than scoring recall 0 before and after training."""
    for e in examples:
        g = e.gold_doc
        if g is not None and not isinstance(g, tuple) and (
                isinstance(g, bool) or not isinstance(g, (int, str))):
            raise ValueError(f"example {e.id!r}: gold_doc must be a document id of the corpus "
                             f"(a string or an integer), got {g!r}")
    named = {str(e.gold_doc) for e in examples
             if e.gold_doc is not None and not isinstance(e.gold_doc, tuple)}
    by_source: dict[str, list[int]] = {}
    if named:  # one pass over the store, only when documents are named
        for p in store:
            if p.source_id in named:
                by_source.setdefault(p.source_id, []).append(p.id)
    out = []
    for e in examples:
        g = e.gold_doc
        if g is None or isinstance(g, tuple):
            out.append(e)
            continue
        ids = by_source.get(str(g))
        if not ids:
            raise ValueError(f"example {e.id!r}: gold_doc {g!r} is no document id of the "
                             f"corpus ({len(store)} passages; ids are the corpus's `id` "
                             "field, or line numbers from 1 where it has none)")
        out.append(dataclasses.replace(e, gold_doc=tuple(ids)))
    return out
