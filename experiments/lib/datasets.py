"""Data and pipelines the experiment scripts share: NQ, NQ-open, the offline Wikipedia text,
WikiText-2 windows, and a REPLUG pipeline over an in-memory index. Scripts import from here,
never from each other."""

from __future__ import annotations

import json
import re

from experiments.lib.common import load_retriever, require_data
from replug_jax.eval.perplexity import WindowSettings, split_wikitext
from replug_jax.replug import Replug
from replug_jax.retrieval.corpus import Passage, chunk_documents
from replug_jax.retrieval import index_in_memory


def load_nq():
    folder = require_data("nq_gold_passages")
    open_rows = [json.loads(x) for x in (folder / "nq_openbook.jsonl").read_text().splitlines()]
    closed = [json.loads(x) for x in (folder / "nq_closedbook.jsonl").read_text().splitlines()]
    passages, questions = [], []
    for i, row in enumerate(open_rows):
        m = re.match(r"Context: (.*)\n\nQuestion: (.*)\nAnswer:", row["query"], re.S)
        passages.append(Passage(i, m.group(1).strip()))
        questions.append(m.group(2).strip())
    answers = [[r["answer"]] + list(r.get("aliases", [])) for r in closed]
    return passages, questions, answers


def load_nq_open(corpus_kind: str, tokenizer):
    """NQ-open dev questions (3610; the split the literature reports as its test set) with
    their answer lists, and the Wikipedia text available offline as corpus."""
    rows = [json.loads(x) for x in (require_data("nq_open") / "NQ-open.dev.jsonl").read_text()
            .splitlines() if x.strip()]
    questions = [r["question"] for r in rows]
    answers = [list(r["answer"]) for r in rows]
    return wikipedia_passages(corpus_kind, tokenizer), questions, answers


def wikipedia_passages(kind: str, tokenizer) -> list[Passage]:
    """The Wikipedia text available offline: the 624 NQ gold passages (``nq_passages``),
    WikiText-2 test in 128-token passages (``wikitext``), or ``both``."""
    if kind not in ("nq_passages", "wikitext", "both"):
        raise SystemExit(f"corpus must be nq_passages, wikitext or both, got {kind!r}")
    texts = []
    if kind in ("nq_passages", "both"):
        texts += [p.text for p in load_nq()[0]]
    if kind in ("wikitext", "both"):
        raw = (require_data("wikitext2") / "wiki.test.raw").read_text(encoding="utf-8")
        texts += [p.text for p in chunk_documents(split_wikitext(raw), size=128, unit="tokens",
                                                  tokenizer=tokenizer)]
    return [Passage(i, t) for i, t in enumerate(texts)]


def wikitext_setup(cfg, lm, progress: bool = True):
    """(evaluated documents, corpus passages, window settings) for a config."""
    raw = (require_data("wikitext2") / "wiki.test.raw").read_text(encoding="utf-8")
    docs = split_wikitext(raw)
    corpus_docs = docs[:cfg.corpus_documents] if cfg.corpus_documents else docs
    if cfg.num_documents > len(corpus_docs):
        corpus_docs = docs[:max(cfg.num_documents, len(corpus_docs))]
    passages = chunk_documents(corpus_docs, size=cfg.passage_tokens, unit="tokens",
                               tokenizer=lm.tokenizer)
    settings = WindowSettings(cfg.context_tokens, cfg.stride, cfg.query_tokens, cfg.skip_first,
                              cfg.leakage, cfg.max_windows_per_document or None)
    return docs[:cfg.num_documents], passages, settings


def build_pipe(cfg, retriever_source: str, lm, passages) -> Replug:
    retriever = load_retriever(retriever_source)
    index = index_in_memory(passages, retriever)
    return Replug(lm, retriever, index, k=cfg.k, retrieval_temperature=cfg.temperature,
                  seed=cfg.seed)
