"""Reading corpora (retrieval/corpus.py): JSONL lines, null and non-string texts, repeated ids,
and the leakage filter's document numbering."""

import json

import pytest

from tests._models import cached_tokenizer


def test_leakage_filter_names_the_corpus_documents_despite_blank_lines(tmp_path):
    """Rows without an id: examples and corpus number the same physical lines, so every
    example's own passages are excluded (before: one blank line shifted every example)."""
    from replug_jax.retrieval.corpus import chunk_documents, leakage_exclusions, read_documents
    from replug_jax.train.data import lm_examples

    texts = {letter: " ".join(f"{letter}{i}" for i in range(300)) for letter in "ab"}
    path = tmp_path / "docs.jsonl"
    path.write_text(json.dumps({"text": "z short first line"}) + "\n\n"
                    + json.dumps({"text": texts["a"]}) + "\n" + json.dumps({"text": texts["b"]}))
    tok = cached_tokenizer("smollm2")
    examples = lm_examples(path, tok, context_tokens=16, continuation_tokens=16)
    passages = chunk_documents(read_documents(path), size=50, unit="words")
    excluded = leakage_exclusions(examples, passages, "document")
    for ex, ids in zip(examples, excluded):
        [letter] = [k for k, t in texts.items() if ex.context + ex.continuation in t]
        own = {p.id for p in passages if p.text.split()[0][0] == letter}
        assert own and set(ids) == own, ex.id


def test_jsonl_lines_split_only_at_newlines(tmp_path):
    """U+2028 inside a JSON string is valid JSONL; the corpus reader and read_jsonl agree."""
    from replug_jax.fileio import read_jsonl
    from replug_jax.retrieval.corpus import read_documents

    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "a\u2028b", "answer": "c", "text": "x\u2029y"},
                               ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_jsonl(path)[0]["question"] == "a\u2028b"
    assert read_documents(path)[0].text == "x\u2029y"


def test_null_text_is_empty_not_the_string_none(tmp_path):
    from replug_jax.retrieval.corpus import CorpusError, read_documents

    path = tmp_path / "c.jsonl"
    path.write_text('{"text": null}\n{"text": "real"}\n')
    with pytest.warns(UserWarning, match="skipped 1"):
        docs = read_documents(path)
    assert [d.text for d in docs] == ["real"]
    path.write_text('{"text": 7}\n')
    with pytest.raises(CorpusError, match="'text' must be a string"):
        read_documents(path)


def test_duplicate_document_ids_are_named(tmp_path):
    from replug_jax.retrieval.corpus import read_documents

    path = tmp_path / "dup.jsonl"
    path.write_text('{"id": "a", "text": "x"}\n{"id": "b", "text": "y"}\n'
                    '{"id": "a", "text": "z"}\n')
    with pytest.warns(UserWarning, match="1 document\\(s\\) repeat the id"):
        read_documents(path)

