"""Choosing the next token from a (mixture) distribution: greedy, temperature, nucleus."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def choose_token(logprobs_GV, rng, temperature: float = 0.0, top_p: float = 1.0):
    """One token per row of ``logprobs_GV``.

    ``temperature == 0`` is greedy (argmax). Otherwise sample from ``softmax(logp / T)``
    restricted to the smallest set of tokens whose probability reaches ``top_p`` (nucleus
    sampling; ``top_p = 1`` keeps every token). ``temperature`` and ``top_p`` may be traced.
    """
    logp = logprobs_GV.astype(jnp.float32)
    greedy = jnp.argmax(logp, axis=-1)
    t = jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
    scaled = jax.nn.log_softmax(logp / t, axis=-1)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_lp = jnp.take_along_axis(scaled, order, axis=-1)
    cum = jnp.cumsum(jnp.exp(sorted_lp), axis=-1)
    # Keep a token if the mass strictly before it is below top_p (the first is always kept).
    keep_sorted = (cum - jnp.exp(sorted_lp)) < top_p
    keep = jnp.zeros_like(keep_sorted).at[
        jnp.arange(logp.shape[0])[:, None], order].set(keep_sorted)
    sampled = jax.random.categorical(rng, jnp.where(keep, scaled, -jnp.inf), axis=-1)
    return jnp.where(jnp.asarray(temperature) > 0, sampled, greedy).astype(jnp.int32)
