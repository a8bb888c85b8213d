"""Input validation shared by the pure core.

Shape errors are static, so they raise ``ValueError`` both eagerly and under ``jit``.
Value errors (non-finite scores, a query with every document masked) can only be seen
on concrete arrays: they raise ``ValueError`` when the function is called eagerly and,
inside ``jit``/``vmap``/``grad``, the offending rows propagate NaN instead (documented in
each public function). This keeps the jitted path free of host callbacks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_traced(*arrays) -> bool:
    """True when any argument is an abstract tracer (inside jit, vmap, grad, ...)."""
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def check_scores(scores, mask, what: str) -> None:
    """Eager-only value checks: finite unmasked scores, at least one live document per row."""
    if is_traced(scores, mask):
        return
    scores_np = np.asarray(scores, dtype=np.float32)
    live = np.ones(scores_np.shape, dtype=bool) if mask is None else np.broadcast_to(
        np.asarray(mask, dtype=bool), scores_np.shape)
    bad = live & ~np.isfinite(scores_np)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"{what} has a non-finite value {scores_np[where]} at index {where} "
                         "of an unmasked document; mask it out or fix the scores")
    if scores_np.shape[-1] == 0:
        raise ValueError(f"{what} has K=0 documents; at least one is needed")
    dead = ~live.any(axis=-1)
    if dead.any():
        where = tuple(int(i) for i in np.argwhere(dead)[0])
        raise ValueError(f"{what}: every document is masked for the query at index {where}; "
                         "a mixture over zero documents is undefined")


def as_mask(mask, shape, what: str):
    """Broadcast an optional boolean mask to ``shape`` or raise a clear shape error."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    try:
        return jnp.broadcast_to(mask.astype(bool), shape)
    except ValueError as err:
        raise ValueError(f"{what} mask of shape {mask.shape} does not broadcast to the "
                         f"scores' shape {tuple(shape)}") from err
