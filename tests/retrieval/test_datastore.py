"""The paper-scale datastore: passage store, streaming readers, sharded and resumable builds,
integrity checks, and exact top-k sharded over devices."""

import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replug_jax.retrieval.corpus import CorpusError, Passage, iter_chunks, iter_documents
from replug_jax.retrieval import (
    DeviceIndex,
    EmbeddingSource,
    Index,
    IndexLoadError,
    build_index,
    embed_store,
    exact_topk,
    shard_corpus,
    sharded_topk,
)
from replug_jax.retrieval.store import PassageStore, write_store
from tests.helpers import clustered

TEXTS = ["Aaron is a prophet, high priest, and the brother of Moses.",
         'He said "hello"\tand left; naïve café — 東京 🙂',
         "Line with a trailing space ",
         "x" * 3000]


def write_tsv(path, with_title: bool):
    import csv

    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["id", "text", "title"] if with_title else ["id", "text"])
        for i, t in enumerate(TEXTS):
            w.writerow([str(i + 1), t, f"Title {i}"] if with_title else [str(i + 1), t])


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "parquet", "tsv", "tsv_notitle"])
def test_store_round_trips_every_reader_byte_for_byte(tmp_path, fmt):
    path = tmp_path / f"c.{fmt.split('_')[0]}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"id": f"d{i}", "text": t, "title": f"T{i}"},
                                           ensure_ascii=False) + "\n"
                                for i, t in enumerate(TEXTS)), encoding="utf-8")
    elif fmt == "txt":
        path.write_text("\n".join(t.replace("\t", " ") for t in TEXTS) + "\n", encoding="utf-8")
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": [f"d{i}" for i in range(4)], "text": TEXTS,
                                 "title": [f"T{i}" for i in range(4)]}), path)
    else:
        write_tsv(path, with_title=fmt == "tsv")
    docs = list(iter_documents(path))
    assert len(docs) == 4
    meta = write_store(iter_chunks(iter(docs), unit="none"), tmp_path / "p.arrow",
                       batch_rows=3)
    store = PassageStore.open(tmp_path / "p.arrow")
    assert meta["n"] == len(store) == 4 and store.num_batches == 2
    for i, (doc, p) in enumerate(zip(docs, store)):
        assert p.text.encode("utf-8") == doc.text.encode("utf-8")
        assert p.title == doc.title and p.source_id == doc.id and p.id == i
        assert store[i] == p and store.row(i) == p
    if fmt.startswith("tsv"):
        assert [d.id for d in docs] == ["1", "2", "3", "4"]
        assert docs[1].text == TEXTS[1]  # quotes and a tab inside a quoted field survive
        assert (docs[0].title == "Title 0") == (fmt == "tsv")
    assert [p.id for p in store.take([3, 1])] == [3, 1]
    with pytest.raises(KeyError, match="passage id 9"):
        store.take([9])


def test_store_with_arbitrary_ids_and_chunking_streams(tmp_path):
    passages = [Passage(i, f"text {i}", source_id=str(i)) for i in (40, 7, 19)]
    store = PassageStore.from_passages(passages)
    assert store[7].text == "text 7" and store.ids_of([0, 1, 2]).tolist() == [40, 7, 19]
    with pytest.raises(KeyError):
        store[8]
    # chunking is lazy: a generator consumes documents only as passages are asked for
    seen = []

    def docs():
        for i in range(1000):
            seen.append(i)
            yield from iter_documents_of(f"word{i} " * 30)

    it = iter_chunks(docs(), size=10)
    first = [next(it) for _ in range(6)]
    assert len(seen) == 2 and [p.id for p in first] == list(range(6))


def iter_documents_of(text):
    from replug_jax.retrieval.corpus import Document

    yield Document("d", text)


def test_tsv_rows_with_a_missing_field_are_refused(tmp_path):
    bad = tmp_path / "psgs.tsv"
    bad.write_text("id\ttext\ttitle\n1\tfine text\tTitle\n2\tno title here\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"psgs.tsv:3: 2 field\(s\) where the header has 3"):
        list(iter_documents(bad))
    nohead = tmp_path / "nohead.tsv"
    nohead.write_text("1\tsome text\tTitle\n")
    with pytest.raises(CorpusError, match="header must name"):
        list(iter_documents(nohead))


def _passages(n):
    return [Passage(i, f"passage {i}", f"title {i % 7}", str(i // 3)) for i in range(n)]


def test_sharded_index_equals_one_index_over_the_union(tmp_path):
    emb = clustered(500)
    np.save(tmp_path / "emb.npy", emb)
    passages = _passages(500)
    one = Index.build(emb, passages)
    sharded = build_index(passages, None, tmp_path / "idx", embeddings=tmp_path / "emb.npy",
                          num_shards=3, progress=False)
    assert [s["hi"] - s["lo"] for s in sharded.manifest["shards"]] == [166, 167, 167]
    queries = clustered(20, seed=1)
    a, b = one.search(queries, 10), sharded.search(queries, 10)
    np.testing.assert_allclose(a.scores, b.scores, atol=1e-5)
    assert (a.ids == b.ids).mean() > 0.99  # equal up to float ties
    assert [p.id for p in b.passages[0]] == b.ids[0].tolist()
    assert b.passages[0][0] == passages[b.ids[0, 0]]
    np.testing.assert_allclose(sharded.reconstruct_all(), emb, atol=1e-6)
    # exclusions cross shards
    excl = set(b.ids[0, :5].tolist())
    c = sharded.search(queries[:1], 5, exclude_ids=[excl])
    assert not excl & set(c.ids[0].tolist()) and c.ids[0, 0] == b.ids[0, 5]


def test_ivf_pq_trains_on_a_sample_and_finds_neighbours(tmp_path):
    emb = clustered(4000, d=32)
    np.save(tmp_path / "emb.npy", emb)
    idx = build_index(_passages(4000), None, tmp_path / "idx", embeddings=tmp_path / "emb.npy",
                      factory="IVF16,PQ8", nprobe=8, train_size=2000, progress=False)
    exact = Index.build(emb, _passages(4000))
    q = clustered(50, d=32, seed=3)
    got, want = idx.search(q, 10).ids, exact.search(q, 10).ids
    recall = np.mean([len(set(g) & set(w)) / 10 for g, w in zip(got, want)])
    assert recall >= 0.5, recall
    assert Index.load(tmp_path / "idx").manifest["factory"] == "IVF16,PQ8"


class Killed(Exception):
    pass


def die_at_shard_1(s: int) -> None:
    if s == 1:
        raise Killed


def test_interrupted_builds_resume_without_recomputing(tmp_path):
    emb = clustered(300)
    np.save(tmp_path / "emb.npy", emb)

    with pytest.raises(Killed):
        build_index(_passages(300), None, tmp_path / "idx", embeddings=tmp_path / "emb.npy",
                    num_shards=4, progress=False, on_shard=die_at_shard_1)
    assert not (tmp_path / "idx").exists() and (tmp_path / "idx.partial" / "shard-00000").exists()
    built = []
    idx = build_index(_passages(300), None, tmp_path / "idx", embeddings=tmp_path / "emb.npy",
                      num_shards=4, progress=False, on_shard=built.append)
    assert built == [2, 3] and len(idx) == 300 and not (tmp_path / "idx.partial").exists()


def test_resume_with_changed_settings_rebuilds_shards_and_nprobe_comes_from_manifest(
        tmp_path):
    """Regression: a finished shard was reused whatever the passage length, embeddings file or
    train size of the resumed build, and a load kept each FAISS file's own nprobe."""
    import faiss

    emb = clustered(600)
    np.save(tmp_path / "emb.npy", emb)
    kw = dict(num_shards=3, progress=False, factory="IVF4,Flat", train_size=300)
    with pytest.raises(Killed):
        build_index(_passages(600), None, tmp_path / "idx", embeddings=tmp_path / "emb.npy",
                    nprobe=1, on_shard=die_at_shard_1, **kw)
    built = []  # the same settings but nprobe (a search setting): both finished shards kept
    idx = build_index(_passages(600), None, tmp_path / "idx", embeddings=tmp_path / "emb.npy",
                      nprobe=3, on_shard=built.append, **kw)
    assert built == [2]
    assert [faiss.extract_index_ivf(ix).nprobe for ix, _ in idx.shards] == [3, 3, 3]
    # other vectors under another name, and another train size: every shard rebuilt
    for change in ({"embeddings": "emb2.npy"}, {"train_size": 200}):
        np.save(tmp_path / "emb2.npy", clustered(600, seed=9))
        args = {**kw, "embeddings": tmp_path / "emb.npy", **change}
        args["embeddings"] = tmp_path / pathlib.Path(args["embeddings"]).name
        with pytest.raises(Killed):
            build_index(_passages(600), None, tmp_path / "r", nprobe=1, on_shard=die_at_shard_1,
                        **{**kw, "embeddings": tmp_path / "emb.npy"})
        built = []
        idx = build_index(_passages(600), None, tmp_path / "r", nprobe=1,
                          on_shard=built.append, **args)
        assert built == [0, 1, 2], change
        fresh = build_index(_passages(600), None, tmp_path / "fresh", nprobe=1, **args)
        q = clustered(20, seed=4)
        np.testing.assert_array_equal(idx.search(q, 5).ids, fresh.search(q, 5).ids)
        import shutil

        shutil.rmtree(tmp_path / "r")
        shutil.rmtree(tmp_path / "fresh")


def test_resume_with_another_passage_length_rebuilds_every_shard(tmp_path):
    """Regression: resuming with another --max-length re-embedded the passages but kept the
    FAISS shards built from the old embeddings."""
    short, long = CountingEncoder(), CountingEncoder()
    long.identity = {**CountingEncoder.identity, "max_length": 128}
    with pytest.raises(Killed):
        build_index(_passages(60), short, tmp_path / "idx", num_shards=3, progress=False,
                    embed_shard_rows=16, on_shard=die_at_shard_1)
    built = []
    idx = build_index(_passages(60), long, tmp_path / "idx", num_shards=3, progress=False,
                      embed_shard_rows=16, on_shard=built.append)
    assert built == [0, 1, 2] and long.encoded == 60
    for spec in idx.manifest["shards"]:
        info = json.loads((tmp_path / "idx" / spec["dir"] / "shard.json").read_text())
        assert info["max_length"] == 128


def test_load_samples_large_files_whose_size_and_mtime_are_unchanged(tmp_path, monkeypatch):
    """A corrupted large file with its size and mtime restored is caught at load by the
    sampled blocks the manifest records (``verify`` still hashes every byte)."""
    from replug_jax.retrieval import integrity as index_module

    monkeypatch.setattr(index_module, "SMALL_FILE_BYTES", 1024)
    monkeypatch.setattr(index_module, "SAMPLE_BYTES", 512)
    np.save(tmp_path / "emb.npy", clustered(400))
    build_index(_passages(400), None, tmp_path / "idx", embeddings=tmp_path / "emb.npy",
                progress=False)
    info = Index.load(tmp_path / "idx").manifest["files"]["shard-00000/index.faiss"]
    assert len(info["sample_offsets"]) == 4
    faiss_file = tmp_path / "idx" / "shard-00000" / "index.faiss"
    raw = bytearray(faiss_file.read_bytes())
    st = faiss_file.stat()
    raw[info["sample_offsets"][2] + 7] ^= 0xFF
    faiss_file.write_bytes(bytes(raw))
    os.utime(faiss_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(IndexLoadError, match="index.faiss: sampled blocks differ"):
        Index.load(tmp_path / "idx")


def test_no_warning_at_interpreter_exit_from_open_embedding_files(tmp_path):
    import subprocess
    import sys

    np.save(tmp_path / "emb.npy", clustered(10))
    code = ("from replug_jax.retrieval import NpyRows; import sys; "
            f"r = NpyRows({str(tmp_path / 'emb.npy')!r}); sys.modules['keep'] = r")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stderr == "", out.stderr


class CountingEncoder:
    """A retriever stand-in with the interface embed_store uses: deterministic embeddings
    from the text, counting every text it encodes."""

    dim = 8
    identity = {"source": "counting", "fingerprint": "c" * 64, "pooling": "mean",
                "similarity": "cosine", "max_length": 64}

    def __init__(self):
        self.encoded = 0

    def encode(self, texts, params=None, on_batch=None):
        self.encoded += len(texts)
        out = np.stack([np.random.default_rng(len(t) + sum(map(ord, t))).normal(size=8)
                        for t in texts]).astype(np.float32)
        if on_batch:
            on_batch(len(texts))
        return out / np.linalg.norm(out, axis=1, keepdims=True)


def test_embedding_resumes_at_shard_granularity_and_splits_across_processes(tmp_path):
    store = PassageStore.from_passages(_passages(50))
    enc = CountingEncoder()

    with pytest.raises(Killed):
        embed_store(store, enc, tmp_path / "emb", shard_rows=16, progress=False,
                    on_shard=die_at_shard_1)
    assert enc.encoded == 32
    paths = embed_store(store, enc, tmp_path / "emb", shard_rows=16, progress=False)
    assert enc.encoded == 32 + 18  # shards 2 (16) and 3 (2) only
    full = EmbeddingSource.from_files(paths).rows(0, 50)
    np.testing.assert_array_equal(full, CountingEncoder().encode(
        [f"title {i % 7}. passage {i}" for i in range(50)]))
    # two processes: each embeds its own shards, together all of them
    split = [CountingEncoder(), CountingEncoder()]
    for p in (0, 1):
        embed_store(store, split[p], tmp_path / "emb2", shard_rows=16, progress=False,
                    process_index=p, process_count=2)
    assert [e.encoded for e in split] == [16 + 16, 16 + 2]
    np.testing.assert_array_equal(
        EmbeddingSource.from_files(sorted((tmp_path / "emb2").glob("emb-*.npy"))).rows(0, 50),
        full)


def test_bad_shards_embeddings_and_files_are_refused(tmp_path):
    emb = clustered(120)
    np.save(tmp_path / "emb.npy", emb)
    build_index(_passages(120), None, tmp_path / "a", embeddings=tmp_path / "emb.npy",
                num_shards=2, progress=False)
    np.save(tmp_path / "emb_b.npy", clustered(120, seed=5))
    other = _passages(120)
    other[0] = Passage(0, "another corpus")
    build_index(other, None, tmp_path / "b", embeddings=tmp_path / "emb_b.npy", num_shards=2,
                progress=False)
    # a shard of another index (another corpus) copied in
    import shutil

    shutil.rmtree(tmp_path / "a" / "shard-00001")
    with pytest.raises(IndexLoadError, match="shard-00001: missing"):
        Index.load(tmp_path / "a")
    shutil.copytree(tmp_path / "b" / "shard-00001", tmp_path / "a" / "shard-00001")
    with pytest.raises(IndexLoadError, match="shard-00001"):
        Index.load(tmp_path / "a")
    # embeddings of the wrong shape, dtype, or truncated
    for name, arr, msg in [("short.npy", emb[:100], "100 embeddings for 120 passages"),
                           ("int.npy", (emb * 10).astype(np.int32), "float32 or float16"),
                           ("flat.npy", emb.reshape(-1), "2-D")]:
        np.save(tmp_path / name, arr)
        with pytest.raises(IndexLoadError, match=f"{name}: .*{msg}"):
            build_index(_passages(120), None, tmp_path / "c", embeddings=tmp_path / name,
                        progress=False)
    raw = (tmp_path / "emb.npy").read_bytes()
    (tmp_path / "cut.npy").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(IndexLoadError, match="cut.npy: truncated"):
        build_index(_passages(120), None, tmp_path / "c", embeddings=tmp_path / "cut.npy",
                    progress=False)


def test_integrity_checks_sizes_always_and_hashes_on_demand(tmp_path):
    emb = clustered(200)
    np.save(tmp_path / "emb.npy", emb)
    build_index(_passages(200), None, tmp_path / "idx", embeddings=tmp_path / "emb.npy",
                progress=False)
    d = tmp_path / "idx"
    assert Index.verify(d)["files"] == 4
    faiss_file = d / "shard-00000" / "index.faiss"
    raw = bytearray(faiss_file.read_bytes())
    st = faiss_file.stat()
    raw[-10] ^= 0xFF  # same size, same mtime: a load trusts it, verify does not
    faiss_file.write_bytes(bytes(raw))
    os.utime(faiss_file, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(IndexLoadError, match="checksum mismatch"):
        Index.verify(d)
    faiss_file.write_bytes(bytes(raw[:-100]))
    with pytest.raises(IndexLoadError, match="truncated"):
        Index.load(d)
    store_file = d / "passages.arrow"
    store_file.write_bytes(store_file.read_bytes()[:-1] + b"\x00")
    with pytest.raises(IndexLoadError, match="passages.arrow: checksum mismatch"):
        Index.load(d)


def test_jax_sharded_topk_equals_faiss_exact():
    from replug_jax.sharding import make_mesh

    emb = clustered(1003, d=32)  # not a multiple of 8: padding rows must never win
    queries = clustered(16, d=32, seed=2)
    mesh = make_mesh(8)
    corpus, n = shard_corpus(emb, mesh, dtype=np.float32)
    scores, rows = sharded_topk(queries, corpus, 20, n, mesh, block=50)
    faiss_res = Index.build(emb, _passages(1003)).search(queries, 20)
    np.testing.assert_allclose(np.asarray(scores), faiss_res.scores, atol=1e-5)
    assert (np.asarray(rows) == faiss_res.ids).mean() > 0.99
    one_scores, one_rows = exact_topk(queries, emb, 20, block=64)
    np.testing.assert_array_equal(np.asarray(one_rows), np.asarray(rows))
    # bf16 storage (the training-time default) keeps the same top-1 on clustered data
    corpus16, _ = shard_corpus(emb, mesh)
    _, rows16 = sharded_topk(queries, corpus16, 1, n, mesh)
    assert (np.asarray(rows16)[:, 0] == faiss_res.ids[:, 0]).mean() >= 0.9


def test_ivf_pq_with_exact_reranking_from_disk_matches_exact_search(tmp_path):
    emb = clustered(4000, d=32)
    np.save(tmp_path / "emb.npy", emb)
    q = clustered(50, d=32, seed=3)
    exact = Index.build(emb, _passages(4000)).search(q, 10)
    plain = build_index(_passages(4000), None, tmp_path / "pq", embeddings=tmp_path / "emb.npy",
                        factory="IVF16,PQ4", nprobe=16, train_size=2000, progress=False)
    reranked = build_index(_passages(4000), None, tmp_path / "rr",
                           embeddings=tmp_path / "emb.npy", factory="IVF16,PQ4", nprobe=16,
                           train_size=2000, rerank=8, num_shards=2, progress=False)

    def recall(res):
        return np.mean([len(set(a) & set(b)) / 10 for a, b in zip(res.ids, exact.ids)])

    got = reranked.search(q, 10)
    assert recall(got) > recall(plain.search(q, 10)) and recall(got) >= 0.95
    # re-ranked scores are the exact inner products (float16 storage: 1e-2)
    np.testing.assert_allclose(got.scores, np.einsum("bd,bkd->bk", q, emb[got.ids]), atol=1e-2)
    assert "shard-00001/vectors.npy" in reranked.manifest["files"]
    again = Index.load(tmp_path / "rr")
    np.testing.assert_array_equal(again.search(q, 10).ids, got.ids)
    saved = again.save(tmp_path / "copy")
    np.testing.assert_array_equal(Index.load(saved).search(q, 10).ids, got.ids)


def test_encoding_data_parallel_over_devices_equals_one_device():
    from replug_jax.retrieval.encoder import Retriever
    from tests._models import tiny_retriever

    one = tiny_retriever(0)
    many = Retriever(one.model, max_length=64, batch_size=6, devices=jax.local_devices())
    assert many.mesh.devices.size == 8 and many.batch_size == 8  # rounded to the devices
    texts = [f"text number {i} " * (i % 5 + 1) for i in range(23)]
    np.testing.assert_allclose(many.encode(texts), one.encode(texts), atol=1e-5)
    np.testing.assert_allclose(many.encode(texts), one.encode(texts), atol=1e-5)  # reused


def _numpy_topk(queries, corpus, k):
    s = queries.astype(np.float64) @ corpus.astype(np.float64).T
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(s, order, 1), order


def test_sharded_topk_never_returns_padding_rows_with_negative_scores():
    """Regression: rows per device (7) above the block (3) and not a multiple of it, every
    score negative. Each device's zero padding used to stay visible (score 0, the next
    device's ids) on every device but the last."""
    from replug_jax.sharding import make_mesh

    rng = np.random.default_rng(0)
    corpus = -np.abs(rng.normal(size=(14, 4))).astype(np.float32)
    queries = np.abs(rng.normal(size=(3, 4))).astype(np.float32)  # every score < 0
    mesh = make_mesh(2)
    array, n = shard_corpus(corpus, mesh, dtype=np.float32)
    scores, rows = sharded_topk(queries, array, 4, n, mesh, block=3)
    want_scores, want_rows = _numpy_topk(queries, corpus, 4)
    np.testing.assert_array_equal(np.asarray(rows), want_rows)
    np.testing.assert_allclose(np.asarray(scores), want_scores, rtol=1e-5)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(n=st.integers(1, 90), devices=st.sampled_from([1, 2, 4, 8]), block=st.integers(1, 20),
       k=st.integers(1, 12), sign=st.sampled_from(["negative", "positive", "mixed"]),
       bin_rows=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_sharded_topk_equals_exact_topk_property(n, devices, block, k, sign, bin_rows, seed):
    """Over random corpus sizes, device counts, blocks, bins of the two-stage top-k, k and
    score signs (all-negative included), the sharded top-k equals exact top-k (NumPy, float64;
    continuous random scores, so no ties)."""
    from replug_jax.sharding import make_mesh

    rng = np.random.default_rng(seed)
    corpus = rng.normal(size=(n, 6)).astype(np.float32)
    queries = rng.normal(size=(3, 6)).astype(np.float32)
    if sign != "mixed":  # all scores of one sign: queries and rows in opposite orthants
        corpus, queries = np.abs(corpus), np.abs(queries)
        if sign == "negative":
            corpus = -corpus
    mesh = make_mesh(devices)
    array, n_valid = shard_corpus(corpus, mesh, dtype=np.float32)
    scores, rows = sharded_topk(queries, array, k, n_valid, mesh, block=block, bin_rows=bin_rows)
    want_scores, want_rows = _numpy_topk(queries, corpus, min(k, n))
    np.testing.assert_array_equal(np.asarray(rows), want_rows)
    np.testing.assert_allclose(np.asarray(scores), want_scores, rtol=1e-5, atol=1e-6)


def _tight_clusters(n: int, d: int = 32, clusters: int = 40, spread: float = 0.05,
                    seed: int = 0):
    """Tight clusters of nearly equidistant members: hard for PQ codes, and for float16."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(clusters, d))

    def draw(m):
        x = centers[rng.integers(clusters, size=m)] + spread * rng.normal(size=(m, d))
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    return draw(n), draw(200)


def test_build_measures_recall_and_tunes_to_a_target_on_held_out_queries(tmp_path):
    """An IVF-PQ build reports recall@10 against exact search with an interval; with a
    target it tunes nprobe × re-rank to the fastest setting reaching it, and held-out queries
    (not the corpus sample it tuned on) get that recall too."""
    emb, held_out = _tight_clusters(6000)
    np.save(tmp_path / "emb.npy", emb)
    kw = dict(embeddings=tmp_path / "emb.npy", factory="IVF16,PQ4", train_size=3000,
              nprobe=2, progress=False)
    plain = build_index(_passages(6000), None, tmp_path / "plain", **kw)
    r = plain.manifest["recall"]
    assert r["queries"] == "corpus sample" and r["n"] == 256
    at10 = r["at"]["10"]
    assert at10["low"] <= at10["recall"] <= at10["high"] and at10["recall"] < 0.9
    tuned = build_index(_passages(6000), None, tmp_path / "tuned", target_recall=0.9,
                        recall_k=5, **kw)
    t = tuned.manifest["recall"]
    assert t["tuning"]["reached"] and set(t["at"]) == {"5", "10"}
    assert tuned.manifest["rerank_dtype"] == "float32" and tuned.manifest["rerank_factor"] > 0
    assert t["at"]["10"]["low"] >= 0.9
    exact = np.argsort(-(held_out @ emb.T), axis=1)[:, :10]
    got = Index.load(tmp_path / "tuned").search(held_out, 10).ids
    held = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(got, exact)])
    assert held >= 0.9, held
    # search-time knobs: no re-ranking gives the plain PQ recall back
    loose = Index.load(tmp_path / "tuned").search(held_out, 10, rerank=0, nprobe=1).ids
    assert np.mean([len(set(a) & set(b)) / 10 for a, b in zip(loose, exact)]) < held
    with pytest.raises(ValueError, match="re-ranking needs the vectors"):
        plain.search(held_out, 10, rerank=4)


def test_search_results_carry_the_source_document_and_span(tmp_path):
    """Chunked documents come back with the id the user gave each document and the
    character span of the chunk in it."""
    from replug_jax.replug import source_of
    from replug_jax.retrieval.corpus import Document, chunk_documents

    docs = [Document(str(i), " ".join(f"w{i}_{j}" for j in range(250)), f"T{i}")
            for i in range(3)]
    passages = chunk_documents(docs, size=100)
    emb = clustered(len(passages))
    res = Index.build(emb, passages).search(emb[[4]], 1)
    [p] = res.passages[0]
    src = source_of(p)
    doc = docs[int(src["source_id"])]
    assert doc.text[src["start"]:src["end"]] == p.text and src["id"] == 4


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(bins=st.integers(1, 40), bin_rows=st.integers(1, 9), extra=st.integers(0, 8),
       k=st.integers(1, 15), ties=st.booleans(), seed=st.integers(0, 2**16))
def test_two_stage_topk_equals_exact_topk(bins, bin_rows, extra, k, ties, seed):
    """Per-bin maxima → top-k bins → top-k of their members gives the exact top-k values
    (with heavy ties too: integer scores; a short last bin too), and the rows returned hold
    those values, each once."""
    from replug_jax.retrieval import two_stage_topk

    rng = np.random.default_rng(seed)
    n = bins * bin_rows + extra % bin_rows
    k = min(k, n)
    s = (rng.integers(-3, 4, size=(4, n)) if ties else rng.normal(size=(4, n))).astype(
        np.float32)
    vals, rows = two_stage_topk(jnp.asarray(s.T), k, bin_rows)  # [N, B] corpus-major
    want = -np.sort(-s, axis=1)[:, :k]
    np.testing.assert_array_equal(np.asarray(vals), want)
    np.testing.assert_array_equal(np.take_along_axis(s, np.asarray(rows), 1), want)
    assert all(len(set(row)) == k for row in np.asarray(rows).tolist())


def test_storage_dtype_is_float32_on_cpu_and_bfloat16_on_accelerators():
    from replug_jax.retrieval import storage_dtype

    assert storage_dtype("cpu") == "float32"
    assert storage_dtype("gpu") == storage_dtype("tpu") == "bfloat16"
    from replug_jax.sharding import make_mesh

    index = DeviceIndex(np.eye(3, dtype=np.float32), [Passage(i, str(i)) for i in range(3)],
                        make_mesh(1))
    assert index.manifest["factory"] == f"jax-exact-{storage_dtype()}"
