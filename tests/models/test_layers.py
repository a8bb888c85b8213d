"""The shared layers against independent references: blocked attention (its forward, its own
backward and its blocking) against the textbook softmax formula and JAX autodiff of it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from replug_jax.models import layers


def _reference(q, k, v, mask):
    logits = jnp.einsum("bhmd,bhsd->bhms", q, k) / np.sqrt(q.shape[-1])
    return jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1) @ v


def _inputs(b, h, m, s, d, mask_kind, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, w = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
                  for shape in ((b, h, m, d), (b, h, s, d), (b, h, s, d), (b, h, m, d)))
    if mask_kind == "keys":  # padding: [B, 1, 1, S], one sequence with no visible key
        mask = rng.random((b, 1, 1, s)) > 0.4
        mask[0] = False
    else:  # a causal mask per sequence with padding: [B, 1, M, S], some empty rows
        mask = np.tril(np.ones((m, s), bool))[None, None] & (rng.random((b, 1, 1, s)) > 0.3)
    return q, k, v, w, jnp.asarray(mask)


@pytest.mark.parametrize("mask_kind", ["keys", "rows"])
@pytest.mark.parametrize("rows", [1, 2, 6])
def test_blocked_attention_equals_softmax_formula_and_its_autodiff(monkeypatch, mask_kind, rows):
    b, h, m, s = 6, 3, 10, 10
    q, k, v, w, mask = _inputs(b, h, m, s, 8, mask_kind)
    monkeypatch.setattr(layers, "_CPU_BLOCK_BYTES", rows * h * m * s * 4)

    def ours(q, k, v):
        return layers.attention(q, k, v, mask)

    def ref(q, k, v):
        return _reference(q, k, v, mask)

    np.testing.assert_allclose(np.asarray(ours(q, k, v)), np.asarray(ref(q, k, v)), atol=2e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(ours)(q, k, v)), np.asarray(ours(q, k, v)),
                               atol=1e-6)
    grads = jax.grad(lambda *a: jnp.sum(ours(*a) * w), argnums=(0, 1, 2))(q, k, v)
    expected = jax.grad(lambda *a: jnp.sum(ref(*a) * w), argnums=(0, 1, 2))(q, k, v)
    for g, e in zip(grads, expected):
        assert float(jnp.abs(e).max()) > 0
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=2e-6)


def test_attention_rows_without_keys_are_uniform_and_pass_no_gradient_to_q_k():
    q, k, v, w, mask = _inputs(2, 2, 4, 4, 8, "keys")
    out = layers.attention(q, k, v, mask)
    np.testing.assert_allclose(np.asarray(out[0]),
                               np.broadcast_to(np.asarray(v[0]).mean(-2, keepdims=True),
                                               out[0].shape), atol=1e-6)
    dq, dk, dv = jax.grad(lambda *a: jnp.sum(layers.attention(*a, mask) * w),
                          argnums=(0, 1, 2))(q, k, v)
    assert not np.any(np.asarray(dq[0])) and not np.any(np.asarray(dk[0]))
    assert np.all(np.isfinite(np.asarray(dv))) and np.any(np.asarray(dv[0]))
