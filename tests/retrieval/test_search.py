"""Exact search (retrieval/jax_search.py, the index facade): no row past the corpus, non-finite
vectors and queries refused."""

import numpy as np
import pytest


def test_exact_topk_never_returns_rows_past_the_corpus():
    """N = 514 (a short last bin of 2 rows): when the short bin wins and the other rows'
    products overflow to -inf, its fill rows past N once tied and came back (row 514)."""
    from replug_jax.retrieval.jax_search import exact_topk

    c = np.full((514, 8), -3e37, np.float32)
    c[512:] = 1.0
    scores, rows = exact_topk(np.full((2, 8), 10.0, np.float32), c, 3)
    assert np.asarray(rows).max() < 514 and sorted(np.asarray(rows)[0][:2]) == [512, 513]


def test_non_finite_vectors_and_queries_are_refused():
    from replug_jax.retrieval.corpus import Passage
    from replug_jax.retrieval import DeviceIndex, Index
    from replug_jax.sharding import make_mesh

    rng = np.random.default_rng(0)
    emb = rng.normal(size=(50, 8)).astype(np.float32)
    passages = [Passage(i, f"p{i}") for i in range(50)]
    bad = emb.copy()
    bad[7, 3] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite.*row 7"):
        DeviceIndex(bad, passages, make_mesh(1))
    q = emb[:3].copy()
    q[1, 0] = np.inf
    for index in (DeviceIndex(emb, passages, make_mesh(1)), Index.build(emb, passages)):
        with pytest.raises(ValueError, match="NaN or infinite components \\(first: query 1"):
            index.search(q, 5)



def test_index_build_checks_finiteness_block_by_block():
    """Index.build holds no N x D temporary beside the embeddings (the whole-array isfinite
    check did: N x D bytes, 1/4 of a float32 matrix); a NaN past the first block is still found,
    with its row."""
    import tracemalloc

    from replug_jax.retrieval import Index
    from replug_jax.retrieval.corpus import Passage
    from replug_jax.retrieval.store import PassageStore

    n, d = 150_000, 64
    emb = np.random.default_rng(0).normal(size=(n, d)).astype(np.float32)
    store = PassageStore.from_passages([Passage(i, "p") for i in range(n)])
    Index.build(emb, store)  # first call: imports and FAISS's one-time allocations
    tracemalloc.start()
    try:
        Index.build(emb, store)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < emb.nbytes / 6, (peak, emb.nbytes)  # was N x D bytes = nbytes / 4
    emb[100_000, 5] = np.nan
    with pytest.raises(ValueError, match="NaN or inf.*row 100000"):
        Index.build(emb, store)


def test_index_build_from_parts_equals_the_concatenated_matrix(tmp_path):
    """A refresh on several processes builds from each process's share (memmaps) without
    concatenating them: same index as from one matrix; parts that disagree are refused."""
    from replug_jax.retrieval import Index
    from replug_jax.retrieval.corpus import Passage

    rng = np.random.default_rng(1)
    emb = rng.normal(size=(300, 16)).astype(np.float32)
    passages = [Passage(i, f"p{i}") for i in range(300)]
    bounds = [0, 120, 120, 300]  # an empty share too (more processes than rows)
    shares = []
    for j, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        np.save(tmp_path / f"s{j}.npy", emb[lo:hi])
        shares.append(np.load(tmp_path / f"s{j}.npy", mmap_mode="r"))
    q = rng.normal(size=(5, 16)).astype(np.float32)
    whole = Index.build(emb, passages).search(q, 7)
    parted = Index.build(shares, passages).search(q, 7)
    np.testing.assert_array_equal(parted.ids, whole.ids)
    np.testing.assert_allclose(parted.scores, whole.scores, rtol=1e-6)
    with pytest.raises(ValueError, match="different dimensions"):
        Index.build([emb[:100], emb[100:, :8]], passages)
    with pytest.raises(ValueError, match="299 embeddings for 300 passages"):
        Index.build([emb[:100], emb[100:299]], passages)


def test_the_checks_every_search_backend_shares():
    """retrieval/search.py, the part FAISS and the exact JAX search share: queries of the
    wrong width, k ≤ 0 or a non-finite component are refused naming the first bad query; a
    non-finite stored vector names its row; exclusions are one set per query."""
    from replug_jax.retrieval.search import (
        checked_queries,
        checked_vectors,
        per_query_exclusions,
    )

    q = checked_queries([[1, 0], [0, 1]], 2, 3)
    assert q.dtype == np.float32 and q.flags.c_contiguous
    for bad, k, message in (([[1, 0, 0]], 1, r"queries must be \[B, 2\], got \(1, 3\)"),
                            ([[1, 0]], 0, "k must be positive, got 0"),
                            ([[1, 0], [np.inf, 0]], 1, r"1 of 2 queries .* \(first: query 1\)")):
        with pytest.raises(ValueError, match=message):
            checked_queries(bad, 2, k)
    with pytest.raises(ValueError, match=r"passages: 1 of 3 vectors .* \(first: row 2\)"):
        checked_vectors(np.array([[0.0], [1.0], [np.nan]]), "passages")
    assert per_query_exclusions(None, 2) == [set(), set()]
    assert per_query_exclusions([4, 5], 3) == [{4, 5}] * 3  # ids shared by every query
    assert per_query_exclusions([[1], (2, 3)], 2) == [{1}, {2, 3}]  # one set per query
