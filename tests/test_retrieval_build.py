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

