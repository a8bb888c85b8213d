"""The retrieval temperature from cached branches, its fit, and paired bootstrap intervals."""

import json
import math

import numpy as np
import pytest

from replug_jax.eval.stats import bpb_difference, format_interval, paired_bootstrap
from replug_jax.branches import ScoredBranches, mixture_logliks
from replug_jax.eval.temperature import cross_fit_logliks, fit_tau, fit_temperature
from replug_jax.replug import Replug
from replug_jax.retrieval.corpus import Passage
from replug_jax.retrieval import index_in_memory
from tests._models import tiny_lm, tiny_retriever

PASSAGES = [Passage(i, f"Passage {i} is about topic number {i} and the river {i % 3}.")
            for i in range(8)]
CONTEXTS = ["Which river is it?", "Tell me about topic 4.", "The river 2 flows", "Topic 6"]
TARGETS = [" It is the river 1.", " Topic 4 is known.", " to the sea.", " is about a river."]


def _pipe(**kw):
    retriever = tiny_retriever(0)
    return Replug(tiny_lm(0), retriever, index_in_memory(PASSAGES, retriever), k=3, **kw)


def test_sweep_from_cached_branches_equals_direct_scoring(tmp_path):
    """One LM pass at τ = 1 serves every weighting: each equals scoring anew at that τ."""
    base = _pipe(retrieval_temperature=1.0)
    cache = ScoredBranches.from_results(base.score(CONTEXTS, TARGETS, reliance=False))
    cache.save(tmp_path / "c.npz")
    cache = ScoredBranches.load(tmp_path / "c.npz")
    for tau in (1.0, 0.3, 0.1, 0.05, 0.02):
        direct = [r.loglik for r in _pipe(retrieval_temperature=tau).score(CONTEXTS, TARGETS,
                                                                 reliance=False)]
        np.testing.assert_allclose(mixture_logliks(cache, tau), direct, atol=1e-5, rtol=0)
    top1 = [r.loglik for r in base.score(CONTEXTS, TARGETS, mode="top1", reliance=False)]
    np.testing.assert_allclose(mixture_logliks(cache, "top1"), top1, atol=1e-5, rtol=0)
    # uniform weights, by hand: log mean_k p_k per token
    lp = cache.logprobs_NKT.astype(np.float64)
    hand = [np.sum(np.log(np.mean(np.exp(lp[i, :, :m.sum()]), axis=0)))
            for i, m in enumerate(cache.token_mask_NT)]
    np.testing.assert_allclose(mixture_logliks(cache, "uniform"), hand, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="a weighting is a temperature"):
        mixture_logliks(cache, "softmax")
    (tmp_path / "bad.npz").write_bytes(b"not an npz")
    with pytest.raises(ValueError, match="not a readable file of scored branches"):
        ScoredBranches.load(tmp_path / "bad.npz")


def _two_branch_cache(n_first: int, n_second: int, gap: float = 0.5) -> ScoredBranches:
    """Examples answered only by document 0 (n_first) or only by document 1 (n_second), with
    scores (gap, 0): the log-likelihood is n_first·log λ + n_second·log(1 − λ), maximal at
    λ = sigmoid(gap / τ) = n_first / n, i.e. τ* = gap / logit(n_first / n)."""
    n = n_first + n_second
    lp = np.full((n, 2, 1), -60.0, np.float32)
    lp[:n_first, 0, 0] = 0.0
    lp[n_first:, 1, 0] = 0.0
    return ScoredBranches(lp, np.tile(np.array([gap, 0.0], np.float32), (n, 1)),
                          np.ones((n, 2), bool), np.ones((n, 1), bool), np.ones(n, np.int64),
                          tuple(map(str, range(n))))


def test_fitted_temperature_finds_a_known_optimum():
    fit = fit_temperature(_two_branch_cache(8, 2))
    assert fit["temperature"] == pytest.approx(0.5 / math.log(4.0), rel=1e-3)
    assert not fit["at_bound"]
    assert fit["loglik"] == pytest.approx(8 * math.log(0.8) + 2 * math.log(0.2), abs=1e-4)
    # an optimum beyond the bounds is reported as such: every example wants document 0
    assert fit_temperature(_two_branch_cache(10, 0))["at_bound"]
    held, taus = cross_fit_logliks(_two_branch_cache(40, 10), folds=2)
    assert held.shape == (50,) and len(taus) == 2 and all(0.1 < t < 1.0 for t in taus)


def test_one_fitter_over_a_grid_or_a_bounded_search():
    """fit_tau takes any log-likelihood of τ: over a grid the best value (the first on a
    tie, an end of the grid flagged), without one the continuous optimum, which the grid's
    best brackets; a grid of no or non-positive values is refused."""
    cache = _two_branch_cache(8, 2)
    optimum = 0.5 / math.log(4.0)  # 0.36
    loglik = lambda t: float(mixture_logliks(cache, t).sum())  # noqa: E731
    grid = (0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
    fit = fit_tau(loglik, grid=grid)
    assert fit["temperature"] == max(grid, key=loglik) == 0.3 and not fit["at_bound"]
    assert fit["loglik"] == loglik(0.3) and fit["grid"] == list(grid)
    assert fit_tau(loglik, grid=(0.05, 0.1))["at_bound"]  # the optimum lies above
    assert fit_tau(lambda t: 0.0, grid=(0.2, 0.1, 0.3))["temperature"] == 0.2  # first of a tie
    assert fit_tau(loglik)["temperature"] == pytest.approx(optimum, rel=1e-3)
    for bad in ((), (0.1, 0.0)):
        with pytest.raises(ValueError, match="positive values"):
            fit_tau(loglik, grid=bad)


def test_paired_bootstrap_on_hand_made_examples():
    # differences 0, 1, 2: of the 27 equally likely resamples, 1 has mean 0 and 1 has mean 2
    # (3.7 % each, more than 2.5 %), so the 95 % percentile interval is exactly [0, 2]
    d = paired_bootstrap([1.0, 2.0, 3.0], [1.0, 1.0, 1.0], resamples=20_000)
    assert (d["difference"], d["low"], d["high"]) == (1.0, 0.0, 2.0)
    # a ratio of sums: a = (2, 4), w = (1, 3): resamples give 2 (1/4), 8/6 (1/4), 1.5 (1/2)
    r = paired_bootstrap([2.0, 4.0], [0.0, 0.0], [1.0, 3.0], resamples=20_000)
    assert r["difference"] == 1.5
    assert (r["low"], r["high"]) == pytest.approx((8 / 6, 2.0))
    # a constant difference has no spread
    c = paired_bootstrap(np.arange(5.0) + 0.25, np.arange(5.0))
    assert (c["low"], c["high"]) == (0.25, 0.25)
    # bits per byte: a higher log-likelihood is fewer bits
    b = bpb_difference([-10.0, -12.0, -9.0], [-11.0, -13.0, -10.0], [10, 10, 10])
    assert b["difference"] == pytest.approx(-1.0 / (10 * math.log(2)))
    assert format_interval(d) == "+1.000 [+0.000, +2.000]"
    with pytest.raises(ValueError, match="at least 2 items"):
        paired_bootstrap([1.0], [0.0])
    with pytest.raises(ValueError, match="non-finite"):
        paired_bootstrap([1.0, float("-inf")], [0.0, 0.0])


def test_cluster_bootstrap_resamples_whole_articles():
    """Items of one cluster move together: two articles with per-item differences (0, 0) and
    (3, 3, 3, 3) are two cluster totals, (0 over 2 items) and (12 over 4): the resamples give
    0 (1/4), 12/6 = 2 (1/2) and 3 (1/4), so the 95 % interval is [0, 3] — where an item
    bootstrap of the same six values is far narrower."""
    a = np.array([0.0, 0.0, 3.0, 3.0, 3.0, 3.0])
    b = np.zeros(6)
    art = ["x", "x", "y", "y", "y", "y"]
    c = paired_bootstrap(a, b, clusters=art, resamples=20_000)
    assert c["difference"] == 2.0 and (c["low"], c["high"]) == (0.0, 3.0)
    assert c["items"] == 6 and c["clusters"] == 2
    i = paired_bootstrap(a, b, resamples=20_000)
    assert i["high"] - i["low"] < c["high"] - c["low"]
    with pytest.raises(ValueError, match="at least 2 clusters"):
        paired_bootstrap(a, b, clusters=["x"] * 6)


def test_a_fitted_temperature_travels_with_the_retriever(tmp_path):
    from replug_jax.models import export_retriever
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.train.export import record_temperature

    folder = export_retriever(tiny_retriever(0).model, tmp_path / "r", {
        "replug.json": json.dumps({"similarity": "cosine", "query_max_length": 16,
                                   "doc_max_length": 32}),
        "README.md": "# R\n\n## Dev metrics\n\nsome\n"})
    assert Retriever.load(str(folder)).retrieval_temperature is None
    record_temperature(folder, 0.07, {"dev": "x"}, "τ = 0.07 (first)")
    record_temperature(folder, 0.05, {"dev": "x"}, "τ = 0.05 fitted on dev")
    card = (folder / "README.md").read_text()
    assert card.count("## Inference temperature") == 1 and "0.05 fitted" in card
    assert "0.07" not in card and "## Dev metrics" in card
    retriever = Retriever.load(str(folder))
    assert retriever.retrieval_temperature == 0.05
    index = index_in_memory(PASSAGES, retriever)
    pipe = Replug(tiny_lm(0), retriever, index, k=3)
    assert (pipe.retrieval_temperature,
            pipe.settings("replug", 3)["retrieval_temperature_source"]) == (
                0.05, "the retriever's replug.json")
    assert Replug(tiny_lm(0), retriever, index,
                  retrieval_temperature=1.0).retrieval_temperature == 1.0
    with pytest.raises(TypeError, match="temperature"):  # one word, one meaning: τ is named
        Replug(tiny_lm(0), retriever, index, temperature=0.5)
    with pytest.raises(ValueError, match="must be > 0"):
        record_temperature(folder, 0.0, {}, "")


def test_cross_fitting_over_groups_keeps_each_group_in_one_fold():
    """Articles cross-fitted (Table 1): each group's examples are scored at the τ fitted on
    the other groups; a sharp τ wins where the best-scored document is far the best."""
    rng = np.random.default_rng(2)
    n, k = 12, 3
    lp = np.log(rng.uniform(0.01, 0.2, size=(n, k, 4))).astype(np.float32)
    lp[:, 0] = -0.1  # branch 0 is far better in every example, and scored highest
    scores = rng.uniform(0.2, 0.5, size=(n, k)).astype(np.float32)
    scores[:, 0] = 0.9
    cache = ScoredBranches(lp, scores, np.ones((n, k), bool), np.ones((n, 4), bool),
                           np.ones(n, np.int64), tuple(map(str, range(n))))
    groups = np.repeat(np.arange(6), 2)
    ll, taus = cross_fit_logliks(cache, 3, seed=0, grid=(0.01, 1.0, 10.0), groups=groups)
    assert taus == [0.01] * 3
    np.testing.assert_allclose(ll, mixture_logliks(cache, 0.01), rtol=1e-6)
    with pytest.raises(ValueError, match="6 groups cannot make 7 folds"):
        cross_fit_logliks(cache, 7, grid=(1.0,), groups=groups)

