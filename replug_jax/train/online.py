"""The online supervision source of :class:`~replug_jax.train.loop.LSRTrainer`
(``cfg.supervision.kind="online"``): each step's batch retrieved from the index in use, the LM's
scores of the (example, document) pairs it brings (scored as needed into the score store, or
ahead of the steps by the prefetcher and ``supervision.prescore_pool``), and the online dev metrics.
The pool source is :class:`~replug_jax.train.pool_source.PoolSource`."""

from __future__ import annotations

import time
import warnings

import numpy as np

from replug_jax.fileio import write_json_atomic
from replug_jax.retrieval import DeviceIndex, corpus_text
from replug_jax.sharding import local_rows
from replug_jax.train.data import Example, batch_indices, resolve_gold
from replug_jax.train.lsr import encoder_params
from replug_jax.train.supervision import branch_keys, lm_scores


def _quietly(fn, *args):
    """``fn(*args)`` with warnings off: truncated long queries and exclusions that leave fewer
    than k passages are expected in training and would repeat at every step."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


class OnlineSupervision:
    """What :class:`~replug_jax.train.loop.LSRTrainer` does with online supervision; it
    reads the trainer's ``cfg``, ``retriever``, ``index``, ``lm``, ``cache``, ``by_id``,
    ``train``, ``exclusions``, ``prefetcher``, ``state`` and process ids."""

    def _tokenize(self, texts: list[str], length: int, side: str = "right"
                  ) -> tuple[np.ndarray, np.ndarray]:
        """Fixed-length ``[N, length]`` ids and mask, cut exactly as the retriever cuts them
        when it builds the index (passages) or encodes queries (``side``)."""
        return self.retriever.tokenize_fixed(texts, length, side)

    def _batch(self, step: int) -> tuple[dict, dict]:
        cfg = self.cfg
        batch_examples, examples = self.step_examples(step)
        params = encoder_params(self.state.params) if self.pcount == 1 else \
            self.encoder_params
        queries = self.retriever.encode_queries([e.query for e in examples], params=params)
        hits = _quietly(self._search, queries, cfg.k, batch_examples)
        t0 = time.perf_counter()
        prefetched = self.prefetcher.wait(step)  # what it scored ahead for this step
        with self.prefetcher.lm_lock:
            scores, new = lm_scores(examples, hits.ids, self.by_id, self.lm, self.cache,
                                    cfg.data.separator, cfg.objective.lm_score)
        # pairs newly scored for this step, here or ahead of it: the same count either way
        if prefetched:
            new += len(prefetched & self.pair_keys(examples, hits.ids))
        lm_seconds = time.perf_counter() - t0
        q_ids, q_mask = _quietly(self._tokenize, [e.query for e in examples],
                                 cfg.retriever.query_max_length, self.retriever.query_truncation)
        docs = [corpus_text(self.by_id[int(d)]) if d >= 0 else "" for d in hits.ids.reshape(-1)]
        d_ids, d_mask = self._tokenize(docs, cfg.retriever.doc_max_length)
        b, k = hits.ids.shape
        batch = {"query_ids": q_ids, "query_mask": q_mask,
                 "doc_ids": d_ids.reshape(b, k, -1), "doc_mask": d_mask.reshape(b, k, -1),
                 "doc_valid": hits.ids >= 0, "lm_scores": scores}
        found = [bool(set(e.gold_doc or ()) & set(row.tolist()))
                 for e, row in zip(examples, hits.ids)]
        if self.pcount > 1:  # the batch-wide numbers, identical on every process
            from jax.experimental import multihost_utils as mh

            found = list(np.asarray(mh.process_allgather(np.array(found), tiled=True)))
            new = int(np.sum(mh.process_allgather(np.array([new]))))
            lm_seconds = float(np.max(mh.process_allgather(np.array([lm_seconds]))))
        info = {"lm_new_pairs": new, "lm_seconds": lm_seconds,
                "gold_in_topk": float(np.mean(found))
                if all(e.gold_doc is not None for e in examples) else None}
        return batch, info

    def step_examples(self, step: int) -> tuple[list[Example], list[Example]]:
        """Step ``step``'s whole batch of examples, and this process's rows of it."""
        idx = batch_indices(step, self.cfg.batch_size, len(self.train), self.cfg.seed)
        batch = [self.train[i] for i in idx]
        return batch, batch[local_rows(len(batch))]

    def pair_keys(self, examples: list[Example], doc_ids_BK: np.ndarray) -> set[str]:
        """The LM-score store's keys of the (example, document) pairs (ids -1 left out)."""
        pairs = [(e, self.by_id[int(d)]) for e, row in zip(examples, doc_ids_BK)
                 for d in row if d >= 0]
        keys, _ = branch_keys([e for e, _ in pairs], [p for _, p in pairs], self.lm,
                              self.cfg.data.separator)
        return set(keys)

    def score_pairs(self, examples: list[Example], doc_ids_BK: np.ndarray) -> None:
        """Score into the cache the (example, document) pairs it lacks (a prefetch: the
        cache's hit and miss counts are the steps' own)."""
        lm_scores(examples, doc_ids_BK, self.by_id, self.lm, self.cache, self.cfg.data.separator,
                  self.cfg.objective.lm_score, count=False)

    def _excluded(self, examples: list[Example]) -> list[list[int]]:
        return [self.exclusions.get(e.id, []) for e in examples]

    def _search(self, queries_BD: np.ndarray, k: int, batch: list[Example]):
        """Search with this process's queries (``batch``: the whole batch's examples, in
        order, for the leakage filter). The sharded JAX index is one global computation, so
        with several processes every one searches everyone's queries and keeps its own rows;
        a FAISS index is local to each process."""
        if self.pcount == 1 or not isinstance(self.index, DeviceIndex):
            return self.index.search(queries_BD, k, self._excluded(batch[local_rows(len(batch))]))
        from jax.experimental import multihost_utils as mh

        everyone = np.asarray(mh.process_allgather(np.asarray(queries_BD), tiled=True))
        hits = self.index.search(everyone, k, self._excluded(batch))
        mine = local_rows(len(everyone))
        return type(hits)(hits.ids[mine], hits.scores[mine], hits.passages[mine])

    def prescore(self, start: int, end: int, chunk: int = 256) -> dict:
        """Score, in large batches, the top-``supervision.prescore_pool`` candidates of the
        current index for every example of steps ``[start, end)`` not yet in the cache (this
        process's rows). The scores are the same the steps would compute; they are only paid
        for up front."""
        cfg = self.cfg
        if self.pcount > 1:
            raise ValueError("supervision.prescore_pool is for single-process runs (every "
                             "process would need the same number of searches); set "
                             "supervision.prescore_pool=0")
        rows = sorted({int(i) for s in range(start, end)
                       for i in batch_indices(s, cfg.batch_size, len(self.train),
                                              cfg.seed)[local_rows(cfg.batch_size)]})
        examples = [self.train[i] for i in rows]
        t0 = time.perf_counter()
        queries = self.retriever.encode_queries([e.query for e in examples],
                                                params=self.encoder_params)
        hits = _quietly(self.index.search, queries, cfg.supervision.prescore_pool,
                        self._excluded(examples))
        new = 0
        for i in range(0, len(examples), max(1, chunk // cfg.supervision.prescore_pool)):
            part = slice(i, i + max(1, chunk // cfg.supervision.prescore_pool))
            new += lm_scores(examples[part], hits.ids[part], self.by_id, self.lm, self.cache,
                             cfg.data.separator, cfg.objective.lm_score, chunk=chunk)[1]
        info = {"examples": len(examples), "pool": cfg.supervision.prescore_pool,
                "new_pairs": new,
                "seconds": round(time.perf_counter() - t0, 2)}
        if self.pid == 0:
            write_json_atomic(info, self.workdir / "prescore.json")
        return info

    def evaluate(self, examples: list[Example], k: int | None = None) -> dict:
        """Recall@1/5/k of gold passages (when known) and P_R–Q agreement on ``examples``:
        the current parameters' queries searched in the index in use (before the first step,
        the index of those parameters; after the last, that of the last refresh, as training
        retrieved), never a re-embedded copy of the corpus."""
        k = k or self.cfg.k
        examples = resolve_gold(examples, self.store)
        queries = self.retriever.encode_queries([e.query for e in examples],
                                                params=self.encoder_params)
        hits = _quietly(self.index.search, queries, max(k, 5),
                        self._excluded(examples))  # recall@5
        out = {"examples": len(examples)}
        gold = [set(e.gold_doc) if e.gold_doc is not None else None for e in examples]
        if all(g is not None for g in gold):
            for r in sorted({1, 5, k}):
                out[f"recall@{r}"] = float(np.mean([bool(g & set(row[:r].tolist()))
                                                    for g, row in zip(gold, hits.ids)]))
        top_k = hits.ids[:, :k]
        scores, _ = lm_scores(examples, top_k, self.by_id, self.lm, self.cache,
                              self.cfg.data.separator, self.cfg.objective.lm_score)
        agree = [int(np.argmax(s[row >= 0]) == 0) for s, row in zip(scores, top_k)]
        out["top1_is_lm_best"] = float(np.mean(agree))
        return out
