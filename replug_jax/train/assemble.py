"""Build an :class:`LSRTrainer` from a config: load models, corpus and examples."""

from __future__ import annotations

import pathlib

from replug_jax.retrieval.corpus import Passage, chunk_documents, read_documents
from replug_jax.retrieval.encoder import Retriever
from replug_jax.retrieval.store import PassageStore
from replug_jax.train.config import DataConfig, LSRConfig
from replug_jax.train.data import lm_examples, qa_examples, read_demonstrations
from replug_jax.train.loop import LSRTrainer


def load_passages(data: DataConfig, tokenizer=None) -> list[Passage] | PassageStore:
    """The retrieval corpus: a passage store an index build wrote (``passages.arrow``, or the
    index folder holding it: memory-mapped, never read whole), else the corpus file chunked
    by the config."""
    path = pathlib.Path(data.corpus)
    if path.is_dir() and (path / "passages.arrow").exists():
        path = path / "passages.arrow"
    if path.suffix == ".arrow":
        return PassageStore.open(path)
    docs = read_documents(data.corpus)
    if data.chunk_size <= 0:  # every document is one passage, id = its position
        return [Passage(i, d.text, d.title, d.id, 0, len(d.text)) for i, d in enumerate(docs)]
    return chunk_documents(docs, size=data.chunk_size, unit=data.chunk_unit, tokenizer=tokenizer)


def build_trainer(cfg: LSRConfig, workdir: str | pathlib.Path, *, with_lm: bool = True,
                  progress: bool = True) -> LSRTrainer:
    if not cfg.data.corpus or not cfg.data.train:
        raise ValueError("the config needs data.corpus and data.train paths")
    retriever = Retriever.load(cfg.retriever.name, similarity=cfg.retriever.similarity,
                               max_length=cfg.retriever.doc_max_length,
                               query_max_length=cfg.retriever.query_max_length)
    if cfg.supervision.kind == "pool":
        return _pool_trainer(cfg, workdir, retriever, progress)
    lm = None
    if with_lm:
        if cfg.lm.api_base:
            from replug_jax.lm.api_scorer import APIScorer
            from replug_jax.lm.scorer import SCORE, require

            lm = APIScorer.connect(cfg.lm.api_base, model=cfg.lm.name,
                                   max_context=cfg.lm.max_context,
                                   concurrency=cfg.lm.api_concurrency,
                                   batch_size=cfg.lm.api_batch_size)
            require(lm, SCORE, "LSR supervision")  # one line when the server cannot score
        else:
            import jax

            from replug_jax.lm.flax_scorer import FlaxLM

            if cfg.lm.mesh and jax.process_count() > 1:
                raise ValueError("lm.mesh in a multi-process run: an LM sharded over every "
                                 "process needs every process to score the same pairs, but "
                                 "each LSR process scores its own rows; serve the LM "
                                 "(lm.api_base, e.g. vLLM) or train in one process")
            mesh = lm_mesh(cfg) if cfg.lm.mesh else None
            lm = FlaxLM.load(cfg.lm.name, dtype=cfg.lm.dtype, mesh=mesh,
                             max_context=cfg.lm.max_context,
                             **({"tokens_per_batch": cfg.lm.tokens_per_batch}
                                if cfg.lm.tokens_per_batch else {}))
    tok = getattr(lm, "tokenizer", None) or retriever.model.tokenizer
    data = cfg.data
    if data.task == "qa":
        shots = read_demonstrations(data.qa_demonstrations) if data.qa_demonstrations else []
        train = qa_examples(data.train, shots)
        dev = qa_examples(data.dev, shots) if data.dev else []
    else:
        train = lm_examples(data.train, tok, data.context_tokens, data.continuation_tokens)
        dev = lm_examples(data.dev, tok, data.context_tokens,
                          data.continuation_tokens) if data.dev else []
    if data.dev_examples:
        dev = dev[:data.dev_examples]
    return LSRTrainer(cfg, workdir, retriever=retriever, lm_scorer=lm,
                      passages=load_passages(data, tok), train=train, dev=dev,
                      progress=progress)


def lm_mesh(cfg):
    """The in-process LM's mesh: ``lm.mesh`` over every device, or, when its axes multiply to
    fewer, over the last devices (the LM on its own devices; training takes the first
    ``num_devices``, which should then leave those out)."""
    import math
    import warnings

    import jax

    from replug_jax.sharding import make_mesh, parse_mesh

    shape = parse_mesh(cfg.lm.mesh)
    n, total = math.prod(shape.values()), len(jax.devices())
    if n > total:
        raise ValueError(f"lm.mesh {cfg.lm.mesh} needs {n} devices; {total} are visible")
    if n < total and (cfg.num_devices or total) > total - n:
        warnings.warn(f"the LM takes the last {n} devices, which training's "
                      f"{cfg.num_devices or total} devices overlap: set num_devices <= "
                      f"{total - n} to give each its own", stacklevel=2)
    return make_mesh(shape=shape, devices=jax.devices()[total - n:])


def _pool_trainer(cfg: LSRConfig, workdir, retriever, progress: bool) -> LSRTrainer:
    """The trainer on pre-scored pools: ``supervision.train_pool``/``dev_pool`` (folders a
    pool build wrote, their examples those of ``data.train``/``data.dev`` in order), the
    passages of ``data.corpus``; with ``selection.metric="recall@1"`` the corpus must be an
    index folder built by the base retriever (the query tower alone learns, so its passage
    vectors stay valid), which the recall@1 of ``selection.recall_data`` (default: the dev
    questions) is read from. No LM is loaded."""
    import numpy as np

    from replug_jax.retrieval import Index
    from replug_jax.train.data import resolve_gold
    from replug_jax.train.pool import ScoredPool

    data = cfg.data
    shots = read_demonstrations(data.qa_demonstrations) if data.qa_demonstrations else []
    if data.task != "qa":
        raise ValueError("supervision.kind='pool' from the command line takes data.task='qa' "
                         "examples; language-modelling pools are built by "
                         "experiments/lsr_study.py")
    train = qa_examples(data.train, shots)
    dev = qa_examples(data.dev, shots) if data.dev else []
    pools = (ScoredPool.load(cfg.supervision.train_pool),
             ScoredPool.load(cfg.supervision.dev_pool) if cfg.supervision.dev_pool else None)
    if pools[1] is not None and not dev:
        raise ValueError("supervision.dev_pool needs data.dev: the dev pool's questions")
    passages = load_passages(cfg.data, retriever.model.tokenizer)
    dev_recall = None
    if cfg.selection.metric == "recall@1":
        if cfg.supervision.towers != "query":
            raise ValueError("selection.metric='recall@1' from an index needs "
                             "supervision.towers='query' (a shared encoder would make the "
                             "index's passage vectors stale)")
        index = Index.load(cfg.data.corpus, expect_encoder=retriever.identity)
        recall_data = cfg.selection.recall_data
        questions = qa_examples(recall_data, shots) if recall_data else dev
        gold = resolve_gold(questions, passages if isinstance(passages, PassageStore)
                            else PassageStore.from_passages(passages))
        if any(e.gold_doc is None for e in gold):
            raise ValueError("selection.metric='recall@1' needs a gold_doc on every question of "
                             + ("selection.recall_data" if recall_data else "data.dev"))

        def dev_recall(params) -> float:
            hits = index.search(retriever.encode_queries([e.query for e in gold], params), 1)
            return float(np.mean([int(row[0]) in set(e.gold_doc)
                                  for e, row in zip(gold, hits.ids)]))
    return LSRTrainer(cfg, workdir, retriever=retriever, lm_scorer=None, passages=passages,
                      train=train, dev=dev, progress=progress, pools=pools,
                      dev_recall=dev_recall)
