"""The demo `make demo` runs (replug_jax/demo.py): its corpus and encoder limit are as its
comment states (64-word passages of the packaged standard-library documentation, 5 of 1251
longer than the 256 tokens the encoder keeps), and its questions are about that corpus."""

from replug_jax import demo
from replug_jax.retrieval.corpus import corpus_text, demo_corpus
from tests._models import cached_tokenizer, packaged_or_skip


def test_the_demo_corpus_fits_the_encoder_as_stated():
    packaged_or_skip("minilm")
    passages = demo_corpus(size=demo.PASSAGE_WORDS)
    embedded = [corpus_text(p) for p in passages]  # what the index build encodes
    tokens = [len(ids) for ids in cached_tokenizer("minilm")(embedded)["input_ids"]]
    assert len(passages) == 1251
    assert sum(n > demo.MAX_LENGTH for n in tokens) == 5
    assert all(len(p.text.split()) <= demo.PASSAGE_WORDS for p in passages)
    text = " ".join(p.text for p in passages)
    for name in ("json", "statistics", "shutil.rmtree"):  # what the questions ask about
        assert name in text and any(name.split(".")[-1] in q for q in demo.QUESTIONS)
