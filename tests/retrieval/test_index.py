"""Corpus reading and chunking, resumable encoding, FAISS vs the exact JAX oracle, recall."""

import json
import re
import warnings

import numpy as np
import pytest

from replug_jax.retrieval.corpus import (
    CorpusError,
    Document,
    chunk_documents,
    demo_corpus,
    read_documents,
)
from replug_jax.retrieval.encoder import Retriever
from replug_jax.retrieval import Index, IndexLoadError, build_index, exact_topk
from tests._models import packaged_or_skip, save_tiny_bert


@pytest.fixture(scope="module")
def minilm():
    packaged_or_skip("minilm")
    return Retriever.load("minilm")


@pytest.fixture(scope="module")
def demo_embeddings(minilm):
    passages = demo_corpus()[:400]
    return passages, minilm.encode_passages([p.text for p in passages])


# -- corpus ----------------------------------------------------------------------------------

def test_read_jsonl_text_and_parquet(tmp_path):
    jl = tmp_path / "c.jsonl"
    jl.write_text('{"id": "a", "text": "alpha beta", "title": "A"}\n\n'
                  '{"id": "b", "text": "gamma"}\n')
    docs = read_documents(jl)
    assert [d.id for d in docs] == ["a", "b"] and docs[0].title == "A"
    txt = tmp_path / "c.txt"
    txt.write_text("first line\n\nsecond line\n")
    assert [d.text for d in read_documents(txt)] == ["first line", "second line"]
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": ["x"], "text": ["delta"]}), tmp_path / "c.parquet")
    assert read_documents(tmp_path / "c.parquet")[0].text == "delta"


def test_bad_corpora(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(CorpusError, match="empty"):
        read_documents(empty)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\n\xff\xfe broken\n")
    with pytest.raises(CorpusError, match=r"bad.txt:2: not valid UTF-8"):
        read_documents(bad)
    blank = tmp_path / "blank.jsonl"
    blank.write_text('{"id": 1, "text": "ok"}\n{"id": 2, "text": "   "}\n')
    with pytest.warns(UserWarning, match="skipped 1"):
        assert len(read_documents(blank)) == 1
    with pytest.raises(CorpusError, match="no such"):
        read_documents(tmp_path / "missing.jsonl")


def test_word_chunking_offsets_and_overlap():
    text = " ".join(f"w{i}" for i in range(25))
    doc = Document("d", text, "T")
    chunks = chunk_documents([doc], size=10, overlap=2)
    assert [c.id for c in chunks] == [0, 1, 2]
    for c in chunks:
        assert text[c.start:c.end] == c.text and c.source_id == "d" and c.title == "T"
    assert chunks[0].text.split()[-2:] == chunks[1].text.split()[:2]
    assert chunks[-1].text.split()[-1] == "w24"
    assert len(chunk_documents([doc], size=100)) == 1


def test_token_chunking(minilm):
    tok = minilm.model.tokenizer
    doc = Document("d", "The quick brown fox jumps over the lazy dog. " * 20)
    chunks = chunk_documents([doc], size=16, unit="tokens", tokenizer=tok)
    for c in chunks[:-1]:
        assert len(tok(c.text, add_special_tokens=False)["input_ids"]) == 16
        assert doc.text[c.start:c.end] == c.text


def test_demo_corpus_is_python_docs():
    passages = demo_corpus()
    assert len(passages) > 500
    titles = {p.title for p in passages}
    assert {"json.loads", "statistics.median", "os.path.join"} <= titles


# -- encoding ------------------------------------------------------------------------------

def test_bucketing_matches_one_at_a_time(minilm):
    texts = ["short", "a somewhat longer sentence about Python lists and tuples",
             "x " * 70, "json.loads parses a JSON document"]
    batched = minilm.encode(texts)
    alone = np.concatenate([minilm.encode([t]) for t in texts])
    np.testing.assert_allclose(batched, alone, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)


@pytest.mark.torch
def test_resume_after_interruption_is_byte_identical(tmp_path):
    retriever = Retriever.load(str(save_tiny_bert(tmp_path / "tiny")), batch_size=4)
    texts = [f"passage number {i} " + "word " * (i % 13) for i in range(37)]
    full = np.array(retriever.encode_to_file(texts, tmp_path / "full.npy", block_size=8,
                                             progress=False))

    class Killed(Exception):
        pass

    def die_after_two(b):
        if b == 1:
            raise Killed

    with pytest.raises(Killed):
        retriever.encode_to_file(texts, tmp_path / "part.npy", block_size=8, progress=False,
                                 on_block=die_after_two)
    assert (tmp_path / "part.npy.progress.json").exists()
    computed = []
    calls = {"n": 0}
    original = retriever.encode

    def counting(batch, params=None, on_batch=None):
        calls["n"] += len(batch)
        return original(batch, params, on_batch)

    retriever.encode = counting
    resumed = retriever.encode_to_file(texts, tmp_path / "part.npy", block_size=8,
                                       progress=False, on_block=computed.append)
    assert computed == [2, 3, 4] and calls["n"] == 37 - 16
    assert (tmp_path / "full.npy").read_bytes() == (tmp_path / "part.npy").read_bytes()
    np.testing.assert_array_equal(resumed, full)
    assert not (tmp_path / "part.npy.progress.json").exists()


# -- index ---------------------------------------------------------------------------------

def test_faiss_exact_equals_jax_oracle(minilm, demo_embeddings):
    passages, emb = demo_embeddings
    index = Index.build(emb, passages, encoder=minilm.identity)
    queries = minilm.encode_queries(["How do I read a CSV file?", "run a shell command",
                                     "random number between two integers",
                                     "compress data with gzip", "abstract base class"])
    res = index.search(queries, 10)
    scores, ids = exact_topk(queries, emb, 10, block=97)
    scores, ids = np.asarray(scores), np.asarray(ids)
    np.testing.assert_allclose(res.scores, scores, atol=1e-5)
    # Ids must agree except where two scores tie within float32 noise (order is then free).
    tie = np.zeros_like(ids, bool)
    tie[:, 1:] |= np.abs(np.diff(scores, axis=1)) < 1e-5
    tie[:, :-1] |= tie[:, 1:]
    assert np.array_equal(res.ids[~tie], ids[~tie])
    for row_faiss, row_jax in zip(res.ids, ids):
        assert set(row_faiss[:-1]) <= set(row_jax) | set(row_faiss[-1:])
    assert res.passages[0][0].id == res.ids[0, 0]


def test_ivf_recall_against_exact(minilm, demo_embeddings):
    passages, emb = demo_embeddings
    exact = Index.build(emb, passages)
    ivf = Index.build(emb, passages, factory="IVF16,Flat", nprobe=4)
    queries = emb[::7] + 0.01 * np.random.default_rng(0).normal(size=emb[::7].shape)
    queries = (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)
    a, b = exact.search(queries, 10).ids, ivf.search(queries, 10).ids
    recall = np.mean([len(set(x) & set(y)) / 10 for x, y in zip(a, b)])
    assert recall >= 0.95, recall


def test_exclusion_and_k_larger_than_corpus(demo_embeddings):
    passages, emb = demo_embeddings
    index = Index.build(emb[:5], passages[:5])
    top = index.search(emb[:1], 2).ids[0]
    assert top[0] == passages[0].id
    excluded = index.search(emb[:1], 2, exclude_ids=[[passages[0].id]]).ids[0]
    assert passages[0].id not in excluded and excluded[0] == top[1]
    with pytest.warns(UserWarning, match="only 5 passages"):
        res = index.search(emb[:2], 8)
    assert (res.ids[:, :5] >= 0).all() and (res.ids[:, 5:] == -1).all()
    assert len(res.passages[0]) == 5


def test_save_load_and_refusals(tmp_path, minilm, demo_embeddings):
    passages, emb = demo_embeddings
    index = Index.build(emb[:50], passages[:50], encoder=minilm.identity)
    d = index.save(tmp_path / "idx")
    loaded = Index.load(d, expect_encoder=minilm.identity,
                        expect_corpus_checksum=index.manifest["corpus_checksum"])
    np.testing.assert_array_equal(loaded.search(emb[:3], 4).ids, index.search(emb[:3], 4).ids)
    other = dict(minilm.identity, fingerprint="0" * 64, source="someone/else")
    with pytest.raises(IndexLoadError, match="rebuild the index with this retriever"):
        Index.load(d, expect_encoder=other)
    with pytest.raises(IndexLoadError, match="different corpus"):
        Index.load(d, expect_corpus_checksum="f" * 64)
    shard = d / "shard-00000" / "index.faiss"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    with pytest.raises(IndexLoadError, match="index.faiss: checksum mismatch"):
        Index.load(d)
    (d / "manifest.json").unlink()
    with pytest.raises(IndexLoadError, match="not a complete index"):
        Index.load(d)
    with pytest.raises(IndexLoadError, match="no such index"):
        Index.load(tmp_path / "nope")


def test_build_index_counts_truncation(tmp_path, minilm):
    from replug_jax.retrieval.corpus import Passage

    passages = [Passage(0, "word " * 600), Passage(1, "a short passage")]
    small = Retriever(minilm.model, max_length=64)
    with pytest.warns(UserWarning, match="truncated"):
        index = build_index(passages, small, tmp_path / "idx", progress=False)
    assert index.manifest["truncated_passages"] == 1
    assert Index.load(tmp_path / "idx").manifest["truncated_passages"] == 1
    assert not (tmp_path / "idx.partial").exists()
    with pytest.raises(ValueError, match="empty corpus"):
        build_index([], small, tmp_path / "idx2")


@pytest.mark.data
@pytest.mark.slow
def test_nq_gold_passage_recall_at_5(shared_data, minilm):
    rows = [json.loads(line) for line in
            (shared_data / "nq_gold_passages" / "nq_openbook.jsonl").read_text().splitlines()]
    passages, questions = [], []
    from replug_jax.retrieval.corpus import Passage

    for i, row in enumerate(rows):
        m = re.match(r"Context: (.*)\n\nQuestion: (.*)\nAnswer:", row["query"], re.S)
        passages.append(Passage(i, m.group(1)))
        questions.append(m.group(2))
    index = Index.build(minilm.encode_passages([p.text for p in passages]), passages)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ids = index.search(minilm.encode_queries(questions), 5).ids
    recall = float(np.mean([i in row for i, row in enumerate(ids)]))
    print(f"NQ gold recall@5 = {recall:.3f} over {len(rows)} questions")
    assert recall >= 0.90, recall


def test_an_experiment_index_equals_the_cli_index_over_the_same_passages(tmp_path, minilm):
    """Experiments used to embed ``p.text`` while the CLI embeds the title too."""
    from replug_jax.retrieval.corpus import Passage
    from replug_jax.retrieval import index_in_memory

    passages = [Passage(i, f"Fact {i} about the river.", title=f"River {i}") for i in range(6)]
    on_disk = build_index(passages, minilm, tmp_path / "idx", progress=False)
    in_memory = index_in_memory(passages, minilm)
    np.testing.assert_allclose(in_memory.reconstruct_all(), on_disk.reconstruct_all(),
                               atol=1e-6)
    bare = minilm.encode_passages([p.text for p in passages])
    assert np.abs(bare - in_memory.reconstruct_all()).max() > 1e-2  # the title matters


def test_parameters_are_placed_once_per_refresh_not_once_per_batch(monkeypatch, tmp_path):
    """A refresh encodes the corpus in many batches and blocks with one parameter snapshot:
    the snapshot goes to the devices once (it used to be uploaded with every batch), and the
    embeddings equal those of the loaded weights when the snapshot is those weights."""
    import jax

    from tests._models import tiny_retriever

    retriever = tiny_retriever(0)
    snapshot = jax.tree.map(np.asarray, retriever.params)  # host arrays, as refreshes hold
    placed = []
    real = jax.device_put

    def spy(x, *args, **kwargs):
        if x is snapshot:
            placed.append(1)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(jax, "device_put", spy)
    texts = [f"passage number {i} about rivers" for i in range(50)]  # 7 batches of 8
    emb = retriever.encode_to_file(texts, tmp_path / "emb.npy", block_size=16,
                                   params=snapshot, progress=False)  # 4 blocks
    assert len(placed) == 1
    np.testing.assert_allclose(emb, retriever.encode(texts), atol=1e-5)


def test_gzipped_corpora_stream_and_a_cut_one_is_one_error(tmp_path):
    """`.jsonl.gz`, `.tsv.gz` and `.txt.gz` read as their plain forms (the Wikipedia sample
    ships gzipped); a truncated stream is a CorpusError naming the file."""
    import gzip

    from replug_jax.retrieval.corpus import CorpusError

    rows = [{"id": "a", "text": "alpha beta", "title": "A"}, {"id": "b", "text": "gamma"}]
    body = "".join(json.dumps(r) + "\n" for r in rows).encode()
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(body))
    docs = read_documents(tmp_path / "c.jsonl.gz")
    assert [(d.id, d.text, d.title) for d in docs] == [("a", "alpha beta", "A"),
                                                        ("b", "gamma", "")]
    (tmp_path / "c.tsv.gz").write_bytes(gzip.compress(b"id\ttext\ttitle\n7\tdelta\tD\n"))
    assert [(d.id, d.title) for d in read_documents(tmp_path / "c.tsv.gz")] == [("7", "D")]
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(b"one\n\ntwo\n"))
    assert [d.text for d in read_documents(tmp_path / "c.txt.gz")] == ["one", "two"]
    cut = gzip.compress(body * 200)
    (tmp_path / "cut.jsonl.gz").write_bytes(cut[: len(cut) // 2])
    with pytest.raises(CorpusError, match="cut.jsonl.gz.*unreadable compressed stream"):
        read_documents(tmp_path / "cut.jsonl.gz")


def test_faiss_gpu_placement_sizes_the_index_against_the_free_memory():
    from replug_jax.retrieval.faiss_index import gpu_placement

    gib = 1 << 30
    flat_21m = 21_000_000 * 384 * 4  # a 21M x 384 Flat index: 30 GiB
    # ~20 GiB free on each of 8 GPUs (JAX holds the rest): sharded, 3.75 GiB each
    mode, report = gpu_placement(flat_21m, [20 * gib] * 8)
    assert mode == "shard" and "30.04 GiB" in report and "least free 20.00" in report
    assert gpu_placement(2 * gib, [20 * gib] * 8)[0] == "replicate"
    assert gpu_placement(flat_21m, [2 * gib] * 8)[0] == "cpu"  # not even sharded
    assert gpu_placement(flat_21m, None)[0] == "shard"  # unknown free memory: shard
    assert gpu_placement(flat_21m, [2 * gib] * 8, "replicate")[0] == "replicate"  # as asked
