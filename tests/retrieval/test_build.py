"""Building an index's passage store (retrieval/build.py)."""

import json


def test_token_chunks_are_not_reused_with_another_tokenizer(tmp_path):
    from tests._models import cached_tokenizer
    from replug_jax.retrieval.build import corpus_store
    from replug_jax.retrieval.store import PassageStore

    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": " ".join(f"w{i}" for i in range(200))}) + "\n")
    kw = dict(chunk_unit="tokens", chunk_size=32, progress=False)
    a = PassageStore.open(corpus_store(corpus, tmp_path / "idx", tokenizer=cached_tokenizer(
        "minilm"), **kw))
    b = PassageStore.open(corpus_store(corpus, tmp_path / "idx", tokenizer=cached_tokenizer(
        "smollm2"), **kw))
    assert len(a) != len(b) or a.checksum != b.checksum  # re-chunked, not the old chunks



def test_merged_indexes_search_as_one_index_of_all_their_passages(tmp_path, capsys):
    """`replug index merge`: the merged index's hits (ids offset, scores) equal those of one
    index built over every passage with those ids; no passage is encoded again; id clashes,
    another encoder and an approximate part are refused in one line."""
    import dataclasses

    import numpy as np
    import pytest

    from replug_jax.cli import main
    from replug_jax.retrieval.build import index_in_memory, merge_indexes
    from replug_jax.retrieval.corpus import Passage
    from tests._models import tiny_retriever

    retriever = tiny_retriever(0)
    own = [Passage(i, f"Paragraph {i} about river {i % 3}.", f"T{i}") for i in range(5)]
    other = [Passage(i, f"Distractor {i} on mountains {i}.", f"D{i}") for i in range(4)]
    for name, ps in (("own", own), ("other", other)):
        index_in_memory(ps, retriever).save(tmp_path / name)
    encode = retriever.encode_passages
    retriever.encode_passages = None  # a merge encodes nothing
    assert main(["index", "merge", str(tmp_path / "own"), str(tmp_path / "other"), "--out",
                 str(tmp_path / "merged"), "--offsets", "0", "1000"]) == 0
    merged = merge_indexes([tmp_path / "own", tmp_path / "other"], tmp_path / "m2", [0, 1000])
    retriever.encode_passages = encode
    every = own + [dataclasses.replace(p, id=p.id + 1000) for p in other]
    whole = index_in_memory(every, retriever)
    queries = retriever.encode_queries(["river 1", "mountains 2", "Paragraph 4"])
    got, want = merged.search(queries, 6), whole.search(queries, 6)
    np.testing.assert_array_equal(got.ids, want.ids)
    np.testing.assert_allclose(got.scores, want.scores, atol=1e-6)
    assert [p.text for p in got.passages[1]] == [p.text for p in want.passages[1]]
    assert [m["offset"] for m in merged.manifest["merged_from"]] == [0, 1000]
    with pytest.raises(ValueError, match="share an id"):
        merge_indexes([tmp_path / "own", tmp_path / "other"], tmp_path / "clash")
    index_in_memory(other, tiny_retriever(1)).save(tmp_path / "other_encoder")
    with pytest.raises(ValueError, match="another encoder"):
        merge_indexes([tmp_path / "own", tmp_path / "other_encoder"], tmp_path / "x", [0, 9])
    approx = index_in_memory(other, retriever, factory="IVF2,Flat", nprobe=1)
    approx.save(tmp_path / "approx")
    with pytest.raises(ValueError, match="only exact"):
        merge_indexes([tmp_path / "own", tmp_path / "approx"], tmp_path / "y", [0, 9])
    capsys.readouterr()
    assert main(["index", "merge", str(tmp_path / "own"), "--out", str(tmp_path / "one")]) == 2
    assert "two or more" in capsys.readouterr().err
