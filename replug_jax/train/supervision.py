"""LM supervision outside the gradient path (paper §4.2), with a persistent cache.

The LM is frozen, so the score of a continuation given (example, document) never changes: it is
computed once by any :class:`~replug_jax.lm.scorer.LMScorer` and kept in a
:class:`~replug_jax.lm.score_store.ScoreStore`, the content-keyed store of per-token log-probs
the pool studies use (parts written atomically, no pickle). A restarted run reuses every score
already paid for.
"""

from __future__ import annotations

import functools
import json
import pathlib
import threading
import time

import numpy as np

from replug_jax.lm.score_store import ScoreStore, pair_key
from replug_jax.prompts import document_budget, document_prompt
from replug_jax.retrieval import corpus_text
from replug_jax.train.data import Example


class LMScoreCache:
    """The LM scores of (example, passage) pairs, on a :class:`ScoreStore` for one LM.

    A pair's key is its content before the document is fitted to the LM's context: the
    document's text, the separator and the example's context, with the continuation. For one
    LM (the store's) that text fixes the prompt the LM is given, so a hit needs no
    tokenisation; the same pair in another run, split or example id is found. ``hits`` and
    ``misses`` count the steps' lookups."""

    def __init__(self, directory: str | pathlib.Path, lm_id: str):
        self.store = ScoreStore(directory, lm_id)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(example: Example, passage, separator: str) -> str:
        branch = json.dumps([corpus_text(passage), separator, example.context])
        return pair_key(branch, example.continuation)

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self.store

    def totals(self, key: str) -> tuple[float, int]:
        """(summed log-prob, tokens) of a stored pair."""
        with self._lock:
            logprobs, _ = self.store.get(key)
        return float(logprobs.sum()), len(logprobs)

    def add(self, keys: list[str], logprobs: list[np.ndarray], seconds: float) -> None:
        with self._lock:
            self.store.add(keys, logprobs, seconds)


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
    longer than the LM context allows are cut from the end (:func:`fit_document`). The new
    pairs are scored ``chunk`` at a time and stored as one part (a kill loses one call's).
    ``count=False``: leave the cache's hit and miss counts alone (a prefetch)."""
    keyed = [(b, k, cache.key(ex, passages_by_id[int(d)], separator), ex, int(d))
             for b, (ex, row) in enumerate(zip(examples, doc_ids_BK))
             for k, d in enumerate(row) if d >= 0]
    pairs = {key: (ex, d) for _, _, key, ex, d in keyed}
    missing = [key for key in pairs if key not in cache]
    if count:
        cache.hits += len(keyed) - len(missing)
        cache.misses += len(missing)
    new_rows, t0 = [], time.perf_counter()
    for start in range(0, len(missing), chunk):
        part = [pairs[key] for key in missing[start:start + chunk]]
        prompts = branch_prompts([ex for ex, _ in part], [passages_by_id[d] for _, d in part],
                                 scorer, separator)
        scored = scorer.score_continuations(prompts, [ex.continuation for ex, _ in part])
        new_rows += [s.logprobs for s in scored]
    cache.add(missing, new_rows, time.perf_counter() - t0)
    out = np.zeros(doc_ids_BK.shape, np.float32)
    for b, k, key, _, _ in keyed:  # each pair's key made once
        total, n = cache.totals(key)
        out[b, k] = total if reduction == "sum" else total / max(n, 1)
    return out, len(missing)
