"""Scored branches read back without the LM (replug_jax/branches.py): the mixture of each
example's first k branches at any τ is the hand-computed §3.2 mixture, does not depend on the
branches' order, and results without retrieval scores (the LM alone, random documents, a
concatenation) are kept with λ uniform only when asked."""

import types

import numpy as np
import pytest

from replug_jax.branches import ScoredBranches, first, mixture_logliks


def _branches(rng, n=5, k=4, t=6) -> ScoredBranches:
    lp = np.log(rng.dirichlet(np.ones(8), size=(n, k, t))[..., 0]).astype(np.float32)
    length = rng.integers(2, t + 1, size=n)
    mask = np.arange(t)[None, :] < length[:, None]
    lp = np.where(mask[:, None, :], lp, 0.0).astype(np.float32)  # padding holds zeros
    return ScoredBranches(lp, rng.uniform(0.2, 0.8, size=(n, k)).astype(np.float32),
                          np.ones((n, k), bool), mask, np.full(n, 40), tuple("abcde"[:n]))


def _by_hand(lp_KT, scores_K, tau):
    w = np.exp(np.asarray(scores_K, np.float64) / tau)
    w /= w.sum()
    return float(np.log((w[:, None] * np.exp(lp_KT.astype(np.float64))).sum(0)).sum())


def test_the_first_k_branches_mix_as_by_hand():
    b = _branches(np.random.default_rng(0))
    for k, tau in ((4, 1.0), (2, 1.0), (3, 0.05), (1, 0.3)):
        got = mixture_logliks(first(b, k), tau)
        for i in range(5):
            t = b.token_mask_NT[i].sum()
            want = _by_hand(b.logprobs_NKT[i, :k, :t], b.scores_NK[i, :k], tau)
            assert got[i] == pytest.approx(want, abs=1e-5)
    # k = 1 is the first branch alone whatever τ; the order of the branches does not matter
    np.testing.assert_allclose(mixture_logliks(first(b, 1), 0.01),
                               b.logprobs_NKT[:, 0].sum(-1), rtol=1e-6)
    perm = np.random.default_rng(1).permutation(4)
    shuffled = ScoredBranches(b.logprobs_NKT[:, perm], b.scores_NK[:, perm], b.doc_mask_NK,
                              b.token_mask_NT, b.bytes_N, b.ids)
    np.testing.assert_allclose(mixture_logliks(shuffled, 0.1), mixture_logliks(b, 0.1),
                               rtol=1e-6)


def _result(lp_KT, scores, mode):
    return types.SimpleNamespace(branch_logprobs=lp_KT, doc_scores=scores, num_bytes=9,
                                 settings={"mode": mode})


def test_results_without_scores_are_uniform_only_when_asked():
    rng = np.random.default_rng(2)
    lp = np.log(rng.uniform(0.1, 0.9, size=(3, 4))).astype(np.float32)
    random = _result(lp, np.full(3, np.nan), "random")
    alone = _result(lp[:1, :2], None, "none")  # one branch, a shorter target
    concat = _result(lp[:1], np.array([0.3, 0.2, 0.1]), "concat")  # k scores, one branch
    for r in (random, alone, concat):
        with pytest.raises(ValueError, match="no retrieval scores"):
            ScoredBranches.from_results([r])
    b = ScoredBranches.from_results([random, alone, concat], unscored="uniform")
    assert b.logprobs_NKT.shape == (3, 3, 4) and b.doc_mask_NK.sum(1).tolist() == [3, 1, 1]
    want = [_by_hand(lp, np.zeros(3), 1.0), lp[0, :2].sum(), lp[0].sum()]
    np.testing.assert_allclose(mixture_logliks(b, 0.05), want, rtol=1e-5)
