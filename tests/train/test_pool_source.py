"""replug_jax/train/pool_source.py: a step's batch is its rows of the pool (the LM's Q as the
objective reduces it, the passages embedded at the last refresh), and a pool that does not
fit its examples or k is refused before training."""

import numpy as np
import pytest

from replug_jax.train.config import LSRConfig
from replug_jax.train.data import batch_indices
from replug_jax.train.pool_source import PoolSource
from tests._pools import pool_examples, tiny_pool

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def tiny():
    from tests._models import tiny_lm, tiny_retriever

    return tiny_lm(0), tiny_retriever(0)


def test_a_batch_is_its_rows_of_the_pool_and_misfits_are_refused(tiny, tmp_path):
    pool, passages = tiny_pool(tiny, tmp_path / "pool")
    by_id = {p.id: p for p in passages}
    cfg = LSRConfig.from_tree({"supervision": {"kind": "pool", "train_pool": "p",
                                               "dev_pool": "p"},
                               "objective.lm_score": "sum", "k": 2, "batch_size": 2})
    examples = pool_examples()
    src = PoolSource(cfg, tiny[1], pool, examples, pool, examples, by_id)
    assert src.refresh(0, None) and not src.refresh(1, None)  # embedded once, then kept
    rows = batch_indices(3, 2, len(examples), cfg.seed)
    batch = src.batch(3)
    np.testing.assert_array_equal(batch["lm_scores"], pool.lm_scores("sum")[rows])
    np.testing.assert_array_equal(batch["doc_valid"], pool.branches.doc_mask_NK[rows])
    np.testing.assert_array_equal(batch["doc_emb"], src.d_EMD[rows])
    assert batch["doc_emb"].shape[:2] == (2, 3) and batch["query_ids"].shape[0] == 2
    with pytest.raises(ValueError, match="not the 3 train examples in its order"):
        PoolSource(cfg, tiny[1], pool, examples[:3], pool, examples, by_id)
    with pytest.raises(ValueError, match="k=4 exceeds the train pool's 3 candidates"):
        PoolSource(cfg.updated({"k": 4}), tiny[1], pool, examples, pool, examples, by_id)
    with pytest.raises(ValueError, match="recall over the whole datastore"):
        PoolSource(cfg.updated({"selection.metric": "recall@1"}), tiny[1], pool, examples,
                   pool, examples, by_id)
