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
    tok = lm.tokenizer if lm is not None and hasattr(lm, "tokenizer") else \
        retriever.model.tokenizer
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
