"""Flax NNX modules as pure parameter trees, and back (what jit, optax and orbax see)."""

from __future__ import annotations

import jax
from flax import nnx


def split_params(module: nnx.Module):
    """``(graphdef, template, params)``: params as a plain nested dict of arrays (what optax
    and orbax see); ``template`` is the abstract state used to rebuild the module."""
    graphdef, state = nnx.split(module)
    template = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    return graphdef, template, nnx.to_pure_dict(state)


def to_module(graphdef, template, params) -> nnx.Module:
    """The module of :func:`split_params` with ``params`` (traceable: use inside ``jit``)."""
    state = jax.tree.map(lambda x: x, template)
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graphdef, state)
