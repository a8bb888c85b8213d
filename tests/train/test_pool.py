"""LSR on a pre-scored pool: the pool artefact (resumable, provenance-checked), REPLUG within
the pool against a hand-computed mixture, and the training loop."""

import json

import numpy as np
import pytest

from replug_jax.train.pool import (
    ScoredPool,
    build_pool,
    pool_logliks,
    score_pairs,
    top_k_in_pool,
)
from tests._pools import pool_examples as _examples, tiny_pool as _pool

pytestmark = pytest.mark.models


@pytest.fixture(scope="module")
def tiny():
    from tests._models import tiny_lm, tiny_retriever

    return tiny_lm(0), tiny_retriever(0)


def test_pool_scores_equal_the_lm_and_resume_after_a_kill(tiny, tmp_path, monkeypatch):
    lm, _ = tiny
    pool, passages = _pool(tiny, tmp_path / "pool")
    from replug_jax.train.supervision import branch_prompts

    ex = _examples()[1]
    j = 1
    [want] = lm.score_continuations(
        branch_prompts([ex], [passages[int(pool.doc_ids_EM[1, j])]], lm), [ex.continuation])
    n = len(want.logprobs)
    np.testing.assert_allclose(pool.branches.logprobs_NKT[1, j, :n], want.logprobs, atol=1e-5)
    assert pool.branches.token_mask_NT[1].sum() == n and not pool.branches.doc_mask_NK[3, 2]
    np.testing.assert_allclose(pool.lm_scores("sum")[1, j], want.logprobs.sum(), rtol=1e-5)
    # a rebuild after losing one LM call's part of the store rescores that call's pairs only,
    # and gives the same pool (calls of 2 examples: 6 pairs, then 3 + 2)
    for part in (tmp_path / "pool" / "lm_scores").glob("part-*.npz"):
        with np.load(part) as z:
            if len(z["keys"]) == 5:
                part.unlink()
    calls = []
    real = lm.score_continuations
    monkeypatch.setattr(lm, "score_continuations",
                        lambda p, c: calls.append(len(p)) or real(p, c))
    again, _ = _pool(tiny, tmp_path / "pool")
    assert calls == [5]  # examples 2 and 3: 3 + 2 candidates
    np.testing.assert_array_equal(again.branches.logprobs_NKT, pool.branches.logprobs_NKT)
    # the rate covers every part, each keeping its scoring time (a resume still states it)
    pairs = int((pool.doc_ids_EM >= 0).sum())
    assert pool.provenance["pairs_timed"] == again.provenance["pairs_timed"] == pairs
    assert again.provenance["pairs_per_second"] > 0
    loaded = ScoredPool.load(tmp_path / "pool", expect={"test": 1})
    np.testing.assert_array_equal(loaded.doc_ids_EM, pool.doc_ids_EM)
    with pytest.raises(ValueError, match="test=1"):
        ScoredPool.load(tmp_path / "pool", expect={"test": 2})
    lm_, ret = tiny
    with pytest.raises(ValueError, match="other settings"):
        build_pool(_examples(), pool.doc_ids_EM, pool.branches.scores_NK,
                   {p.id: p for p in passages}, lm_, tmp_path / "pool", {"lm": "another"},
                   progress=False)


def test_pairs_of_examples_without_candidates_are_scored_as_the_pool_scores_them(tiny,
                                                                                 tmp_path):
    """What ``lsr_qa`` scores beyond the test pool: some questions have no pair missing."""
    lm, _ = tiny
    pool, passages = _pool(tiny, tmp_path / "pool")
    cand = pool.doc_ids_EM.copy()
    cand[[0, 2]] = -1  # two examples with nothing to score
    by_id = {p.id: p for p in passages}
    with pytest.raises(ValueError, match="no scored document"):  # a pool needs a candidate
        build_pool(_examples(), cand, np.zeros(cand.shape, np.float32), by_id, lm,
                   tmp_path / "pool2", {"test": 2}, part_size=2, progress=False)
    lp_EMT, n_tok_E, prov = score_pairs(_examples(), cand, by_id, lm, tmp_path / "extra",
                                        {"test": 2}, part_size=2, progress=False)
    assert prov["pairs"] == int((cand >= 0).sum())
    t = lp_EMT.shape[-1]
    for i in (1, 3):
        np.testing.assert_allclose(lp_EMT[i][cand[i] >= 0],
                                   pool.branches.logprobs_NKT[i][cand[i] >= 0][:, :t],
                                   atol=1e-6)
    assert not lp_EMT[[0, 2]].any() and n_tok_E[1] == pool.branches.token_mask_NT[1].sum()


def test_replug_within_the_pool_equals_a_hand_computed_mixture(tiny, tmp_path):
    pool, _ = _pool(tiny, tmp_path / "pool")
    scores = np.random.default_rng(1).normal(size=pool.doc_ids_EM.shape)
    got = pool_logliks(pool, scores, k=2, temperature=0.5)
    c = pool.branches
    for i in range(len(pool)):
        valid = np.flatnonzero(c.doc_mask_NK[i])
        top = valid[np.argsort(-scores[i, valid], kind="stable")[:2]]
        w = np.exp(scores[i, top] / 0.5)
        w /= w.sum()
        t = c.token_mask_NT[i]
        mix = np.log((w[:, None] * np.exp(c.logprobs_NKT[i][top][:, t])).sum(0)).sum()
        assert got[i] == pytest.approx(mix, rel=1e-5)
    assert list(top_k_in_pool(np.zeros((1, 3)), np.array([[False, True, True]]), 2)[0]) == \
        [1, 2]


@pytest.mark.parametrize("objective", ["kl_retriever_to_lm", "kl_lm_to_retriever", "marginal"])
def test_training_on_the_pool_moves_the_retriever_and_keeps_the_best_dev(tiny, tmp_path,
                                                                          objective):
    """Every objective trains (finite losses, parameters move); the kept parameters are
    those of the best dev value on the curve, and the base's when no step beats it."""
    from tests._pools import pool_trainer

    trainer = pool_trainer(tiny, tmp_path, objective, total_steps=6, **{
        "retrieval.refresh_every": 3, "selection.every": 2, "optim.learning_rate": 1e-3,
        "selection.metric": "pool_loglik", "selection.patience": 10})
    fit = trainer.run()
    curve = fit["curve"]
    assert [c["step"] for c in curve] == [0, 2, 4, 6] and fit["step"] == 6
    assert all(np.isfinite(c["loss"]) for c in curve[1:])
    best = min(curve, key=lambda c: c["dev_bpb"])
    assert fit["best_step"] == best["step"] and fit["best"]["dev_bpb"] == best["dev_bpb"]
    _, params = trainer.best_params()
    import jax

    moved = max(float(np.abs(a - b).max()) for a, b in zip(
        jax.tree.leaves(params), jax.tree.leaves(tiny[1].params)))
    assert (moved > 0) == (fit["best_step"] > 0)
    json.dumps(curve)  # plain numbers, ready for the results JSON


def test_a_pool_run_refuses_a_config_that_misstates_the_retrievers_lengths(tiny, tmp_path):
    """Pools are encoded at the lengths of the retriever handed in, and the export writes the
    config's into the release's ``replug.json``: a config that says otherwise is refused
    before training, naming both."""
    from tests._pools import pool_trainer

    with pytest.raises(ValueError, match=r"passages at 64 tokens but the config says "
                                         r"retriever.query_max_length=64, doc_max_length=32"):
        pool_trainer(tiny, tmp_path, **{"retriever.doc_max_length": 32})


def test_pool_key_has_the_separator_and_part_size_and_survives_json(tiny, tmp_path):
    """Issue 37, items 8, 13, 14: another separator or part size is another pool (before: the
    old scores came back with 0 LM calls, or a shape error); provenance with tuples resumes;
    a truncated part is rescored; a candidates file of the wrong shape is refused."""
    lm, _ = tiny
    pool, passages = _pool(tiny, tmp_path / "pool")
    by_id = {p.id: p for p in passages}
    args = (_examples(), pool.doc_ids_EM, pool.branches.scores_NK, by_id, lm)
    for kw in ({"separator": "\n"}, {"part_size": 3}):
        with pytest.raises(ValueError, match="other settings"):
            build_pool(*args, tmp_path / "pool", {"lm": lm.name, "test": 1}, progress=False,
                       **{"part_size": 2, **kw})
    with_tuple = {"lm": lm.name, "grid": (0.1, 0.1)}
    build_pool(*args, tmp_path / "tuple", with_tuple, part_size=2, progress=False)
    build_pool(*args, tmp_path / "tuple", with_tuple, part_size=2, progress=False)  # resumes
    part = next((tmp_path / "pool" / "lm_scores").glob("part-*.npz"))
    part.write_bytes(part.read_bytes()[:40])  # cut short
    with pytest.warns(UserWarning, match="scored again"):
        again, _ = _pool(tiny, tmp_path / "pool")
    np.testing.assert_array_equal(again.branches.logprobs_NKT, pool.branches.logprobs_NKT)
    np.save(tmp_path / "pool" / "candidates.npy", pool.doc_ids_EM[:, :2])
    with pytest.raises(ValueError, match="candidates.npy.*rebuild the pool"):
        ScoredPool.load(tmp_path / "pool")
    (tmp_path / "pool" / "branches.npz").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(ValueError, match="not a readable file of scored branches"):
        ScoredPool.load(tmp_path / "pool")


def test_the_marginal_objective_needs_summed_scores_in_every_trainer():
    """Issue 34, point 1: the pool trainer once passed mean token log-likelihoods into the
    marginal likelihood; the rule is now the main trainer's, in one place."""
    from replug_jax.train.config import LSRConfig

    LSRConfig.from_tree({"objective.kind": "marginal"})  # the sum: the default, the paper's Q
    with pytest.raises(ValueError, match="needs lm_score 'sum'"):
        LSRConfig.from_tree({"objective": {"kind": "marginal", "lm_score": "mean"}})


def test_each_step_re_ranks_the_pool_with_the_current_queries(tiny):
    """The step retrieves, within each query's whole pool, the top k by the *current* query
    embedding against the refreshed passage embeddings (not a ranking fixed at the refresh):
    its loss equals lsr_loss over that hand-picked top k, and a second step, after the
    query tower moved, picks by its own scores again."""
    import jax.numpy as jnp

    from replug_jax.core.losses import lsr_loss
    from replug_jax.models.bert import embed
    from replug_jax.models.params import split_params, to_module
    from replug_jax.train.lsr import init_state, make_query_step

    _, retriever = tiny
    from replug_jax.train.config import LSRConfig

    cfg = LSRConfig.from_tree({"k": 2, "total_steps": 4, "optim.learning_rate": 5e-2})
    graphdef, template, params = split_params(retriever.model.encoder)
    tx = cfg.optim.build(cfg.total_steps)
    step = make_query_step(graphdef, template, cfg.objective, tx,
                           retriever.model.pooling, retriever.normalize, cfg.k,
                           schedule=cfg.optim.schedule(cfg.total_steps))
    ids, mask = retriever.tokenize_fixed(["capital of Germany", "the Rhine river"], 16, "right")
    rng = np.random.default_rng(0)
    batch = {"query_ids": ids, "query_mask": mask,
             "doc_emb": rng.normal(size=(2, 5, 32)).astype(np.float32),
             "doc_valid": np.array([[True] * 5, [True, True, False, True, True]]),
             "lm_scores": rng.normal(size=(2, 5)).astype(np.float32)}

    def by_hand(p):
        q = np.asarray(embed(to_module(graphdef, template, p), jnp.asarray(ids),
                             jnp.asarray(mask), pooling=retriever.model.pooling,
                             normalize=retriever.normalize))
        s = np.einsum("bd,bmd->bm", q, batch["doc_emb"])
        top = top_k_in_pool(s, batch["doc_valid"], 2)
        pick = lambda a: np.take_along_axis(a, top, axis=1)  # noqa: E731
        return float(lsr_loss(pick(s), pick(batch["lm_scores"]), 0.1, 0.1,
                              pick(batch["doc_valid"]))), top

    state = init_state(params, tx)
    want, top0 = by_hand(state.params)
    state, metrics = step(state, batch)
    assert float(metrics["loss"]) == pytest.approx(want, rel=1e-5)
    want1, _ = by_hand(state.params)
    _, metrics1 = step(state, batch)
    assert float(metrics1["loss"]) == pytest.approx(want1, rel=1e-5)


def test_oracle_and_shuffled_q_diagnostics(tiny, tmp_path):
    """The oracle picks each pool's k best candidates by the LM's own summed score (never worse
    than the base's pick on log-likelihood at uniform-ish λ) and weights them by the base λ;
    the shuffled-Q control keeps each example's values, permuted among its valid candidates."""
    from replug_jax.train.pool import oracle_logliks, shuffled_q

    pool, _ = _pool(tiny, tmp_path / "pool")
    c = pool.branches
    sums = pool.lm_scores("sum")
    got = oracle_logliks(pool, 1)
    for e in range(len(pool)):  # k = 1: the oracle's branch is the LM's best candidate
        best = np.argmax(np.where(c.doc_mask_NK[e], sums[e], -np.inf))
        assert got[e] == pytest.approx(sums[e, best], abs=1e-4)
    base = pool_logliks(pool, c.scores_NK, 1)
    assert np.all(got >= base - 1e-5)
    lm = pool.lm_scores("mean")
    sh = shuffled_q(lm, c.doc_mask_NK, seed=0)
    for e in range(len(pool)):
        v = c.doc_mask_NK[e]
        assert sorted(sh[e, v]) == pytest.approx(sorted(lm[e, v]))
    assert not np.allclose(sh, lm)


def test_a_saved_run_is_reused_when_trained_alike_whatever_json_made_of_it():
    """A variant read back from its JSON (tuples become lists) counts as trained alike; any
    setting that changes the trajectory or the budget does not, nor a run of the retired
    pool trainer's config (its fields are not the trainer's)."""
    import json

    from experiments.lib.lsr_common import trained_with
    from replug_jax.train.config import LSRConfig

    v = LSRConfig.from_tree({
        "supervision": {"kind": "pool", "train_pool": "p", "dev_pool": "d", "towers": "query"},
        "objective": {"gamma": "fitted", "beta": 1.0}, "selection.metric": "recall@1"})
    stored = json.loads(json.dumps(v.to_json()))
    assert trained_with(stored, v) and trained_with(v.flat(), v)  # the tree, or a flat record
    assert trained_with(stored, v.updated({"checkpoint_every": 7}))
    assert not trained_with(stored, v.updated({"selection.metric": "pool_loglik"}))
    assert not trained_with(stored, v.updated({"total_steps": 9}))
    assert not trained_with({**stored, "objective": {**stored["objective"], "gamma": 0.1}}, v)
    assert not trained_with({"objective": "kl_retriever_to_lm", "steps": 3}, v)
    assert not trained_with(None, v)
    # a run saved before the study's config named the lengths and windows it ran at: its
    # record's defaults are read as the study's; a run that names them must match
    ran = v.updated({"retriever.doc_max_length": 512, "lm.max_context": 512,
                     "data.context_tokens": 64})
    assert trained_with(stored, ran, models_in_config=False)
    assert not trained_with(stored, ran)
    assert not trained_with(stored, ran.updated({"k": 3}), models_in_config=False)
