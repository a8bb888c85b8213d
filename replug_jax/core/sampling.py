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
    temperature = jnp.asarray(temperature, jnp.float32)
    top_p = jnp.asarray(top_p, jnp.float32)

    def greedy(_):
        return jnp.argmax(logp, axis=-1).astype(jnp.int32)

    def nucleus(scaled):
        order = jnp.argsort(-scaled, axis=-1)
        sorted_lp = jnp.take_along_axis(scaled, order, axis=-1)
        cum = jnp.cumsum(jnp.exp(sorted_lp), axis=-1)
        # Keep a token if the mass strictly before it is below top_p (the first is kept).
        keep_sorted = (cum - jnp.exp(sorted_lp)) < top_p
        keep = jnp.zeros_like(keep_sorted).at[
            jnp.arange(logp.shape[0])[:, None], order].set(keep_sorted)
        return jnp.where(keep, scaled, -jnp.inf)

    def sample(_):
        scaled = jax.nn.log_softmax(logp / jnp.maximum(temperature, 1e-6), axis=-1)
        # the sort over the vocabulary is paid only when nucleus sampling asks for it
        allowed = jax.lax.cond(top_p < 1.0, nucleus, lambda x: x, scaled)
        return jax.random.categorical(rng, allowed, axis=-1).astype(jnp.int32)

    # Only the chosen path runs (greedy decoding skips the sampling work entirely).
    return jax.lax.cond(temperature > 0, sample, greedy, None)
