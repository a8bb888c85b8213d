"""Recall measurement and tuning (retrieval/quality.py): ties are hits, intervals keep their
coverage, tuning refuses what it cannot certify and vectors the index was not built from."""

import numpy as np
import pytest


def _dup_corpus(tmp_path, n=600, d=16, seed=0):
    from replug_jax.retrieval.corpus import Passage

    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n // 3, d)).astype(np.float32)
    emb = np.repeat(base / np.linalg.norm(base, axis=1, keepdims=True), 3, axis=0)  # triples
    np.save(tmp_path / "emb.npy", emb)
    return emb, [Passage(i, f"p {i}") for i in range(n)]


def test_exact_search_over_duplicated_vectors_has_recall_one(tmp_path):
    """Rows tied with the exact top-k are hits (before: a Flat index over triplicated
    vectors measured recall@10 0.92 against itself)."""
    from replug_jax.retrieval.embeddings import EmbeddingSource
    from replug_jax.retrieval import build_index
    from replug_jax.retrieval.quality import exact_neighbours, measure

    emb, passages = _dup_corpus(tmp_path)
    index = build_index(passages, None, tmp_path / "flat", factory="Flat",
                        embeddings=tmp_path / "emb.npy", progress=False)
    source = EmbeddingSource.from_files([tmp_path / "emb.npy"])
    rows = np.arange(0, 600, 7)
    exact = exact_neighbours(source, emb[rows], 10, exclude_rows=rows)
    m = measure(index, source, emb[rows], exact, 10, exclude_rows=rows)
    assert m["recall"] == 1.0


def test_recall_interval_keeps_its_coverage_at_the_boundary():
    from replug_jax.retrieval.quality import min_queries, recall_interval

    low, high = recall_interval(np.ones(64))
    assert low == pytest.approx(0.025 ** (1 / 64)) and high == 1.0  # not [1, 1]
    assert min_queries(0.999) == 3688 and min_queries(0.95) == 72
    rng = np.random.default_rng(0)
    for p in (0.99, 0.999):  # the lower bound exceeds the true recall at most ~2.5 % of runs
        over = np.mean([recall_interval(rng.random(64) < p)[0] > p for _ in range(2000)])
        assert over <= 0.04, (p, over)


def test_tuning_refuses_targets_its_queries_cannot_certify(tmp_path):
    from replug_jax.retrieval.embeddings import EmbeddingSource
    from replug_jax.retrieval import build_index
    from replug_jax.retrieval.quality import exact_neighbours, tune

    emb, passages = _dup_corpus(tmp_path)
    index = build_index(passages, None, tmp_path / "ivf", factory="IVF4,Flat", nprobe=1,
                        embeddings=tmp_path / "emb.npy", progress=False, train_size=600)
    source = EmbeddingSource.from_files([tmp_path / "emb.npy"])
    q = emb[:64]
    with pytest.raises(ValueError, match="needs at least 3688 queries"):
        tune(index, source, q, exact_neighbours(source, q, 10), 10, 0.999)


def test_tune_refuses_embeddings_the_index_was_not_built_from(tmp_path):
    """A wrong file of the right shape once measured recall 0.002 and rewrote nprobe."""
    import json

    from replug_jax.retrieval import build_index
    from replug_jax.retrieval.quality import tune_index

    emb, passages = _dup_corpus(tmp_path)
    build_index(passages, None, tmp_path / "ivf", factory="IVF4,Flat", nprobe=2,
                embeddings=tmp_path / "emb.npy", progress=False, train_size=600)
    before = (tmp_path / "ivf" / "manifest.json").read_text()
    wrong = np.random.default_rng(1).normal(size=emb.shape).astype(np.float32)
    np.save(tmp_path / "wrong.npy", wrong)
    with pytest.raises(ValueError, match="not the embeddings this index was built from"):
        tune_index(tmp_path / "ivf", tmp_path / "wrong.npy", target=0.9)
    assert (tmp_path / "ivf" / "manifest.json").read_text() == before
    manifest = tune_index(tmp_path / "ivf", tmp_path / "emb.npy", target=0.9)
    assert json.loads((tmp_path / "ivf" / "manifest.json").read_text())["nprobe"] == \
        manifest["nprobe"]

