"""The device mesh and the partition rules, in one place.

Training is data-parallel over a 1-D ``("data",)`` mesh: batches are split along their first
axis, retriever parameters and optimizer state are replicated, and XLA inserts the gradient
all-reduce. Multi-host runs call :func:`initialize_distributed` in the entry point first.
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

    if any(v in os.environ for v in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID",
                                     "TPU_WORKER_HOSTNAMES")):
        jax.distributed.initialize()


def make_mesh(num_devices: int | None = None) -> Mesh:
    devices = jax.devices()[: num_devices or len(jax.devices())]
    return Mesh(np.array(devices), (DATA,), axis_types=(jax.sharding.AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """Split the leading (batch) axis over the data axis."""
    return NamedSharding(mesh, PartitionSpec(DATA))


def shard_batch(batch: dict, mesh: Mesh) -> dict:
    n = mesh.devices.size
    for name, x in batch.items():
        if x.shape[0] % n:
            raise ValueError(f"batch field {name!r} has {x.shape[0]} rows, not divisible by "
                             f"{n} devices; choose a batch size that is")
    return jax.device_put(batch, batch_sharded(mesh))


def replicate(tree, mesh: Mesh):
    return jax.device_put(tree, replicated(mesh))
