"""LM supervision outside the gradient path (paper §4.2), with a persistent cache.

The LM is frozen, so the score of a continuation given (example, document) never changes: it is
computed once by any :class:`~replug_jax.lm.scorer.LMScorer` and stored in SQLite (standard
library, transactional, no pickle) keyed by (example id, passage id, LM id). A restarted run
reuses every score already paid for.
"""

from __future__ import annotations

import functools
import pathlib
import sqlite3
import threading

import numpy as np

from replug_jax.prompts import document_budget, document_prompt
from replug_jax.retrieval import corpus_text
from replug_jax.train.data import Example


class LMScoreCache:
    def __init__(self, path: str | pathlib.Path, lm_id: str):
        self.path = pathlib.Path(path)
        self.lm_id = lm_id
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS scores (example TEXT, doc INTEGER, "
                         "lm TEXT, total REAL, count INTEGER, PRIMARY KEY (example, doc, lm))")
        self._db.commit()
        self.hits = 0
        self.misses = 0

    def get_many(self, keys: list[tuple[str, int]]) -> dict[tuple[str, int], tuple[float, int]]:
        out = {}
        with self._lock:
            for ex, doc in keys:
                row = self._db.execute("SELECT total, count FROM scores WHERE example=? AND "
                                       "doc=? AND lm=?", (ex, doc, self.lm_id)).fetchone()
                if row is not None:
                    out[(ex, doc)] = (row[0], row[1])
        return out

    def put_many(self, items: dict[tuple[str, int], tuple[float, int]]) -> None:
        with self._lock:
            self._db.executemany("INSERT OR REPLACE INTO scores VALUES (?, ?, ?, ?, ?)",
                                 [(ex, doc, self.lm_id, total, count)
                                  for (ex, doc), (total, count) in items.items()])
            self._db.commit()

    def close(self) -> None:
        self._db.close()


def branch_prompts(examples, passages, scorer, separator: str = "\n\n") -> list[str]:
    """The branch inputs ``d ∘ x`` REPLUG scores for (example, passage) pairs, one per pair:
    each document cut from its end so that it, the example's context and its continuation
    fit the LM (:func:`~replug_jax.prompts.document_prompt`, as at inference)."""
    @functools.cache  # per example, not per (example, document) pair
    def budget(ex: Example) -> tuple[int, int]:
        reserve = scorer.count_tokens(ex.continuation)
        return reserve, document_budget(scorer, ex.context, separator, reserve)

    out = []
    for ex, p in zip(examples, passages):
        reserve, room = budget(ex)
        out.append(document_prompt(scorer, corpus_text(p), ex.context, separator=separator,
                                   reserve=reserve, budget=room)[0])
    return out


def lm_scores(examples, doc_ids_BK: np.ndarray, passages_by_id: dict, scorer,
              cache: LMScoreCache, separator: str = "\n\n", reduction: str = "mean",
              chunk: int = 64, count: bool = True) -> tuple[np.ndarray, int]:
    """``[B, K]`` LM scores of each example's continuation given ``d ∘ x`` (0 for padding
    documents, id -1), and the number of (example, document) pairs newly scored. Documents
    longer than the LM context allows are cut from the end (:func:`fit_document`).
    ``count=False``: leave the cache's hit and miss counts alone (a prefetch)."""
    keys = [(ex.id, int(d)) for ex, row in zip(examples, doc_ids_BK) for d in row if d >= 0]
    known = cache.get_many(keys)
    missing = sorted(set(keys) - set(known))
    if count:
        cache.hits += len(keys) - len(missing)
        cache.misses += len(missing)
    by_id = {ex.id: ex for ex in examples}
    for start in range(0, len(missing), chunk):  # stored chunk by chunk: a kill loses little
        part = missing[start:start + chunk]
        prompts = branch_prompts([by_id[ex] for ex, _ in part],
                                 [passages_by_id[d] for _, d in part], scorer, separator)
        conts = [by_id[ex].continuation for ex, _ in part]
        scored = scorer.score_continuations(prompts, conts)
        new = {key: (float(s.logprobs.sum()), len(s.logprobs)) for key, s in zip(part, scored)}
        cache.put_many(new)
        known.update(new)
    out = np.zeros(doc_ids_BK.shape, np.float32)
    for b, (ex, row) in enumerate(zip(examples, doc_ids_BK)):
        for k, d in enumerate(row):
            if d >= 0:
                total, count = known[(ex.id, int(d))]
                out[b, k] = total if reduction == "sum" else total / max(count, 1)
    return out, len(missing)
