"""The device mesh and the partition rules, in one place.

Retriever training is data-parallel over a 1-D ``("data",)`` mesh: batches are split along
their first axis, retriever parameters and optimizer state are replicated, and XLA inserts the
gradient all-reduce. Multi-host runs call :func:`initialize_distributed` in the entry point
first; then the mesh spans every process's devices, each process supplies only its own rows of
a batch (:func:`local_rows`, :func:`shard_batch` via ``jax.make_array_from_process_local_data``)
and of a sharded corpus, and replicated values are assembled from identical host copies.

The frozen LM (and, where asked, the retriever) is sharded over a mesh with named axes
``data`` × ``fsdp`` × ``model`` (:func:`parse_mesh`, :func:`make_mesh`). Every parameter is
annotated where it is declared with *logical* axes (Flax NNX ``out_sharding`` metadata:
``("embed", "heads")`` for a query kernel ...), and :data:`LOGICAL_RULES` maps logical axes to
mesh axes, Megatron-style: column-parallel q/k/v/gate/up (their output features on ``model``),
row-parallel o/down (their input features on ``model``), the embedding and the output head
sharded over the vocabulary, the KV cache over its kv-head axis, activations over the batch.
:func:`param_shardings` turns an abstract module state into ``NamedSharding`` s by these rules.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import warnings

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replug_jax.config import (  # noqa: F401 (re-exported: the mesh's text form)
    DATA,
    FSDP,
    MESH_AXES,
    MODEL,
    format_mesh,
    parse_mesh,
)

# Logical axis -> mesh axes, the one table every sharded parameter, cache and input goes
# through. A dimension whose size the mesh axes do not divide is replicated instead (with a
# warning), except attention heads, which are refused (see :func:`check_heads`).
LOGICAL_RULES: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("batch", (DATA, FSDP)),    # activations, inputs, the KV cache's sequences
    ("vocab", (MODEL,)),        # embedding rows and output-head columns
    ("heads", (MODEL,)),        # query heads: q's outputs, o's inputs (column / row parallel)
    ("kv_heads", (MODEL,)),     # key/value heads and the KV cache (replicated if M ∤ J)
    ("mlp", (MODEL,)),          # gate/up outputs, down inputs (column / row parallel)
    ("embed", (FSDP,)),         # the model width: sharded only by an fsdp axis
    ("positions", None),        # learned position tables
    ("norm", None),             # norm scales and biases
    ("layers", None),           # the KV cache's layer axis
    ("length", None),           # sequence positions
    ("head_dim", None),
)


_TARGET_PLATFORM = contextvars.ContextVar("replug_target_platform", default=None)


def platform() -> str:
    """The platform programs are traced for: the one :func:`for_target` set (compile-check
    compiles for a TPU topology or GPUs from a CPU machine), else this process's backend.
    Every trace-time branch on the hardware (attention's path, flash eligibility, the exact
    search's block size, remat and precision defaults) reads this, so a compile for a target
    compiles what the target runs."""
    return _TARGET_PLATFORM.get() or jax.default_backend()


@contextlib.contextmanager
def for_target(devices):
    """Trace for ``devices``' platform (``"tpu"``, ``"gpu"``, ``"cpu"``) inside the block."""
    kind = devices[0].platform
    token = _TARGET_PLATFORM.set("gpu" if kind in ("cuda", "rocm") else kind)
    try:
        yield
    finally:
        _TARGET_PLATFORM.reset(token)


def axes(*logical: str | None) -> dict:
    """Parameter metadata declaring ``logical`` axes (one per dimension) for the rules table;
    the arrays are placed by :func:`param_shardings`, not when a module is created."""
    return {"out_sharding": tuple(logical), "eager_sharding": False}


def initialize_distributed() -> None:
    """``jax.distributed.initialize()`` when launched as one of several processes.

    Reads the standard environment (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
    ``JAX_PROCESS_ID``, or a cluster such as SLURM/TPU pods); a no-op for a single process.
    """
    import os

    env = os.environ
    if not distributed_launch(env):
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


def distributed_launch(env) -> bool:
    """Whether this process is one of several: ``JAX_COORDINATOR_ADDRESS`` set, a TPU pod's
    workers named, or a SLURM *step* of more than one task (``srun``). An ``salloc`` or
    ``sbatch`` shell outside ``srun`` has ``SLURM_JOB_ID`` but no step: it is one process,
    and JAX's SLURM cluster detection would fail there."""
    if "JAX_COORDINATOR_ADDRESS" in env or "TPU_WORKER_HOSTNAMES" in env:
        return True
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env:
        try:
            return int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or 1) > 1
        except ValueError:
            return False
    return False


def make_mesh(num_devices: int | None = None, shape: dict[str, int] | None = None,
              devices=None) -> Mesh:
    """A mesh over every process's devices: 1-D ``("data",)`` over the first ``num_devices``
    (all by default), or with named axes from ``shape`` (``{"data": 2, "model": 4}``; see
    :func:`parse_mesh`), whose sizes must multiply to the device count (of ``devices``, a
    subset, when given: e.g. the devices a model gets apart from training's)."""
    if shape is None:
        devices = jax.devices()[: num_devices or len(jax.devices())]
        return Mesh(np.array(devices), (DATA,), axis_types=(jax.sharding.AxisType.Auto,))
    names = tuple(a for a in MESH_AXES if a in shape)
    sizes = tuple(int(shape[a]) for a in names)
    pool = list(jax.devices()) if devices is None else list(devices)
    n = len(pool)
    if math.prod(sizes) != n:
        raise ValueError(f"mesh {format_mesh(shape)} has {math.prod(sizes)} devices but "
                         f"{n} are " + ("visible" if devices is None else "given")
                         + f" ({jax.device_count()} over {jax.process_count()} "
                         "process(es)); make the axis sizes multiply to that")
    # One process: mesh_utils orders the devices for the topology (TPU ICI rings, NVLink
    # domains). Several: jax.devices() lists each process's devices together, so the
    # fastest-varying (last) axis, model, stays within a host and data crosses hosts.
    devices = device_grid(names, sizes, pool, jax.process_count() == 1)
    return Mesh(devices, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def device_grid(names: tuple[str, ...], sizes: tuple[int, ...], devices: list,
                topology_aware: bool = True) -> np.ndarray:
    """``devices`` arranged as a mesh of ``sizes``: over several TPU slices (devices with
    distinct ``slice_index``) a hybrid mesh whose slices split the outermost axis that takes
    them (data, else fsdp; only that axis crosses the slower data-center network), within a
    slice (or one process) ``mesh_utils``' topology-aware order, else the devices' order."""
    from jax.experimental import mesh_utils

    slices = sorted({getattr(d, "slice_index", 0) for d in devices})
    if len(slices) > 1:
        n = len(slices)
        axis = next((i for i, (a, size) in enumerate(zip(names, sizes))
                     if a in (DATA, FSDP) and size % n == 0), None)
        if axis is None:
            raise ValueError(f"{n} slices need a data or fsdp axis that they divide (mesh "
                             f"{dict(zip(names, sizes))}): across slices only those axes "
                             "belong")
        ici = tuple(size // n if i == axis else size for i, size in enumerate(sizes))
        dcn = tuple(n if i == axis else 1 for i in range(len(sizes)))
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices,
                                                    allow_split_physical_axes=True)
    if topology_aware:
        try:
            return mesh_utils.create_device_mesh(sizes, devices=devices,
                                                 allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            pass  # devices mesh_utils does not know how to lay out
    return np.array(devices).reshape(sizes)


def mesh_size(mesh: Mesh | None, axis: str) -> int:
    return int(mesh.shape[axis]) if mesh is not None and axis in mesh.shape else 1


def batch_multiple(mesh: Mesh | None) -> int:
    """Rows of a batch must be a multiple of this (the devices the batch axis spans)."""
    return mesh_size(mesh, DATA) * mesh_size(mesh, FSDP)


def check_heads(num_heads: int, mesh: Mesh | None, what: str) -> None:
    """Refuse, in one line, a model axis that does not divide the attention heads."""
    m = mesh_size(mesh, MODEL)
    if num_heads % m:
        works = [d for d in range(1, num_heads + 1) if num_heads % d == 0]
        raise ValueError(f"model axis {m} does not divide the {num_heads} attention heads of "
                         f"{what}: model sizes that work are {', '.join(map(str, works))}")


def logical_spec(logical: tuple, shape: tuple[int, ...], mesh: Mesh, *,
                 what: str = "") -> PartitionSpec:
    """The ``PartitionSpec`` of an array with ``logical`` axes by :data:`LOGICAL_RULES`: mesh
    axes absent from ``mesh`` are dropped, and a dimension they do not divide is replicated
    (warned once per logical axis and size)."""
    rules = dict(LOGICAL_RULES)
    spec, used = [], set()
    for name, size in zip(logical, shape):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} of {what} is not in LOGICAL_RULES")
        # a mesh axis splits one dimension at most: a second dimension mapped to it (OPT's
        # ("embed", "embed") projections) is replicated along it
        targets = tuple(a for a in (rules[name] or ()) if a in mesh.shape and
                        mesh.shape[a] > 1 and a not in used)
        n = math.prod(mesh.shape[a] for a in targets)
        if targets and size % n:
            _warn_replicated(name, size, n)
            targets = ()
        used.update(targets)
        spec.append(None if not targets else targets[0] if len(targets) == 1 else targets)
    return PartitionSpec(*spec)


_WARNED: set = set()


def _warn_replicated(name: str, size: int, n: int) -> None:
    if (name, size, n) not in _WARNED:
        _WARNED.add((name, size, n))
        warnings.warn(f"logical axis {name!r} of size {size} is not divisible by its "
                      f"{n} mesh devices: replicated", stacklevel=4)


def logical_sharding(mesh: Mesh, logical: tuple, shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(logical, shape, mesh))


def param_shardings(flat_state, mesh: Mesh) -> dict:
    """``{parameter path: NamedSharding}`` for a flat (abstract) NNX state whose variables
    declare logical axes (:func:`axes`); variables without them are replicated."""
    out = {}
    for path, var in flat_state:
        logical = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        out[path] = NamedSharding(mesh, logical_spec(tuple(logical), tuple(var.shape), mesh,
                                                     what=".".join(map(str, path))))
    return out


def put_global(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A global array from a host array every process holds whole (each process places
    only the slices its devices hold)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def addressable_bytes(tree) -> int:
    """Bytes of ``tree``'s arrays held by this process's first device."""
    device = jax.local_devices()[0]
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array):
            total += sum(s.data.nbytes for s in x.addressable_shards if s.device == device)
    return total


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
