"""replug_jax/train/pool_scoring.py: a pool's pairs go through the score store, each distinct
pair scored once, resumable by LM call, with the time each call took."""

import numpy as np
import pytest

from replug_jax.retrieval.corpus import Passage
from replug_jax.train.data import Example
from replug_jax.train.pool_scoring import score_pairs
from tests._pools import FACTS

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def lm():
    from tests._models import tiny_lm

    return tiny_lm(0)


def test_each_distinct_pair_is_scored_once_into_the_pools_own_store(lm, tmp_path, monkeypatch):
    """Two examples asking the same thing of the same passage are one pair: one LM row; the
    store (default: the pool folder's lm_scores/) serves a rebuild with no LM call."""
    by_id = {i: Passage(i, t) for i, t in enumerate(FACTS)}
    same = Example("a", "q", "The capital of Germany is", " Berlin.")
    examples = [same, Example("b", "q", same.context, same.continuation),
                Example("c", "q", "The capital of France is", " Paris.")]
    cand = np.array([[0, 1], [0, 2], [1, -1]], np.int64)
    rows = []
    real = lm.score_continuations
    monkeypatch.setattr(lm, "score_continuations",
                        lambda p, c: rows.append(len(p)) or real(p, c))
    lp, n_tok, prov = score_pairs(examples, cand, by_id, lm, tmp_path / "pool", {"t": 1},
                                  part_size=2, progress=False)
    assert rows == [3, 1]  # (a,0) = (b,0) scored once; then (c,1)
    np.testing.assert_array_equal(lp[0, 0], lp[1, 0])
    assert n_tok[0] == n_tok[1] > 0 and prov["pairs"] == 5 and prov["pairs_per_second"] > 0
    [want] = real([f"{FACTS[2]}\n\n{same.context}"], [same.continuation])
    np.testing.assert_allclose(lp[1, 1, :len(want.logprobs)], want.logprobs, atol=1e-5)
    assert list((tmp_path / "pool" / "lm_scores").glob("part-*.npz"))
    again = score_pairs(examples, cand, by_id, lm, tmp_path / "pool", {"t": 1}, part_size=2,
                        progress=False)
    assert rows == [3, 1] and again[2]["pairs_per_second"] == prov["pairs_per_second"]
    np.testing.assert_array_equal(again[0], lp)
