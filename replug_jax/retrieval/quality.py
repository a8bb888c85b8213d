"""Search quality the user can see and set: recall of an approximate index against exact
search, measured on the user's data, and the fastest setting that reaches a target.

Recall@k of a query is the fraction of its top-k that the index returns: a returned row is a
hit when its exact score reaches the k-th exact score (inner product, streamed over the stored
embeddings: one pass, memory of one block), so rows tied with the exact top-k (duplicated
vectors) count as hits rather than as misses. Queries are a seeded sample of the corpus's own
vectors (each query's own row left out, so it never counts as a free hit) or the user's
queries (``--recall-queries``), which are distributed like real queries. The mean comes with a
95 % interval that keeps its coverage at recall 1 (:func:`recall_interval`: Clopper–Pearson
on the summed per-query recalls; a percentile bootstrap collapses to [1, 1] when every sampled
query is perfect).

Tuning searches nprobe × re-rank factor (FAISS's ``ParameterSpace`` sets nprobe; its
``OperatingPoints`` keeps the recall/time frontier) for the fastest setting whose interval's
lower bound reaches the target; a target that the number of queries cannot certify even with
every query perfect (:func:`min_queries`) is refused, or the corpus sample is enlarged.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib
import time
from typing import Sequence

import numpy as np

from replug_jax.retrieval.embeddings import EmbeddingSource
from replug_jax.retrieval.faiss_index import Index

NPROBES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
EXACT_BLOCK_ROWS = 65536  # corpus rows scored per block of the exact search
RERANKS = (0, 2, 4, 8, 16, 32, 64, 128)


@dataclasses.dataclass(frozen=True)
class Exact:
    """Exact top-k of each query: rows ``[Q, k]`` and their scores, best first."""

    rows_QK: np.ndarray
    scores_QK: np.ndarray


# A returned row is a hit when its exact score is within this (relative) distance of the k-th
# exact score: equal vectors scored in different summation orders differ by float rounding.
TIE_TOLERANCE = 1e-5


def exact_neighbours(source: EmbeddingSource, queries_QD: np.ndarray, k: int, *,
                     exclude_rows: np.ndarray | None = None,
                     block: int = EXACT_BLOCK_ROWS) -> Exact:
    """The exact inner-product top-k over ``source``, one pass in blocks (each query's
    ``exclude_rows`` entry, if given, never returned)."""
    q = np.asarray(queries_QD, np.float32)
    best_s = np.full((len(q), 0), -np.inf, np.float32)
    best_r = np.zeros((len(q), 0), np.int64)
    for lo in range(0, source.n, block):
        x = source.rows(lo, min(source.n, lo + block))
        s = q @ x.T
        if exclude_rows is not None:
            own = exclude_rows - lo
            inside = (own >= 0) & (own < len(x))
            s[np.flatnonzero(inside), own[inside]] = -np.inf
        s = np.concatenate([best_s, s], 1)
        r = np.concatenate([best_r, np.broadcast_to(np.arange(lo, lo + len(x)),
                                                    (len(q), len(x)))], 1)
        if s.shape[1] > k:  # the k best of this block and the running best, then ordered
            part = np.argpartition(-s, k - 1, axis=1)[:, :k]
            s, r = np.take_along_axis(s, part, 1), np.take_along_axis(r, part, 1)
        keep = np.argsort(-s, axis=1, kind="stable")[:, :k]
        best_s, best_r = np.take_along_axis(s, keep, 1), np.take_along_axis(r, keep, 1)
    return Exact(best_r, best_s)


def recall_interval(recalls_Q: np.ndarray, confidence: float = 0.95) -> tuple[float, float]:
    """A two-sided ``confidence`` interval for the mean of per-query recalls in [0, 1]:
    Clopper–Pearson on their sum as if it were a binomial count of ``Q`` trials (for
    independent variables in [0, 1] with a given mean, the binomial is the most spread one, so
    the interval is conservative). At recall 1 on every query its lower bound is
    ``(α/2)^(1/Q)``, not 1: 64 perfect queries certify recall ≥ 0.944, not 0.999."""
    from scipy.stats import beta

    v = np.clip(np.asarray(recalls_Q, np.float64), 0.0, 1.0)
    n, x = len(v), float(v.sum())
    alpha = 1.0 - confidence
    low = 0.0 if x <= 0 else float(beta.ppf(alpha / 2, x, n - x + 1))
    high = 1.0 if x >= n else float(beta.ppf(1 - alpha / 2, x + 1, n - x))
    return low, high


def min_queries(target: float, confidence: float = 0.95) -> int:
    """The fewest queries whose interval's lower bound can reach ``target`` at all (every
    query perfect): ``(α/2)^(1/Q) ≥ target``."""
    if not 0 < target < 1:
        raise ValueError(f"a recall target must be in (0, 1), got {target}")
    return int(np.ceil(np.log((1 - confidence) / 2) / np.log(target)))


def measure(index: Index, source: EmbeddingSource, queries_QD: np.ndarray, exact: Exact,
            k: int, *, nprobe: int | None = None, rerank: int | None = None,
            exclude_rows: np.ndarray | None = None) -> dict:
    """Recall@k of ``index`` (at ``nprobe`` / ``rerank``, default: its manifest's) against
    ``exact``, with its interval and the queries per second of the search. A returned row
    counts when its exact score (recomputed from ``source``) reaches the k-th exact score."""
    extra = 1 if exclude_rows is not None else 0
    t0 = time.perf_counter()
    res = index.search(queries_QD, k + extra, nprobe=nprobe, rerank=rerank)
    seconds = time.perf_counter() - t0
    rows = _rows_of(index, res.ids)
    kth_Q = exact.scores_QK[:, k - 1]
    tol_Q = TIE_TOLERANCE * np.maximum(1.0, np.abs(kth_Q))
    kept = [list(dict.fromkeys(r for r in got if r >= 0 and (
        exclude_rows is None or r != exclude_rows[i])))[:k] for i, got in enumerate(rows)]
    unique = np.unique(np.array([r for got in kept for r in got], np.int64))
    vectors = source.take(unique) if len(unique) else np.zeros((0, source.dim), np.float32)
    at = {int(r): j for j, r in enumerate(unique)}  # one read of every returned row
    hits = []
    for i, got in enumerate(kept):
        s = vectors[[at[r] for r in got]] @ np.asarray(queries_QD[i], np.float32)
        hits.append(float(np.sum(s >= kth_Q[i] - tol_Q[i])) / k)
    low, high = recall_interval(np.array(hits))
    return {"k": k, "recall": float(np.mean(hits)), "low": low, "high": high,
            "queries": len(hits), "qps": len(hits) / max(seconds, 1e-9),
            "nprobe": index.manifest.get("nprobe") if nprobe is None else nprobe,
            "rerank": index.manifest.get("rerank_factor", 0) if rerank is None else rerank}


def _rows_of(index: Index, ids_QK: np.ndarray) -> np.ndarray:
    """Store rows of passage ids (ids and rows coincide unless the corpus numbered them)."""
    rows = np.full(ids_QK.shape, -1, np.int64)
    valid = ids_QK >= 0
    rows[valid] = index.store.rows_of(ids_QK[valid])
    return rows


def tune(index: Index, source: EmbeddingSource, queries_QD: np.ndarray, exact: Exact, k: int,
         target: float, *, exclude_rows: np.ndarray | None = None,
         nprobes: Sequence[int] | None = None, reranks: Sequence[int] | None = None) -> dict:
    """The fastest (nprobe, re-rank) whose recall@k interval's lower bound reaches ``target``
    (else the most accurate one, flagged), and the measured frontier. Refuses a target that
    ``len(queries_QD)`` queries cannot certify (:func:`min_queries`)."""
    import faiss

    need = min_queries(target)
    if len(queries_QD) < need:
        raise ValueError(f"recall target {target} needs at least {need} queries to be "
                         f"certified (95 % lower bound), got {len(queries_QD)}; give more "
                         "queries or a lower target")

    nlist = _nlist(index)
    nprobes = [p for p in (nprobes or NPROBES) if nlist and p <= nlist] or [None]
    reranks = [r for r in (reranks or RERANKS) if r == 0 or index.has_vectors]
    points = faiss.OperatingPoints()
    measured = []
    for rerank in reranks:
        for nprobe in nprobes:
            m = measure(index, source, queries_QD, exact, k, nprobe=nprobe, rerank=rerank,
                        exclude_rows=exclude_rows)
            measured.append(m)
            points.add(m["low"], 1.0 / m["qps"], f"{nprobe},{rerank}")
            if m["low"] >= target:  # more probes only cost time at this re-rank factor
                break
    frontier = [points.optimal_pts.at(i) for i in range(points.optimal_pts.size())]
    frontier = [p for p in frontier if p.key]  # FAISS seeds it with an empty point
    frontier = [{"nprobe": _int(p.key.split(",")[0]), "rerank": int(p.key.split(",")[1]),
                 "recall_low": float(p.perf), "seconds_per_query": float(p.t)}
                for p in frontier]
    good = [m for m in measured if m["low"] >= target]
    best = min(good, key=lambda m: 1.0 / m["qps"]) if good else max(
        measured, key=lambda m: (m["recall"], m["qps"]))
    return {"target": target, "reached": bool(good), "best": best, "measured": measured,
            "frontier": frontier}


def _int(text: str) -> int | None:
    return None if text == "None" else int(text)


def _nlist(index: Index) -> int:
    import faiss

    ivf = faiss.try_extract_index_ivf(index.shards[0][0])
    return int(ivf.nlist) if ivf is not None else 0


def recall_report(index: Index, source: EmbeddingSource, *, k: int = 10,
                  user_k: int | None = None, queries_QD: np.ndarray | None = None,
                  sample: int = 256, seed: int = 0, target: float | None = None) -> dict:
    """Recall@k (and @``user_k``) of ``index`` at its defaults, on the user's queries or a
    seeded sample of the corpus's vectors; with ``target``, the tuned setting too (which the
    caller records as the index's default). Returns what the manifest stores under
    ``recall``."""
    exclude = None
    if queries_QD is None:
        if target is not None:  # enough corpus queries to certify the target, if it has them
            sample = max(sample, min(min_queries(target), source.n))
        rows = np.sort(np.random.default_rng(seed).choice(source.n, min(sample, source.n),
                                                          replace=False))
        queries_QD, exclude, kind = source.take(rows), rows, "corpus sample"
    else:
        kind = "user queries"
    room = source.n - (1 if exclude is not None else 0)  # a query's own row never counts
    ks = sorted({min(k, room), min(user_k or k, room)})
    k = ks[0] if k > room else k
    exact = exact_neighbours(source, queries_QD, max(ks), exclude_rows=exclude)
    out = {"queries": kind, "n": int(len(queries_QD)), "seed": seed}
    if target is not None:
        tuned = tune(index, source, queries_QD, exact, k, target, exclude_rows=exclude)
        out["tuning"], out["tuned_k"] = tuned, k
        index.manifest["nprobe"] = tuned["best"]["nprobe"] or index.manifest.get("nprobe")
        index.manifest["rerank_factor"] = tuned["best"]["rerank"]
        index.set_nprobe(index.manifest["nprobe"])
    out["at"] = {str(kk): measure(index, source, queries_QD, exact, kk, exclude_rows=exclude)
                 for kk in ks}
    return out


def read_queries(path: pathlib.Path, retriever=None) -> np.ndarray:
    """Recall queries from a file: an ``[Q, D]`` ``.npy`` of vectors, or text, one query per
    line, embedded with ``retriever``'s query encoder."""
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False).astype(np.float32)
    lines = [t for t in path.read_text(encoding="utf-8").splitlines() if t.strip()]
    if not lines:
        raise ValueError(f"{path}: no queries")
    return retriever.encode_queries(lines)


def tune_index(directory: pathlib.Path, embeddings: pathlib.Path, *, target: float,
               queries_QD: np.ndarray | None = None, recall_k: int | None = None,
               sample: int = 256) -> dict:
    """Tune a built index to ``target`` recall@10 against exact search over ``embeddings``
    (the ``[N, D]`` vectors it was built from) and record the setting and the measurement as
    its manifest's defaults. Returns the new manifest."""
    from replug_jax.fileio import write_json_atomic

    index = Index.load(directory)
    source = EmbeddingSource.from_files([embeddings], n=len(index), dim=index.manifest["dim"])
    check_embeddings(index, source, embeddings)
    index.manifest["recall"] = recall_report(index, source, k=10, user_k=recall_k,
                                             queries_QD=queries_QD, sample=sample,
                                             target=target)
    write_json_atomic(index.manifest, pathlib.Path(directory) / "manifest.json")
    return index.manifest


SAMPLE_ROWS = 16  # rows of the embeddings whose bytes identify them (sample_digest)


def sample_digest(source: EmbeddingSource) -> str:
    """SHA-256 of ``SAMPLE_ROWS`` evenly spaced rows (float32): what identifies the vectors an
    index was built from, recorded in its manifest and checked before tuning against them."""
    rows = np.unique(np.linspace(0, source.n - 1, min(SAMPLE_ROWS, source.n)).astype(np.int64))
    return hashlib.sha256(np.ascontiguousarray(source.take(rows), np.float32).tobytes()
                          ).hexdigest()


def check_embeddings(index: Index, source: EmbeddingSource, path) -> None:
    """Refuse embeddings that are not the ones ``index`` was built from (tuning against other
    vectors would measure nonsense and record it as the index's default): by the digest the
    build recorded, else (older indexes) by searching a sample of the vectors for themselves."""
    recorded = index.manifest.get("embeddings_digest")
    if recorded is not None:
        if sample_digest(source) != recorded:
            raise ValueError(f"{path}: not the embeddings this index was built from (their "
                             "sampled rows differ from the build's); pass the build's vectors")
        return
    rows = np.unique(np.linspace(0, source.n - 1, min(32, source.n)).astype(np.int64))
    found = _rows_of(index, index.search(source.take(rows), 10).ids)
    share = float(np.mean([r in got for r, got in zip(rows, found)]))
    if share < 0.5:
        raise ValueError(f"{path}: not the embeddings this index was built from (only "
                         f"{share:.0%} of {len(rows)} sampled vectors find their own row); "
                         "pass the build's vectors")


def describe(manifest: dict) -> str:
    """The recall an index manifest records (and its tuning), as lines of text."""
    r = manifest.get("recall")
    if not r:
        return "\nrecall: exact search (Flat)" if manifest.get("factory") == "Flat" else ""
    out = [f"\nrecall against exact search ({r['n']} queries: {r['queries']}; 95 % "
           f"interval), nprobe {manifest.get('nprobe')}, re-rank "
           f"×{manifest.get('rerank_factor', 0)}:"]
    for k, v in r["at"].items():
        out.append(f"  recall@{k} {v['recall']:.3f} [{v['low']:.3f}, {v['high']:.3f}], "
                   f"{v['qps']:.0f} queries/s")
    t = r.get("tuning")
    if t:
        out.append(f"  tuned for recall@{r.get('tuned_k', 10)} ≥ {t['target']} (interval's "
                   "lower bound): "
                   + ("reached" if t["reached"] else "NOT reached (the best setting is kept; "
                      "raise --rerank candidates, use finer PQ codes or Flat)"))
        out.append("  frontier (nprobe, re-rank: recall@10 lower bound, ms/query): " + "; ".join(
            f"{f['nprobe']}, ×{f['rerank']}: {f['recall_low']:.3f}, "
            f"{1e3 * f['seconds_per_query']:.2f}" for f in t["frontier"]))
    return "\n".join(out)
