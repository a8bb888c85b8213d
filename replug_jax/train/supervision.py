"""LM supervision outside the gradient path (paper §4.2), with a persistent cache.

The LM is frozen, so the score of a continuation given (example, document) never changes: it is
computed once by any :class:`~replug_jax.lm.scorer.LMScorer` and kept in a
:class:`~replug_jax.lm.score_store.ScoreStore`, the content-keyed store of per-token log-probs
the pool studies use (parts written atomically, no pickle). A restarted run reuses every score
already paid for.
"""

from __future__ import annotations

import functools
import pathlib
import threading
import time

import numpy as np

from replug_jax.lm.score_store import ScoreStore, pair_key
from replug_jax.prompts import document_budget, document_prompt
from replug_jax.retrieval import corpus_text
from replug_jax.train.data import Example


class LMScoreCache:
    """The trainer's door to the LM's scores of (example, passage) pairs: a
    :class:`ScoreStore` for one LM, thread-safe (the prefetcher scores beside the step), with
    ``hits`` and ``misses`` counting the steps' lookups.

    A pair is keyed as every other user of a store keys it (:func:`branch_keys`: the prompt
    ``d ∘ x`` REPLUG scores, the document fitted to the LM's context, with the continuation),
    so pools, :class:`~replug_jax.lm.score_store.StoredLM` pipelines (``replug eval``, the
    studies) and training runs over one store score each pair once; the same pair in another
    run, split or example id is found."""

    def __init__(self, directory: str | pathlib.Path, lm_id: str):
        self.store = ScoreStore(directory, lm_id)
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __contains__(self, key: str) -> bool:
        with self._lock:
            return key in self.store

    def totals(self, key: str) -> tuple[float, int]:
        """(summed log-prob, tokens) of a stored pair."""
        with self._lock:
            logprobs, _ = self.store.get(key)
        return float(logprobs.sum()), len(logprobs)

    def add(self, keys: list[str], scores: list, seconds: float) -> None:
        """Keep one call's :class:`~replug_jax.lm.scorer.ContinuationScore` objects whole
        (tokens too), so that a :class:`~replug_jax.lm.score_store.StoredLM` over the store
        serves them as well."""
        with self._lock:
            self.store.add_scores(keys, scores, seconds)


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


def branch_keys(examples, passages, scorer, separator: str = "\n\n"
                ) -> tuple[list[str], list[str]]:
    """``(keys, prompts)`` of (example, passage) pairs: each pair's branch prompt
    (:func:`branch_prompts`) and its store key, ``pair_key(prompt, continuation)``, the key
    of :class:`~replug_jax.lm.score_store.StoredLM` and of pool builds."""
    prompts = branch_prompts(examples, passages, scorer, separator)
    return [pair_key(p, ex.continuation) for p, ex in zip(prompts, examples)], prompts


def lm_scores(examples, doc_ids_BK: np.ndarray, passages_by_id: dict, scorer,
              cache: LMScoreCache, separator: str = "\n\n", reduction: str = "mean",
              chunk: int = 64, count: bool = True) -> tuple[np.ndarray, int]:
    """``[B, K]`` LM scores of each example's continuation given ``d ∘ x`` (0 for padding
    documents, id -1), and the number of (example, document) pairs newly scored. Documents
    longer than the LM context allows are cut from the end (:func:`fit_document`). The new
    pairs are scored ``chunk`` at a time and stored as one part (a kill loses one call's).
    ``count=False``: leave the cache's hit and miss counts alone (a prefetch)."""
    cells = [(b, k, ex, int(d)) for b, (ex, row) in enumerate(zip(examples, doc_ids_BK))
             for k, d in enumerate(row) if d >= 0]
    keys, prompts = branch_keys([ex for _, _, ex, _ in cells],
                                [passages_by_id[d] for *_, d in cells], scorer, separator)
    missing: dict[str, int] = {}  # each pair the store lacks, once: its first cell
    for i, key in enumerate(keys):
        if key not in missing and key not in cache:
            missing[key] = i
    if count:
        cache.hits += len(keys) - len(missing)
        cache.misses += len(missing)
    todo, new_rows, t0 = list(missing.values()), [], time.perf_counter()
    for start in range(0, len(todo), chunk):
        part = todo[start:start + chunk]
        scored = scorer.score_continuations([prompts[i] for i in part],
                                            [cells[i][2].continuation for i in part])
        new_rows += scored
    cache.add(list(missing), new_rows, time.perf_counter() - t0)
    out = np.zeros(doc_ids_BK.shape, np.float32)
    for (b, k, _, _), key in zip(cells, keys):
        total, n = cache.totals(key)
        out[b, k] = total if reduction == "sum" else total / max(n, 1)
    return out, len(missing)
