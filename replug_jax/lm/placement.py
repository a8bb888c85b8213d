"""Where an in-process LM's arrays live: its parameters, inputs, KV caches and outputs on a
device mesh, and the matmul precision its dtype promises.

With no mesh everything stays where JAX puts it (one device). With a mesh
(:func:`replug_jax.sharding.make_mesh`), parameters are sharded by the rules table, a batch's
rows are split over the ``data`` (and ``fsdp``) axes, KV caches over their kv-head axis, and
the small arrays the host reads back (log-probs, chosen tokens) are replicated so that every
process of a multi-host run can read them. Every process passes the same host inputs (the
same batch): each places only the slices its own devices hold.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replug_jax.models import init_cache
from replug_jax.sharding import (
    batch_multiple,
    check_heads,
    logical_sharding,
    param_shardings,
    platform,
    put_global,
)

# The logical axes of a decoder's KV cache (models.decoder.init_cache).
CACHE_AXES = {"k": ("layers", "batch", "kv_heads", "length", "head_dim"),
              "v": ("layers", "batch", "kv_heads", "length", "head_dim"),
              "pos": ("batch", "length"), "end": ()}


def matmul_precision(dtype) -> str | None:
    """``"highest"`` where float32 is claimed on an accelerator: TF32 (GPU) and single bf16
    passes (TPU) are XLA's defaults there, and are not float32."""
    if jnp.dtype(dtype) == jnp.float32 and platform() != "cpu":
        return "highest"
    return None


def _place(x, sharding: NamedSharding):
    """``x`` under ``sharding``: kept when it already is (a sharded load), resharded on the
    devices when it is a global array, else placed from every process's identical host copy."""
    if isinstance(x, jax.Array):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        if jax.process_count() == 1 or not x.is_fully_addressable:
            return jax.device_put(x, sharding)
    return put_global(np.asarray(x), sharding)


class Placement:
    """The mesh (or none) and dtype of one LM, and how its arrays are placed on it."""

    def __init__(self, mesh: Mesh | None, dtype):
        self.mesh = mesh
        self.dtype = jnp.dtype(dtype)
        self.precision = matmul_precision(self.dtype)
        self.row_multiple = batch_multiple(mesh)
        # one compiled program per cache shape (cfg, batch, length are static), not per call
        self._empty_cache = jax.jit(self._make_cache, static_argnums=(0, 1, 2))

    def describe(self) -> dict:
        """What results record about where and how the LM ran."""
        return {"dtype": self.dtype.name, "matmul_precision": self.precision or "default",
                "mesh": dict(self.mesh.shape) if self.mesh is not None else None,
                "backend": jax.default_backend(), "devices": jax.device_count()}

    def traced(self, fn):
        """``fn`` traced under this LM's matmul precision (wrap before ``jax.jit``)."""
        if self.precision is None:
            return fn

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with jax.default_matmul_precision(self.precision):
                return fn(*args, **kwargs)

        return wrapped

    def precision_scope(self):
        return (jax.default_matmul_precision(self.precision) if self.precision
                else contextlib.nullcontext())

    def shard_state(self, model: nnx.Module, state):
        """``state`` (of ``model``) on the mesh by the rules table; unchanged without one."""
        if self.mesh is None:
            return state
        check_heads(model.cfg.num_heads, self.mesh, type(model).__name__)
        flat = nnx.to_flat_state(state)
        shardings = param_shardings(flat, self.mesh)
        return nnx.from_flat_state([(path, var.replace(_place(var[...], shardings[path])))
                                    for path, var in flat])

    def rows(self, x: np.ndarray) -> jax.Array | np.ndarray:
        """A host batch ``[rows, ...]`` split over the batch axes of the mesh."""
        if self.mesh is None:
            return x
        x = np.asarray(x)
        return put_global(x, logical_sharding(self.mesh, ("batch",) + (None,) * (x.ndim - 1),
                                              x.shape))

    def replicated(self, x):
        """Inside ``jit``: ``x`` on every device (what the host reads back)."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec()))

    def constrain_cache(self, cache: dict) -> dict:
        """Inside ``jit``: a KV cache sharded by :data:`CACHE_AXES`."""
        if self.mesh is None:
            return cache
        return {name: jax.lax.with_sharding_constraint(
            x, logical_sharding(self.mesh, CACHE_AXES[name], x.shape))
            for name, x in cache.items()}

    def _make_cache(self, cfg, batch: int, length: int) -> dict:
        return self.constrain_cache(init_cache(cfg, batch, length, self.dtype))

    def new_cache(self, cfg, batch: int, length: int) -> dict:
        """An empty KV cache, created in place on the mesh (never whole on one device)."""
        if self.mesh is None:
            return self._make_cache(cfg, batch, length)
        return self._empty_cache(cfg, batch, length)
