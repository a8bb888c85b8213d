"""The content-keyed store of LM scores (replug_jax/lm/score_store.py): pairs found by their
text whatever pool, split or candidate order asks for them, resumable and refusing another
LM's scores."""

import numpy as np
import pytest

from replug_jax.lm.score_store import ScoreStore, pair_key, scorer_identity
from replug_jax.retrieval.corpus import Passage
from replug_jax.train.pool import build_pool
from replug_jax.train.supervision import branch_prompts
from tests._pools import FACTS, pool_examples as _examples


@pytest.fixture(scope="module")
def tiny():
    from tests._models import tiny_lm, tiny_retriever

    return tiny_lm(0), tiny_retriever(0)


def test_the_store_keeps_rows_across_opens_and_refuses_another_lm(tmp_path):
    store = ScoreStore(tmp_path / "s", "lm-a")
    keys = [pair_key("d1 x", " y"), pair_key("d2 x", " y")]
    store.add(keys, [np.array([-1.0, -2.0]), np.array([-0.5])], seconds=3.0)
    again = ScoreStore(tmp_path / "s", "lm-a")
    assert len(again) == 2 and pair_key("d1 x", " z") not in again
    row, share = again.get(keys[0])
    np.testing.assert_array_equal(row, [-1.0, -2.0])
    assert share == pytest.approx(1.5)  # the call's seconds, shared by its pairs
    np.testing.assert_array_equal(again.get(keys[1])[0], [-0.5])
    with pytest.raises(ValueError, match="lm-a"):
        ScoreStore(tmp_path / "s", "lm-b")
    with pytest.raises(ValueError, match="2 keys for 1"):
        store.add(keys, [np.zeros(1)], 0.0)
    part = next((tmp_path / "s").glob("part-*.npz"))
    part.write_bytes(part.read_bytes()[:50])  # cut short: its pairs are scored again
    with pytest.warns(UserWarning, match="scored again"):
        assert len(ScoreStore(tmp_path / "s", "lm-a")) == 0


@pytest.mark.models
def test_pools_share_pairs_through_the_store(tiny, tmp_path, monkeypatch):
    """A second pool of the same pairs in another order and folder calls the LM for none of
    them and equals the first; a pool with one new candidate scores that pair only."""
    lm, _ = tiny
    passages = [Passage(i, t) for i, t in enumerate(FACTS)]
    by_id = {p.id: p for p in passages}
    cand = np.array([[0, 1, 2], [1, 3, 4], [2, 0, -1], [4, 5, 3]], np.int64)
    scores = np.zeros(cand.shape, np.float32)
    store = ScoreStore(tmp_path / "store", scorer_identity(lm))
    first = build_pool(_examples(), cand, scores, by_id, lm, tmp_path / "a", {"p": 1},
                       part_size=2, progress=False, store=store)
    assert len(store) == int((cand >= 0).sum())
    calls = []
    real = lm.score_continuations
    monkeypatch.setattr(lm, "score_continuations",
                        lambda p, c: calls.append(len(p)) or real(p, c))
    flipped = cand[:, ::-1].copy()
    second = build_pool(_examples(), flipped, scores, by_id, lm, tmp_path / "b", {"p": 2},
                        part_size=3, progress=False,
                        store=ScoreStore(tmp_path / "store", scorer_identity(lm)))
    assert calls == []
    t = first.branches.logprobs_NKT.shape[-1]
    np.testing.assert_array_equal(second.branches.logprobs_NKT[:, ::-1, :t],
                                  first.branches.logprobs_NKT)
    assert second.provenance["pairs_per_second"] > 0  # the stored pairs keep their time
    one_new = cand.copy()
    one_new[2, 2] = 5
    third = build_pool(_examples(), one_new, scores, by_id, lm, tmp_path / "c", {"p": 3},
                       part_size=2, progress=False, store=store)
    assert calls == [1]
    ex = _examples()[2]
    [want] = real(branch_prompts([ex], [passages[5]], lm), [ex.continuation])
    n = len(want.logprobs)
    np.testing.assert_allclose(third.branches.logprobs_NKT[2, 2, :n], want.logprobs, atol=1e-5)


def test_a_pipeline_over_the_stored_lm_scores_as_over_the_lm_and_each_pair_once(tiny, tmp_path,
                                                                               monkeypatch):
    """REPLUG scoring through StoredLM gives the LM's results (log-probs, tokens, mixture);
    the same call again, or from a new process on the same folder, calls the LM for nothing;
    a call with one new pair scores that pair only, once though it appears twice."""
    from replug_jax.lm.score_store import StoredLM
    from replug_jax.replug import Replug
    from replug_jax.retrieval import index_in_memory

    lm, retriever = tiny
    passages = [Passage(i, t) for i, t in enumerate(FACTS)]
    index = index_in_memory(passages, retriever)
    contexts = ["The river flows through", "The capital city is"]
    targets = [" the valley.", " far away."]
    want = Replug(lm, retriever, index, k=3).score(contexts, targets, reliance=False)
    stored = StoredLM(lm, ScoreStore(tmp_path / "s", scorer_identity(lm)))
    got = Replug(stored, retriever, index, k=3).score(contexts, targets, reliance=False)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g.branch_logprobs, w.branch_logprobs, atol=1e-5)
        assert g.tokens == w.tokens and g.loglik == pytest.approx(w.loglik, abs=1e-4)
    calls = []
    real = lm.score_continuations
    monkeypatch.setattr(lm, "score_continuations",
                        lambda p, c: calls.append(len(p)) or real(p, c))
    again = StoredLM(lm, ScoreStore(tmp_path / "s", scorer_identity(lm)))
    got2 = Replug(again, retriever, index, k=3).score(contexts, targets, reliance=False)
    assert calls == []
    for g, g2 in zip(got, got2):
        np.testing.assert_array_equal(g2.branch_logprobs, g.branch_logprobs)
        assert g2.tokens == g.tokens
    scores = again.score_continuations(["a new prompt", "a new prompt", contexts[0]],
                                       [" x", " x", " y"])
    assert calls == [2] and scores[0].tokens == scores[1].tokens
