"""Shared builders of the pool tests: a tiny pre-scored pool and the one trainer over it."""

from __future__ import annotations

import numpy as np

from replug_jax.retrieval.corpus import Passage
from replug_jax.train.data import Example

FACTS = ["Berlin is the capital of Germany.", "Paris is the capital of France.",
         "The Rhine flows into the North Sea.", "Madrid is the capital of Spain.",
         "Rome is the capital of Italy.", "Vienna is the capital of Austria."]


def pool_examples(n: int = 4) -> list[Example]:
    pairs = [("The capital of Germany is", " Berlin."), ("The capital of France is", " Paris."),
             ("The capital of Spain is", " Madrid."), ("The capital of Italy is", " Rome.")]
    return [Example(f"e{i}", x, x, y) for i, (x, y) in enumerate(pairs[:n])]


def tiny_pool(tiny, directory, **kw):
    """A pool of 4 examples × 3 candidates of FACTS (one example with 2), scored by the tiny
    LM: ``(pool, passages)``."""
    from replug_jax.train.pool import build_pool

    lm, retriever = tiny
    passages = [Passage(i, t) for i, t in enumerate(FACTS)]
    rng = np.random.default_rng(0)
    cand = np.stack([rng.permutation(len(FACTS))[:3] for _ in range(4)]).astype(np.int64)
    cand[3, 2] = -1  # an example with fewer candidates than M
    scores = rng.normal(size=cand.shape).astype(np.float32)
    return build_pool(pool_examples(), cand, scores, {p.id: p for p in passages}, lm,
                      directory, {"lm": lm.name, "test": 1}, part_size=2, progress=False,
                      **kw), passages


def pool_trainer(tiny, tmp_path, objective: str = "kl_retriever_to_lm", towers: str = "shared",
                 dev_recall=None, **kw):
    """The one trainer (``supervision="pool"``) on :func:`tiny_pool` (train = dev), one
    device, a checkpoint every step; ``kw`` overrides the config (dotted keys as
    ``LSRConfig.updated`` takes them: ``**{"selection.metric": "pool_loglik"}``)."""
    from replug_jax.train.config import LSRConfig
    from replug_jax.train.loop import LSRTrainer
    from replug_jax.train.spec import OBJECTIVES

    pool, passages = tiny_pool(tiny, tmp_path / "pool")
    kind, direction = OBJECTIVES[objective]
    cfg = LSRConfig.from_tree({
        "supervision": {"kind": "pool", "train_pool": str(tmp_path / "pool"),
                        "dev_pool": str(tmp_path / "pool"), "towers": towers},
        "objective": {"kind": kind, "direction": direction,
                      "lm_score": "sum" if objective == "marginal" else "mean"},
        "k": 2, "total_steps": 4, "batch_size": 2, "retrieval.refresh_every": 2,
        "selection": {"every": 1, "tau": 1.0, "metric": "last"}, "optim.learning_rate": 1e-3,
        "num_devices": 1, "checkpoint_every": 1,
        "retriever": {"name": "tiny", "query_max_length": tiny[1].query_max_length,
                      "doc_max_length": tiny[1].max_length}}).updated(kw)
    return LSRTrainer(cfg, tmp_path / "run", retriever=tiny[1], lm_scorer=None,
                      passages=passages, train=pool_examples(), dev=pool_examples(),
                      progress=False, pools=(pool, pool), dev_recall=dev_recall)
