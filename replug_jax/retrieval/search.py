"""The search contract every index keeps: ``search(queries, k, exclude_ids)`` returns a
:class:`SearchResult` of the top-``k`` passages per query, exclusions (the leakage filter)
applied, missing slots marked -1."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np

from replug_jax.retrieval.corpus import Passage
from replug_jax.retrieval.store import PassageStore


@dataclasses.dataclass
class SearchResult:
    ids: np.ndarray  # [B, k] int64 passage ids, -1 where fewer than k exist
    scores: np.ndarray  # [B, k] float32 similarities, -inf where missing
    passages: list[list[Passage]]  # [B][<=k]

    @property
    def valid(self) -> np.ndarray:
        return self.ids >= 0


def checked_queries(queries_BD, dim: int, k: int) -> np.ndarray:
    """``[B, dim]`` float32 queries for a top-``k`` search, or a ``ValueError``."""
    q = np.ascontiguousarray(np.asarray(queries_BD, np.float32))
    if q.ndim != 2 or q.shape[1] != dim:
        raise ValueError(f"queries must be [B, {dim}], got {q.shape}")
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    bad = ~np.isfinite(q).all(axis=1)
    if bad.any():
        raise ValueError(f"{int(bad.sum())} of {len(q)} queries have NaN or infinite "
                         f"components (first: query {int(np.flatnonzero(bad)[0])}); an encoder "
                         "or a caller produced them: refusing to search with them")
    return q


def checked_vectors(vectors_ND, what: str = "embeddings") -> np.ndarray:
    """``vectors_ND`` unchanged, or a ``ValueError`` naming the first non-finite row (a NaN
    vector would rank first for every query in an exact search)."""
    bad = ~np.isfinite(vectors_ND).all(axis=1)
    if bad.any():
        raise ValueError(f"{what}: {int(bad.sum())} of {len(bad)} vectors have NaN or infinite "
                         f"components (first: row {int(np.flatnonzero(bad)[0])})")
    return vectors_ND


def per_query_exclusions(exclude_ids, num_queries: int) -> list[set[int]]:
    """``exclude_ids`` as one set per query: ``None``, one collection of ids for every query,
    or ``num_queries`` collections (one per query)."""
    if exclude_ids is None:
        return [set() for _ in range(num_queries)]
    items = list(exclude_ids)
    if items and len(items) == num_queries and all(
            isinstance(e, (set, list, tuple, np.ndarray, frozenset)) for e in items):
        return [set(int(i) for i in e) for e in items]
    shared = set(int(i) for i in items)
    return [shared] * num_queries


def assemble(store: PassageStore, scores_BF: np.ndarray, rows_BF: np.ndarray,
             excl: list[set[int]], k: int) -> SearchResult:
    """The top-``k`` of ranked candidates (rows -1 = none) per query, minus exclusions, with
    their passages fetched in one vectorised read."""
    b = scores_BF.shape[0]
    out_ids = np.full((b, k), -1, np.int64)
    out_scores = np.full((b, k), -np.inf, np.float32)
    out_rows = np.full((b, k), -1, np.int64)
    short = 0
    for i in range(b):
        valid = rows_BF[i] >= 0
        ids = store.ids_of(rows_BF[i][valid])
        keep = [(s, j, r) for s, j, r in zip(scores_BF[i][valid], ids, rows_BF[i][valid])
                if int(j) not in excl[i]][:k]
        short += len(keep) < k
        for slot, (s, j, r) in enumerate(keep):
            out_ids[i, slot], out_scores[i, slot], out_rows[i, slot] = j, s, r
    found = out_rows >= 0
    fetched = iter(store.rows(out_rows[found]))
    passages = [[next(fetched) for _ in range(int(found[i].sum()))] for i in range(b)]
    if short:
        warnings.warn(f"asked for k={k} but only {len(store)} passages exist (after "
                      f"exclusions) for {short} of {b} queries; returning what exists",
                      stacklevel=3)
    return SearchResult(out_ids, out_scores, passages)
