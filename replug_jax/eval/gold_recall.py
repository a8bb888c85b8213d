"""Retrieval quality: recall@k of gold passages."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Sequence

import numpy as np


@dataclasses.dataclass
class RetrievalEvaluator:
    """Recall@k: the fraction of ``queries`` whose gold passage id is among the top k
    retrieved by the pipeline's retriever and index; ``run(pipe) -> dict``."""

    queries: Sequence[str]
    gold_ids: Sequence[int]
    ks: Sequence[int] = (1, 5, 10)
    name: str = "retrieval"

    def run(self, pipe) -> dict:
        if len(self.queries) != len(self.gold_ids) or not self.queries:
            raise ValueError(f"{len(self.queries)} queries for {len(self.gold_ids)} gold ids")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fewer passages than max(ks): recall counts them
            hits = pipe.index.search(pipe.retriever.encode_queries(list(self.queries)),
                                     max(self.ks))
        return {"queries": len(self.queries),
                **{f"recall@{k}": float(np.mean([g in row[:k] for g, row in
                                                 zip(self.gold_ids, hits.ids)]))
                   for k in self.ks}}
