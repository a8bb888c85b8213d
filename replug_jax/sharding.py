"""The device mesh and the partition rules, in one place.

Training is data-parallel over a 1-D ``("data",)`` mesh: batches are split along their first
axis, retriever parameters and optimizer state are replicated, and XLA inserts the gradient
all-reduce. Multi-host runs call :func:`initialize_distributed` in the entry point first; then
the mesh spans every process's devices, each process supplies only its own rows of a batch
(:func:`local_rows`, :func:`shard_batch` via ``jax.make_array_from_process_local_data``) and of
a sharded corpus, and replicated values are assembled from identical host copies.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA = "data"


def initialize_distributed() -> None:
    """``jax.distributed.initialize()`` when launched as one of several processes.

    Reads the standard environment (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
    ``JAX_PROCESS_ID``, or a cluster such as SLURM/TPU pods); a no-op for a single process.
    """
    import os

    env = os.environ
    if not any(v in env for v in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID",
                                  "TPU_WORKER_HOSTNAMES")):
        return
    # CPU processes need a collectives backend (GPUs and TPUs bring their own)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if "JAX_COORDINATOR_ADDRESS" in env:  # explicit: jax does not read the other two itself
        missing = [v for v in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID") if v not in env]
        if missing:
            raise ValueError(f"JAX_COORDINATOR_ADDRESS is set but {' and '.join(missing)} "
                             "is not: set all three for a multi-process run")
        jax.distributed.initialize(coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
                                   num_processes=int(env["JAX_NUM_PROCESSES"]),
                                   process_id=int(env["JAX_PROCESS_ID"]))
    else:  # SLURM or a TPU pod: jax finds the cluster itself
        jax.distributed.initialize()


def make_mesh(num_devices: int | None = None) -> Mesh:
    devices = jax.devices()[: num_devices or len(jax.devices())]
    return Mesh(np.array(devices), (DATA,), axis_types=(jax.sharding.AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Split the leading (batch) axis over the data axis."""
    return NamedSharding(mesh, PartitionSpec(DATA))


def local_rows(n: int) -> slice:
    """This process's contiguous share of ``n`` global rows (all of them for one process)."""
    count, index = jax.process_count(), jax.process_index()
    if n % count:
        raise ValueError(f"{n} rows cannot be split evenly over {count} processes")
    per = n // count
    return slice(index * per, (index + 1) * per)


def shard_batch(local_batch: dict, mesh: Mesh) -> dict:
    """Global arrays split along the batch axis from this process's rows of the batch (the
    whole batch when there is one process)."""
    n = mesh.devices.size
    sharding = batch_sharded(mesh)
    out = {}
    for name, x in local_batch.items():
        rows = x.shape[0] * jax.process_count()
        if rows % n:
            raise ValueError(f"batch field {name!r} has {rows} rows, not divisible by "
                             f"{n} devices; choose a batch size that is")
        out[name] = jax.make_array_from_process_local_data(sharding, np.asarray(x))
    return out


def replicate(tree, mesh: Mesh):
    """``tree`` on every device of the mesh. With several processes each passes an identical
    host copy (arrays already on the mesh are resharded without leaving the devices)."""
    sharding = replicated(mesh)
    if jax.process_count() == 1:
        return jax.device_put(tree, sharding)

    def put(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return jax.device_put(x, sharding)
        return jax.make_array_from_process_local_data(sharding, np.asarray(x))

    return jax.tree.map(put, tree)


def host_copy(tree):
    """A replicated (or fully addressable) tree as NumPy on this host."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0))
                        if isinstance(x, jax.Array) and not x.is_fully_addressable
                        else np.asarray(x), tree)


def barrier(name: str) -> None:
    """Wait for every process (a no-op for one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
