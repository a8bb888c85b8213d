"""Golden values and properties of replug_jax.core.ensemble (paper §3.2)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from replug_jax.core import ensemble as E

SETTINGS = settings(max_examples=25, deadline=None)


def _scores(k_min=1, k_max=8, b_max=4):
    shape = st.tuples(st.integers(1, b_max), st.integers(k_min, k_max))
    return shape.flatmap(lambda s: arrays(np.float32, s, elements=st.floats(-5, 5, width=32)))


def _log_dists(shape, seed):
    rng = np.random.default_rng(seed)
    return np.array(jax.nn.log_softmax(rng.normal(size=shape) * 3, axis=-1), np.float32)


def test_golden_blog_example():
    # Weights 0.7 / 0.3, token probabilities 0.1 / 0.9: 0.7*0.1 + 0.3*0.9 = 0.34.
    log_w = jnp.log(jnp.array([0.7, 0.3]))
    branch = jnp.log(jnp.array([[0.1], [0.9]]))  # [K, T=1]
    out = E.mixture_logprobs(branch, log_w)
    np.testing.assert_allclose(np.exp(out), [0.34], rtol=1e-6)
    resp = E.doc_responsibility(branch, log_w)
    np.testing.assert_allclose(resp[:, 0], [0.07 / 0.34, 0.27 / 0.34], rtol=1e-6)


def test_golden_weights_hand_computed():
    scores = np.array([[0.9, 0.5, 0.1]], np.float32)
    expected = np.exp(scores / 0.1) / np.exp(scores / 0.1).sum()
    got = np.exp(E.retrieval_log_weights(scores, temperature=0.1))
    np.testing.assert_allclose(got, expected, rtol=1e-5)


def test_golden_full_distribution():
    # Two branches over a vocabulary of 3, mixed by hand in NumPy.
    p = np.array([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])
    w = np.array([0.25, 0.75])
    got = np.exp(E.mixture_logprobs(np.log(p)[None], np.log(w)[None]))[0]
    np.testing.assert_allclose(got, w @ p, rtol=1e-6)
    np.testing.assert_allclose(got.sum(), 1.0, rtol=1e-6)


@SETTINGS
@given(_scores(), st.floats(0.05, 5.0))
def test_weights_sum_to_one(scores, tau):
    w = np.exp(E.retrieval_log_weights(scores, temperature=tau))
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
    assert (w >= 0).all()


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_k1_returns_the_branch(b, v, seed):
    branch = _log_dists((b, 1, v), seed)
    log_w = E.retrieval_log_weights(np.zeros((b, 1), np.float32))
    np.testing.assert_allclose(E.mixture_logprobs(branch, log_w), branch[:, 0], atol=1e-6)


@SETTINGS
@given(_scores(), st.integers(0, 2**31 - 1))
def test_identical_branches_return_the_branch(scores, seed):
    b, k = scores.shape
    one = _log_dists((b, 1, 5), seed)
    branch = np.repeat(one, k, axis=1)
    out = E.mixture_logprobs(branch, E.retrieval_log_weights(scores))
    np.testing.assert_allclose(out, one[:, 0], atol=1e-5)


@SETTINGS
@given(_scores(k_min=2), st.integers(0, 2**31 - 1))
def test_permuting_documents_changes_nothing(scores, seed):
    b, k = scores.shape
    branch = _log_dists((b, k, 7), seed)
    perm = np.random.default_rng(seed).permutation(k)
    out = E.mixture_logprobs(branch, E.retrieval_log_weights(scores))
    out_perm = E.mixture_logprobs(branch[:, perm], E.retrieval_log_weights(scores[:, perm]))
    np.testing.assert_allclose(out, out_perm, atol=1e-5)
    resp = E.doc_responsibility(branch, E.retrieval_log_weights(scores))
    resp_perm = E.doc_responsibility(branch[:, perm], E.retrieval_log_weights(scores[:, perm]))
    np.testing.assert_allclose(resp[:, perm], resp_perm, atol=1e-5)


@SETTINGS
@given(_scores(k_min=2), st.integers(0, 2**31 - 1), st.data())
def test_masking_equals_removing(scores, seed, data):
    b, k = scores.shape
    drop = data.draw(st.integers(0, k - 1))
    branch = _log_dists((b, k, 4), seed)
    branch[:, drop] = np.nan  # a padded document may hold garbage; it must not leak
    mask = np.ones((b, k), bool)
    mask[:, drop] = False
    keep = [i for i in range(k) if i != drop]
    lw_masked = E.retrieval_log_weights(scores, mask=mask)
    assert np.all(np.exp(lw_masked[:, drop]) == 0.0)
    out = E.mixture_logprobs(branch, lw_masked)
    ref = E.mixture_logprobs(branch[:, keep], E.retrieval_log_weights(scores[:, keep]))
    np.testing.assert_allclose(out, ref, atol=1e-5)
    resp = E.doc_responsibility(branch, lw_masked)
    np.testing.assert_allclose(resp[:, keep], E.doc_responsibility(
        branch[:, keep], E.retrieval_log_weights(scores[:, keep])), atol=1e-5)
    assert np.all(resp[:, drop] == 0.0)


@SETTINGS
@given(_scores(), st.integers(0, 2**31 - 1))
def test_responsibility_sums_to_one(scores, seed):
    b, k = scores.shape
    branch = _log_dists((b, k, 6), seed)
    resp = E.doc_responsibility(branch, E.retrieval_log_weights(scores))
    np.testing.assert_allclose(resp.sum(1), 1.0, atol=1e-5)


def test_jit_equals_eager_and_vmaps():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(3, 4)).astype(np.float32)
    mask = np.array([[1, 1, 0, 1]] * 3, bool)
    branch = _log_dists((3, 4, 9), 1)

    def f(s, m, br):
        lw = E.retrieval_log_weights(s, 0.5, m)
        return E.mixture_logprobs(br, lw), E.doc_responsibility(br, lw)

    eager = f(scores, mask, branch)
    jitted = jax.jit(f)(scores, mask, branch)
    vmapped = jax.vmap(f)(scores, mask, branch)
    for a, b_, c in zip(eager, jitted, vmapped):
        np.testing.assert_allclose(a, b_, atol=1e-6)
        np.testing.assert_allclose(a, c, atol=1e-6)
    # Extra leading batch axes work without vmap too.
    stacked = E.mixture_logprobs(np.stack([branch, branch]),
                                 E.retrieval_log_weights(np.stack([scores, scores]), 0.5,
                                                         np.stack([mask, mask])))
    np.testing.assert_allclose(stacked[1], eager[0], atol=1e-6)


def test_gradients_flow_to_scores():
    branch = _log_dists((2, 3, 5), 3)
    target = jnp.array([1, 4])

    def nll(scores):
        mix = E.mixture_logprobs(branch, E.retrieval_log_weights(scores))
        return -jnp.take_along_axis(mix, target[:, None], -1).sum()

    g = jax.grad(nll)(jnp.array([[0.1, 0.2, 0.3], [0.0, -1.0, 1.0]]))
    assert np.isfinite(g).all() and np.abs(g).sum() > 0
    # Gradient through a masked document is exactly zero and finite.
    mask = np.array([[1, 0, 1], [1, 1, 1]], bool)
    g = jax.grad(lambda s: E.mixture_logprobs(branch, E.retrieval_log_weights(s, mask=mask))
                 .sum())(jnp.zeros((2, 3)))
    assert np.isfinite(g).all() and g[0, 1] == 0.0


def test_numerical_stability_extreme_logprobs_and_k64():
    k = 64
    branch = np.full((1, k, 3), -1e4, np.float32)
    branch[0, 7] = [-1e4 + 1.0, -1e4 + 2.0, -1e4 + 3.0]
    lw = E.retrieval_log_weights(np.linspace(-1, 1, k, dtype=np.float32)[None])
    out = np.asarray(E.mixture_logprobs(branch, lw))
    w7 = float(np.exp(lw[0, 7]))
    # log(Σ_k w_k e^{a_k}) = -1e4 + log(Σ_{k≠7} w_k + w_7 e^{c}) computed in float64.
    expected = [-1e4 + math.log((1 - w7) + w7 * math.e ** c) for c in (1.0, 2.0, 3.0)]
    np.testing.assert_allclose(out[0], expected, rtol=0, atol=1e-2)
    assert np.isfinite(out).all()
    resp = E.doc_responsibility(branch, lw)
    np.testing.assert_allclose(np.asarray(resp).sum(1), 1.0, atol=1e-5)


def test_sequence_helpers_and_metrics():
    lp = np.array([[-1.0, -2.0, -np.inf], [-0.5, -0.5, -0.5]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]], bool)
    np.testing.assert_allclose(E.sequence_logprob(lp, mask), [-3.0, -1.5])
    np.testing.assert_allclose(E.sequence_score(lp, mask, "mean"), [-1.5, -0.5])
    np.testing.assert_allclose(E.sequence_score(lp, mask, "sum"), [-3.0, -1.5])
    # A paragraph of 4 tokens, 10 bytes, log-likelihood -8 nats.
    np.testing.assert_allclose(E.perplexity(-8.0, 4), math.exp(2.0), rtol=1e-6)
    np.testing.assert_allclose(E.bits_per_byte(-8.0, 10), 8.0 / (10 * math.log(2)), rtol=1e-6)
    with pytest.raises(ValueError, match="reduction"):
        E.sequence_score(lp, mask, "median")


def test_bad_input_shapes_raise_even_under_jit():
    with pytest.raises(ValueError, match="K mismatch"):
        E.mixture_logprobs(np.zeros((2, 3, 5)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="K mismatch"):
        jax.jit(E.doc_responsibility)(np.zeros((2, 3, 5)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="does not broadcast"):
        E.retrieval_log_weights(np.zeros((2, 3)), mask=np.ones((2, 4), bool))
    with pytest.raises(ValueError, match="temperature"):
        E.retrieval_log_weights(np.zeros((2, 3)), temperature=0.0)


def test_bad_values_raise_eagerly_and_propagate_nan_under_jit():
    with pytest.raises(ValueError, match="non-finite"):
        E.retrieval_log_weights(np.array([[0.1, np.nan]], np.float32))
    with pytest.raises(ValueError, match="every document is masked"):
        E.retrieval_log_weights(np.zeros((2, 3)), mask=np.array([[1, 1, 1], [0, 0, 0]], bool))
    # A non-finite score on a masked document is fine.
    lw = E.retrieval_log_weights(np.array([[0.1, np.inf]], np.float32),
                                 mask=np.array([[True, False]]))
    np.testing.assert_allclose(np.exp(lw), [[1.0, 0.0]])
    # Under jit the documented behaviour is NaN in the offending row only.
    lw = jax.jit(E.retrieval_log_weights)(np.zeros((2, 3)),
                                          mask=np.array([[1, 1, 1], [0, 0, 0]], bool))
    assert np.isfinite(lw[0]).all() and np.isnan(lw[1]).all()


def test_choose_token_greedy_nucleus_and_sampling():
    from replug_jax.core.sampling import choose_token

    logp = jnp.log(jnp.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]]))
    rng = jax.random.PRNGKey(0)
    np.testing.assert_array_equal(choose_token(logp, rng), [1, 0])  # greedy
    # a nucleus smaller than the top token keeps only the top token, even when sampling
    np.testing.assert_array_equal(choose_token(logp, rng, 1.0, 0.05), [1, 0])
    jitted = jax.jit(choose_token)
    keys = jax.random.split(jax.random.PRNGKey(1), 4000)
    draws = np.array([jitted(logp, k, 1.0, 1.0) for k in keys[:400]])
    assert set(np.unique(draws[:, 0])) <= {0, 1, 2} and len(np.unique(draws[:, 0])) == 3
    many = np.asarray(jax.vmap(lambda k: choose_token(logp, k, 1.0, 1.0))(keys))
    np.testing.assert_allclose(np.bincount(many[:, 0], minlength=3) / len(keys),
                               [0.1, 0.6, 0.3], atol=0.03)
    # top_p = 0.7 on row 0: {0.6, 0.3} are kept (the mass before 0.3 is 0.6 < 0.7), 0.1 never
    nuc = np.asarray(jax.vmap(lambda k: choose_token(logp, k, 1.0, 0.7))(keys))
    assert 0 not in nuc[:, 0]
    np.testing.assert_array_equal(jitted(logp, rng, 0.0, 1.0), [1, 0])  # jit equals eager


def test_top_n_mixture_bounds_contain_the_exact_mixture():
    """A small vocabulary: branches reveal only their top-n; the exact mixture (all of V)
    lies between the bounds for every token of the union, the lower bound is the mixture
    with missing tokens at probability 0 (hand-computed), and both equal the exact mixture
    where every branch returned the token."""
    from replug_jax.core.ensemble import top_n_mixture_bounds

    rng = np.random.default_rng(0)
    for n in (1, 2, 4, 8):
        logits_KV = rng.normal(size=(3, 8)) * 2
        lp_KV = logits_KV - np.log(np.exp(logits_KV).sum(1, keepdims=True))
        log_w_K = np.log(np.array([0.5, 0.3, 0.2]))
        top_KV = np.full_like(lp_KV, -np.inf)
        for k in range(3):
            keep = np.argsort(-lp_KV[k])[:n]
            top_KV[k, keep] = lp_KV[k, keep]
        union = np.isfinite(top_KV).any(0)
        lower, upper = (np.asarray(x) for x in top_n_mixture_bounds(top_KV[:, union],
                                                                     log_w_K))
        exact = np.log(np.exp(log_w_K[:, None] + lp_KV).sum(0))[union]
        by_hand = np.log((np.exp(log_w_K)[:, None] * np.exp(top_KV[:, union])).sum(0))
        np.testing.assert_allclose(lower, by_hand, rtol=1e-5)
        assert np.all(lower <= exact + 1e-5) and np.all(exact <= upper + 1e-5)
        everywhere = np.isfinite(top_KV[:, union]).all(0)
        np.testing.assert_allclose(upper[everywhere], exact[everywhere], rtol=1e-5)
        if n == 8:  # the whole vocabulary returned: exact
            np.testing.assert_allclose(lower, exact, rtol=1e-5)


@st.composite
def _peaked_cases(draw):
    """Random exact next-token distributions over a small vocabulary, some nearly one-hot
    (leftover masses far below float32's resolution near 1), and a token -> text map in which
    several tokens may share a text."""
    k, v = draw(st.integers(1, 4)), draw(st.integers(3, 12))
    spread = draw(st.sampled_from([1.0, 5.0, 20.0, 40.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    n = draw(st.integers(1, v))
    texts = draw(st.lists(st.integers(0, v - 1), min_size=v, max_size=v))
    return k, v, spread, seed, n, texts


@settings(max_examples=300, deadline=None)
@given(_peaked_cases())
def test_top_n_bounds_hold_by_brute_force_for_tokens_and_merged_texts(case):
    """Issue 37, item 11: the exact mixture (float64, whole vocabulary) lies between the
    bounds, by token and with tokens merged by text as the API client does (before: the
    float32 leftover rounded to 0 and the exact mixture passed the upper bound by 2-3 nats;
    the n-th-probability cap failed for merged texts)."""
    from replug_jax.core.ensemble import top_n_mixture_bounds

    k, v, spread, seed, n, texts = case
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(k, v)) * spread
    lp = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)  # float64
    log_w = np.log(rng.dirichlet(np.ones(k)))
    top = np.full_like(lp, -np.inf)
    for b in range(k):
        keep = np.argsort(-lp[b])[:n]
        top[b, keep] = lp[b, keep]
    union = np.flatnonzero(np.isfinite(top).any(0))
    exact = np.logaddexp.reduce(log_w[:, None] + lp, axis=0)
    lower, upper = (np.asarray(x, np.float64)
                    for x in top_n_mixture_bounds(top[:, union], log_w))
    tol = 1e-5 * np.maximum(1, np.abs(exact[union]))
    assert np.all(lower <= exact[union] + tol) and np.all(exact[union] <= upper + tol)
    # merged by text: a text's probability is the sum over its tokens
    names = sorted(set(texts))
    text_lp = np.stack([np.logaddexp.reduce(np.where(np.array(texts) == t, lp, -np.inf),
                                            axis=1) for t in names], axis=1)
    text_top = np.full_like(text_lp, -np.inf)
    for b in range(k):
        for j, t in enumerate(names):
            got = [top[b, u] for u in range(v) if texts[u] == t and np.isfinite(top[b, u])]
            if got:
                text_top[b, j] = np.logaddexp.reduce(got)
    seen = np.flatnonzero(np.isfinite(text_top).any(0))
    exact_t = np.logaddexp.reduce(log_w[:, None] + text_lp, axis=0)[seen]
    lower, upper = (np.asarray(x, np.float64) for x in top_n_mixture_bounds(
        text_top[:, seen], log_w, distinct=False))
    tol = 1e-5 * np.maximum(1, np.abs(exact_t))
    assert np.all(lower <= exact_t + tol) and np.all(exact_t <= upper + tol)
