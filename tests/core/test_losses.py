"""Golden values and properties of replug_jax.core.losses (paper §4)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from replug_jax.core import losses as L

SETTINGS = settings(max_examples=25, deadline=None)
_pairs = st.tuples(st.integers(1, 4), st.integers(2, 8)).flatmap(
    lambda s: st.tuples(arrays(np.float32, s, elements=st.floats(-1, 1, width=32)),
                        arrays(np.float32, s, elements=st.floats(-5, 0, width=32))))


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_golden_kl_hand_computed():
    s = np.array([[0.3, 0.1, -0.2]], np.float64)
    lm = np.array([[-1.0, -0.5, -2.0]], np.float64)
    p, q = _softmax(s / 0.1), _softmax(lm / 0.1)
    kl_pq = float((p * np.log(p / q)).sum())
    kl_qp = float((q * np.log(q / p)).sum())
    np.testing.assert_allclose(L.lsr_loss(s, lm), kl_pq, rtol=1e-5)
    np.testing.assert_allclose(L.lsr_loss(s, lm, direction="lm_to_retriever"), kl_qp, rtol=1e-5)
    np.testing.assert_allclose(L.lsr_loss(s, lm, gamma=1.0, beta=0.5),
                               (_softmax(s) * np.log(_softmax(s) / _softmax(lm / 0.5))).sum(),
                               rtol=1e-5)


def test_reduction_over_queries():
    s = np.array([[0.3, 0.1], [0.0, 0.2]], np.float32)
    lm = np.array([[-1.0, -0.5], [-0.1, -3.0]], np.float32)
    per = [float(L.lsr_loss(s[i:i + 1], lm[i:i + 1])) for i in range(2)]
    np.testing.assert_allclose(L.lsr_loss(s, lm), np.mean(per), rtol=1e-6)
    np.testing.assert_allclose(L.lsr_loss(s, lm, reduction="sum"), np.sum(per), rtol=1e-6)


def test_token_level_lm_scores_mean_and_sum():
    s = np.array([[0.3, 0.1]], np.float32)
    tok = np.array([[[-1.0, -3.0, -9.0], [-2.0, -2.0, -9.0]]], np.float32)  # [B,K,T]
    tmask = np.array([[[1, 1, 0], [1, 1, 0]]], bool)
    mean_scores = np.array([[-2.0, -2.0]], np.float32)
    sum_scores = np.array([[-4.0, -4.0]], np.float32)
    np.testing.assert_allclose(L.lsr_loss(s, tok, lm_token_mask=tmask),
                               L.lsr_loss(s, mean_scores), rtol=1e-6)
    np.testing.assert_allclose(
        L.lsr_loss(s, tok, lm_token_mask=tmask, lm_score_reduction="sum"),
        L.lsr_loss(s, sum_scores), rtol=1e-6)
    # The raw probability of a long continuation underflows: the paper's literal formula
    # would make Q uniform; log-likelihood scores keep the signal.
    assert math.exp(128 * -3.0) < 1e-160


@SETTINGS
@given(_pairs, st.sampled_from(L.DIRECTIONS))
def test_loss_nonnegative_and_zero_when_equal(pair, direction):
    s, lm = pair
    assert float(L.lsr_loss(s, lm, direction=direction)) >= -1e-6
    # P_R = Q when s/γ = lm/β.
    assert abs(float(L.lsr_loss(s, s, gamma=0.1, beta=0.1, direction=direction))) < 1e-5
    assert abs(float(L.lsr_loss(s, 2 * s, gamma=0.1, beta=0.2, direction=direction))) < 1e-5


@SETTINGS
@given(_pairs, st.sampled_from(L.DIRECTIONS))
def test_gradient_finite_and_nonzero_unless_matched(pair, direction):
    s, lm = pair
    g = jax.grad(lambda x: L.lsr_loss(x, lm, direction=direction))(jnp.asarray(s))
    assert np.isfinite(g).all()
    p_r = _softmax(s.astype(np.float64) / 0.1)
    q = _softmax(lm.astype(np.float64) / 0.1)
    if np.abs(p_r - q).max() > 1e-3:
        assert np.abs(g).max() > 0
    # Nothing reaches the LM scores.
    g_lm = jax.grad(lambda y: L.lsr_loss(s, y))(jnp.asarray(lm))
    assert np.all(g_lm == 0)


@SETTINGS
@given(_pairs, st.data())
def test_mask_equals_removing(pair, data):
    s, lm = pair
    k = s.shape[1]
    drop = data.draw(st.integers(0, k - 1))
    keep = [i for i in range(k) if i != drop]
    mask = np.ones_like(s, bool)
    mask[:, drop] = False
    lm_bad = lm.copy()
    lm_bad[:, drop] = np.nan
    for direction in L.DIRECTIONS:
        np.testing.assert_allclose(
            L.lsr_loss(s, lm_bad, mask=mask, direction=direction),
            L.lsr_loss(s[:, keep], lm[:, keep], direction=direction), atol=1e-5)
    np.testing.assert_allclose(L.marginal_nll_loss(s, lm_bad, mask=mask),
                               L.marginal_nll_loss(s[:, keep], lm[:, keep]), atol=1e-5)
    g = jax.grad(lambda x: L.lsr_loss(x, lm_bad, mask=mask))(jnp.asarray(s))
    assert np.isfinite(g).all() and np.all(g[:, drop] == 0)


def test_marginal_nll_golden():
    s = np.array([[0.2, 0.0]], np.float64)
    ll = np.array([[-3.0, -1.0]], np.float64)
    p = _softmax(s / 0.1)
    expected = -np.log((p * np.exp(ll)).sum())
    np.testing.assert_allclose(L.marginal_nll_loss(s, ll), expected, rtol=1e-5)
    g = jax.grad(lambda x: L.marginal_nll_loss(x, ll))(jnp.asarray(s, jnp.float32))
    # The document with the higher likelihood gains weight.
    assert g[0, 1] < 0 < g[0, 0]


def test_k64_extreme_scores_stable():
    rng = np.random.default_rng(0)
    s = rng.uniform(-1, 1, (8, 64)).astype(np.float32)
    lm = rng.uniform(-1e4, -1e4 + 50, (8, 64)).astype(np.float32)
    for direction in L.DIRECTIONS:
        val, g = jax.value_and_grad(lambda x: L.lsr_loss(x, lm, direction=direction))(s)
        assert np.isfinite(val) and val >= 0 and np.isfinite(g).all()
    val = L.marginal_nll_loss(s, lm)
    assert np.isfinite(val) and val > 9e3


def test_jit_vmap_equal_eager():
    rng = np.random.default_rng(1)
    s = rng.normal(size=(2, 3, 5)).astype(np.float32)
    lm = rng.normal(size=(2, 3, 5)).astype(np.float32)
    mask = rng.uniform(size=(2, 3, 5)) > 0.3
    mask[..., 0] = True
    eager = L.lsr_loss(s, lm, mask=mask)
    np.testing.assert_allclose(jax.jit(L.lsr_loss)(s, lm, mask=mask), eager, rtol=1e-6)
    per_group = jax.vmap(lambda a, b, m: L.lsr_loss(a, b, mask=m))(s, lm, mask)
    np.testing.assert_allclose(per_group.mean(), eager, rtol=1e-6)


def test_bad_input():
    with pytest.raises(ValueError, match="same"):
        L.lsr_loss(np.zeros((2, 3)), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="direction"):
        L.lsr_loss(np.zeros((2, 3)), np.zeros((2, 3)), direction="sideways")
    with pytest.raises(ValueError, match="reduction"):
        L.lsr_loss(np.zeros((2, 3)), np.zeros((2, 3)), reduction="max")
    with pytest.raises(ValueError, match="non-finite"):
        L.lsr_loss(np.zeros((1, 2)), np.array([[0.0, -np.inf]]))
    with pytest.raises(ValueError, match="every document is masked"):
        L.lsr_loss(np.zeros((1, 2)), np.zeros((1, 2)), mask=np.zeros((1, 2), bool))
    nan = jax.jit(L.lsr_loss)(np.zeros((1, 2)), np.zeros((1, 2)), mask=np.zeros((1, 2), bool))
    assert np.isnan(nan)
