"""The demo ``replug demo`` runs: REPLUG on the packaged models (MiniLM, SmolLM2) and the
packaged corpus of Python standard-library documentation, each question answered by the LM
alone and with REPLUG."""

from __future__ import annotations

import pathlib
import time
from typing import Callable, Sequence

from replug_jax.models import DEFAULT_LM, DEFAULT_RETRIEVER

# Docstring snippets are short: 64-word passages and a 256-token encoder limit (5 of 1251
# passages are cut) encode the demo corpus in about half a minute on 2 CPU cores.
PASSAGE_WORDS = 64
MAX_LENGTH = 256
QUESTIONS = (
    "Which function in the json module parses a JSON string into a Python object?",
    "Which function from the statistics module returns the middle value of numeric data?",
    "What does shutil.rmtree do?",
)


def run_demo(index_dir: pathlib.Path, *, retriever: str = DEFAULT_RETRIEVER,
             lm: str = DEFAULT_LM, k: int = 5, max_new_tokens: int = 24,
             questions: Sequence[str] | None = None, progress: bool = True,
             log: Callable[[str], None] = lambda text: None,
             on_answer: Callable[[str, object, object], None] | None = None) -> dict:
    """Build (once) or reuse the demo index at ``index_dir``, then answer each question greedily
    with the LM alone and with REPLUG (top-``k``). ``log`` receives progress lines and
    ``on_answer(question, closed, replug)`` each pair of :class:`~replug_jax.replug.Generation`.
    Returns ``{"results", "settings", "index", "seconds", "passages"}``."""
    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.prompts import qa_branch_input, qa_prompt
    from replug_jax.replug import Replug
    from replug_jax.retrieval.corpus import corpus_checksum, demo_corpus
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.retrieval import Index, IndexLoadError, build_index

    t0 = time.perf_counter()
    passages = demo_corpus(size=PASSAGE_WORDS)
    log(f"corpus: {len(passages)} passages of Python standard-library documentation")
    encoder = Retriever.load(retriever, max_length=MAX_LENGTH)
    try:
        index = Index.load(index_dir, expect_encoder=encoder.identity,
                           expect_corpus_checksum=corpus_checksum(passages))
        log(f"index: reusing {index_dir}")
    except IndexLoadError:
        log(f"index: building {index_dir} (once; reused afterwards)")
        index = build_index(passages, encoder, index_dir, progress=progress,
                            extra={"corpus": "demo"})
    model = FlaxLM.load(lm)
    pipe = Replug(model, encoder, index, k=k)
    results = []
    for q in (questions or QUESTIONS):
        closed = pipe.generate([qa_prompt(q, model.tokenizer)], max_new_tokens, stop=["\n"],
                               mode="none")[0]
        context, prefix = qa_branch_input(q, model.tokenizer)  # passages in the user's turn
        rep = pipe.generate([context], max_new_tokens, stop=["\n"], queries=[q],
                            prefixes=None if prefix is None else [prefix])[0]
        results.append({"question": q, "answer_without_retrieval": closed.text.strip(),
                        "answer_replug": rep.text.strip(), "sources": [
                            {"id": i, "title": t, "weight": round(w, 4)}
                            for i, t, w in zip(rep.doc_ids, rep.doc_titles, rep.weights)],
                        "cost": rep.cost, "cost_without_retrieval": closed.cost})
        if on_answer is not None:
            on_answer(q, closed, rep)
    return {"results": results, "settings": pipe.settings("replug", k),
            "index": str(index_dir), "passages": len(index),
            "seconds": round(time.perf_counter() - t0, 2)}
