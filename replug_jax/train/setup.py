"""Build an :class:`LSRTrainer` from a config: load models, corpus and examples."""

from __future__ import annotations

import json
import pathlib

from replug_jax.retrieval.corpus import Passage, chunk_documents, read_documents
from replug_jax.retrieval.encoder import Retriever
from replug_jax.train.config import LSRConfig
from replug_jax.train.data import lm_examples, qa_examples
from replug_jax.train.loop import LSRTrainer


def load_passages(cfg: LSRConfig) -> list[Passage]:
    docs = read_documents(cfg.corpus)
    if cfg.chunk_size <= 0:  # every document is one passage, id = its position
        return [Passage(i, d.text, d.title, d.id, 0, len(d.text)) for i, d in enumerate(docs)]
    return chunk_documents(docs, size=cfg.chunk_size)


def build_trainer(cfg: LSRConfig, workdir: str | pathlib.Path, *, with_lm: bool = True,
                  progress: bool = True) -> LSRTrainer:
    if not cfg.corpus or not cfg.data:
        raise ValueError("the config needs 'corpus' and 'data' paths")
    retriever = Retriever.load(cfg.retriever, similarity=cfg.similarity,
                               max_length=cfg.doc_max_length)
    lm = None
    if with_lm:
        if cfg.lm_api_base:
            from replug_jax.lm.api_scorer import APIScorer

            lm = APIScorer(cfg.lm_api_base, model=cfg.lm)
        else:
            from replug_jax.lm.flax_scorer import FlaxLM

            lm = FlaxLM.load(cfg.lm, max_context=1024)
    if cfg.task == "qa":
        train, dev = qa_examples(cfg.data), qa_examples(cfg.dev_data) if cfg.dev_data else []
    else:
        tok = lm.tokenizer if lm is not None and hasattr(lm, "tokenizer") else \
            retriever.model.tokenizer
        train = lm_examples(cfg.data, tok, cfg.context_tokens, cfg.continuation_tokens)
        dev = lm_examples(cfg.dev_data, tok, cfg.context_tokens,
                          cfg.continuation_tokens) if cfg.dev_data else []
    return LSRTrainer(cfg, workdir, retriever=retriever, lm_scorer=lm,
                      passages=load_passages(cfg), train=train, dev=dev, progress=progress)


def saved_config(workdir: str | pathlib.Path) -> LSRConfig:
    path = pathlib.Path(workdir) / "config.json"
    if not path.exists():
        raise ValueError(f"{workdir}: no config.json, not an LSR work directory")
    return LSRConfig(**json.loads(path.read_text())["config"])


def model_card(cfg: LSRConfig, step: int, dev: dict | None, workdir) -> str:
    lines = ["# REPLUG LSR retriever", "",
             f"- base retriever: `{cfg.retriever}` ({cfg.similarity} similarity, mean pooling)",
             f"- supervising LM: `{cfg.lm}`" + (f" via {cfg.lm_api_base}" if cfg.lm_api_base
                                                 else ""),
             f"- task: {cfg.task}; data: `{cfg.data}`; corpus: `{cfg.corpus}`",
             f"- steps: {step} of {cfg.total_steps}; batch {cfg.batch_size}; k={cfg.k}; "
             f"γ={cfg.gamma}, β={cfg.beta}; {cfg.direction}; LM score {cfg.lm_score}; "
             f"objective {cfg.objective}; {cfg.optimizer} lr {cfg.learning_rate}",
             f"- index refresh every {cfg.refresh_every} steps ({cfg.refresh_mode})",
             f"- trained in `{workdir}`", "", "## Dev metrics", "",
             "```json", json.dumps(dev or {}, indent=2), "```", "",
             "## Config", "", "```json", json.dumps(cfg.to_json(), indent=2), "```", "",
             "Load with `transformers.BertModel.from_pretrained(<this folder>)` (mean-pool the "
             "last layer over non-padding tokens) or `replug_jax.models.load_retriever`."]
    return "\n".join(lines) + "\n"
