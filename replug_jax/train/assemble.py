"""Build an :class:`LSRTrainer` from a config: load models, corpus and examples."""

from __future__ import annotations

import pathlib

from replug_jax.retrieval.corpus import Passage, chunk_documents, read_documents
from replug_jax.retrieval.encoder import Retriever
from replug_jax.retrieval.store import PassageStore
from replug_jax.train.config import LSRConfig
from replug_jax.train.data import lm_examples, qa_examples, read_demonstrations
from replug_jax.train.loop import LSRTrainer


def load_passages(cfg: LSRConfig, tokenizer=None) -> list[Passage] | PassageStore:
    """The retrieval corpus: a passage store an index build wrote (``passages.arrow``, or the
    index folder holding it: memory-mapped, never read whole), else the corpus file chunked
    by the config."""
    path = pathlib.Path(cfg.corpus)
    if path.is_dir() and (path / "passages.arrow").exists():
        path = path / "passages.arrow"
    if path.suffix == ".arrow":
        return PassageStore.open(path)
    docs = read_documents(cfg.corpus)
    if cfg.chunk_size <= 0:  # every document is one passage, id = its position
        return [Passage(i, d.text, d.title, d.id, 0, len(d.text)) for i, d in enumerate(docs)]
    return chunk_documents(docs, size=cfg.chunk_size, unit=cfg.chunk_unit, tokenizer=tokenizer)


def build_trainer(cfg: LSRConfig, workdir: str | pathlib.Path, *, with_lm: bool = True,
                  progress: bool = True) -> LSRTrainer:
    if not cfg.corpus or not cfg.data:
        raise ValueError("the config needs 'corpus' and 'data' paths")
    retriever = Retriever.load(cfg.retriever, similarity=cfg.similarity,
                               max_length=cfg.doc_max_length,
                               query_max_length=cfg.query_max_length)
    if cfg.supervision == "pool":
        return _pool_trainer(cfg, workdir, retriever, progress)
    lm = None
    if with_lm:
        if cfg.lm_api_base:
            from replug_jax.lm.api_scorer import APIScorer
            from replug_jax.lm.scorer import SCORE, require

            lm = APIScorer.connect(cfg.lm_api_base, model=cfg.lm,
                                   max_context=cfg.lm_max_context,
                                   concurrency=cfg.lm_api_concurrency,
                                   batch_size=cfg.lm_api_batch_size)
            require(lm, SCORE, "LSR supervision")  # one line when the server cannot score
        else:
            import jax

            from replug_jax.lm.flax_scorer import FlaxLM

            if cfg.lm_mesh and jax.process_count() > 1:
                raise ValueError("lm_mesh in a multi-process run: an LM sharded over every "
                                 "process needs every process to score the same pairs, but "
                                 "each LSR process scores its own rows; serve the LM "
                                 "(lm_api_base, e.g. vLLM) or train in one process")
            mesh = lm_mesh(cfg) if cfg.lm_mesh else None
            lm = FlaxLM.load(cfg.lm, dtype=cfg.lm_dtype, mesh=mesh,
                             max_context=cfg.lm_max_context,
                             **({"tokens_per_batch": cfg.lm_tokens_per_batch}
                                if cfg.lm_tokens_per_batch else {}))
    tok = getattr(lm, "tokenizer", None) or retriever.model.tokenizer
    if cfg.task == "qa":
        shots = read_demonstrations(cfg.qa_demonstrations) if cfg.qa_demonstrations else []
        train = qa_examples(cfg.data, shots)
        dev = qa_examples(cfg.dev_data, shots) if cfg.dev_data else []
    else:
        train = lm_examples(cfg.data, tok, cfg.context_tokens, cfg.continuation_tokens)
        dev = lm_examples(cfg.dev_data, tok, cfg.context_tokens,
                          cfg.continuation_tokens) if cfg.dev_data else []
    if cfg.dev_examples:
        dev = dev[:cfg.dev_examples]
    return LSRTrainer(cfg, workdir, retriever=retriever, lm_scorer=lm,
                      passages=load_passages(cfg, tok), train=train, dev=dev, progress=progress)


def lm_mesh(cfg):
    """The in-process LM's mesh: ``lm_mesh`` over every device, or, when its axes multiply to
    fewer, over the last devices (the LM on its own devices; training takes the first
    ``num_devices``, which should then leave those out)."""
    import math
    import warnings

    import jax

    from replug_jax.sharding import make_mesh, parse_mesh

    shape = parse_mesh(cfg.lm_mesh)
    n, total = math.prod(shape.values()), len(jax.devices())
    if n > total:
        raise ValueError(f"lm_mesh {cfg.lm_mesh} needs {n} devices; {total} are visible")
    if n < total and (cfg.num_devices or total) > total - n:
        warnings.warn(f"the LM takes the last {n} devices, which training's "
                      f"{cfg.num_devices or total} devices overlap: set num_devices <= "
                      f"{total - n} to give each its own", stacklevel=2)
    return make_mesh(shape=shape, devices=jax.devices()[total - n:])


def _pool_trainer(cfg: LSRConfig, workdir, retriever, progress: bool) -> LSRTrainer:
    """The trainer on pre-scored pools: ``train_pool``/``dev_pool`` (folders a pool build
    wrote, their examples those of ``data``/``dev_data`` in order), the passages of
    ``corpus``; with ``select_on="recall@1"`` the corpus must be an index folder built by the
    base retriever (the query tower alone learns, so its passage vectors stay valid), which
    the recall@1 of ``recall_data`` (default: the dev questions) is read from. No LM is
    loaded."""
    import numpy as np

    from replug_jax.retrieval import Index
    from replug_jax.train.data import resolve_gold
    from replug_jax.train.pool import ScoredPool

    shots = read_demonstrations(cfg.qa_demonstrations) if cfg.qa_demonstrations else []
    if cfg.task != "qa":
        raise ValueError("supervision='pool' from the command line takes task='qa' examples; "
                         "language-modelling pools are built by experiments/lsr_study.py")
    train = qa_examples(cfg.data, shots)
    dev = qa_examples(cfg.dev_data, shots) if cfg.dev_data else []
    pools = (ScoredPool.load(cfg.train_pool),
             ScoredPool.load(cfg.dev_pool) if cfg.dev_pool else None)
    if pools[1] is not None and not dev:
        raise ValueError("dev_pool needs dev_data: the dev pool's questions")
    passages = load_passages(cfg, retriever.model.tokenizer)
    dev_recall = None
    if cfg.select_on == "recall@1":
        if cfg.towers != "query":
            raise ValueError("select_on='recall@1' from an index needs towers='query' (a "
                             "shared encoder would make the index's passage vectors stale)")
        index = Index.load(cfg.corpus, expect_encoder=retriever.identity)
        questions = qa_examples(cfg.recall_data, shots) if cfg.recall_data else dev
        gold = resolve_gold(questions, passages if isinstance(passages, PassageStore)
                            else PassageStore.from_passages(passages))
        if any(e.gold_doc is None for e in gold):
            raise ValueError("select_on='recall@1' needs a gold_doc on every question of "
                             + ("recall_data" if cfg.recall_data else "dev_data"))

        def dev_recall(params) -> float:
            hits = index.search(retriever.encode_queries([e.query for e in gold], params), 1)
            return float(np.mean([int(row[0]) in set(e.gold_doc)
                                  for e, row in zip(gold, hits.ids)]))
    return LSRTrainer(cfg, workdir, retriever=retriever, lm_scorer=None, passages=passages,
                      train=train, dev=dev, progress=progress, pools=pools,
                      dev_recall=dev_recall)
