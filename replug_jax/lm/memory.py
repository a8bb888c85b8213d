"""Device memory of an in-process LM on a mesh, computed from its shapes before anything loads.

Parameters come from the module's abstract shapes (``nnx.eval_shape``: nothing allocated) and
the sharding rules table, exactly as a sharded load places them; the KV cache, the output head's
logits and the activations from the batch and context. What it cannot know (XLA's temporaries,
the allocator's slack, the framework's own reservation) it leaves out: keep 10-20 % free.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from replug_jax.lm.placement import CACHE_AXES
from replug_jax.models import registry
from replug_jax.models.layers import ACCEL_BLOCK_BYTES
from replug_jax.sharding import DATA, FSDP, MESH_AXES, MODEL, check_heads, logical_spec

GIB = 1 << 30


def read_lm_config(path: str | pathlib.Path):
    """A decoder config from an HF ``config.json`` (or a folder holding one): no weights."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such config file")
    hf = json.loads(path.read_text())
    return registry.architecture("lm", hf.get("model_type"), where=str(path)).config_from_hf(hf)


def _shard_factor(spec, sizes: dict) -> int:
    return math.prod(math.prod(sizes[a] for a in ((s,) if isinstance(s, str) else s))
                     for s in spec if s is not None)


def lm_memory(cfg, mesh_shape: dict, dtype: str, *, batch: int, context: int) -> dict:
    """Bytes per device of ``cfg``'s LM in ``dtype`` on a mesh of ``mesh_shape`` (e.g.
    ``{"model": 8}``), scoring or decoding ``batch`` sequences of ``context`` tokens:
    parameters (exact), KV cache (exact), the head's float32 logits of one sequence, an
    activation estimate (a few ``[rows, context, width]`` buffers of the widest layer), and
    their total."""
    names = tuple(a for a in MESH_AXES if a in mesh_shape)
    mesh = jax.sharding.AbstractMesh(tuple(int(mesh_shape[a]) for a in names), names)
    sizes = dict(mesh.shape)
    check_heads(cfg.num_heads, mesh, f"{cfg.family} ({cfg.num_heads} heads)")
    itemsize = jnp.dtype(dtype).itemsize
    abstract = nnx.eval_shape(lambda: registry.architecture("lm", cfg.family).build(
        cfg, jnp.dtype(dtype), nnx.Rngs(0)))
    params = total = 0
    for path, var in nnx.to_flat_state(nnx.split(abstract)[1]):
        logical = var.get_metadata().get("out_sharding") or (None,) * len(var.shape)
        spec = logical_spec(tuple(logical), tuple(var.shape), mesh)
        n = math.prod(var.shape) * itemsize
        total += n
        params += n // _shard_factor(spec, sizes)
    rows = batch // (sizes.get(DATA, 1) * sizes.get(FSDP, 1)) or 1
    kv_shape = (cfg.num_layers, batch, cfg.num_kv_heads, context, cfg.head_dim)
    kv = 2 * math.prod(kv_shape) * itemsize // _shard_factor(
        logical_spec(CACHE_AXES["k"], kv_shape, mesh), sizes)
    vocab_split = _shard_factor(logical_spec(("vocab",), (cfg.vocab_size,), mesh), sizes)
    logits = context * cfg.vocab_size * 4 // vocab_split
    width = max(cfg.hidden_size, cfg.intermediate_size // sizes.get(MODEL, 1))
    activations = 4 * rows * context * width * itemsize + ACCEL_BLOCK_BYTES
    out = {"mesh": {a: sizes[a] for a in names}, "dtype": jnp.dtype(dtype).name,
           "batch": batch, "context": context, "parameters_total_gib": total / GIB,
           "parameters_gib": params / GIB, "kv_cache_gib": kv / GIB,
           "head_logits_gib": logits / GIB, "activations_estimate_gib": activations / GIB}
    out["total_gib"] = (params + kv + logits + activations) / GIB
    out = {k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}
    return {**out, "parameters_bytes": params, "kv_cache_bytes": kv}
