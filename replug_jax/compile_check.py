"""Every program of a paper-scale run compiled ahead of time for a target, with nothing
materialised: what each needs per device, and whether it fits the chip.

The way MaxText's ``train_compile.py`` costs a configuration for a topology it does not own:
the mesh is built from the target's devices (a TPU topology from
``jax.experimental.topologies.get_topology_desc``, which ``libtpu`` from PyPI answers on a
CPU-only machine; or this machine's own devices), every weight, optimizer state, KV cache and
batch is a ``jax.ShapeDtypeStruct`` under its ``NamedSharding`` (Flax NNX abstract state, the
rules table of :mod:`replug_jax.sharding`), and each program is lowered and compiled. XLA's
``memory_analysis()`` then gives the bytes per device (arguments, outputs, the buffers
donated into outputs, temporaries) and ``cost_analysis()`` the flops, bytes accessed and its
estimated time.

The programs are the ones the library runs, built by the same functions:

- ``lm_score``: :func:`~replug_jax.lm.flax_scorer.scoring_programs` (whole sequences);
- ``lm_kv_prefix`` / ``lm_kv_suffix``: :func:`~replug_jax.lm.kv_reuse.compile_fns` (document
  KV reuse: the documents' caches, then each query and continuation after its document);
- ``prefill`` and ``decode_step``: :class:`~replug_jax.lm.flax_decode.EnsembleDecoding`'s
  (one step: the decode loop at capacity 1), the KV cache donated;
- ``lsr_step``: :func:`~replug_jax.train.lsr.make_train_step` with its Adam update, both
  towers re-encoded, the batch split over every device;
- ``topk``: the exact top-k of :func:`~replug_jax.retrieval.jax_search.sharded_topk` over a
  corpus split along N;
- ``refresh_encode``: the retriever's embedding of a batch of passages (the refresh's step).

On a GPU target without the GPU (no CUDA here), XLA cannot compile: run this command on the GPU
host itself (``--topology`` omitted), where it compiles for the local devices.
"""

from __future__ import annotations

import math
import re
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replug_jax.lm.flax_decode import EnsembleDecoding
from replug_jax.run_shapes import Shapes
from replug_jax.sharding import (
    MESH_AXES,
    MODEL,
    device_grid,
    logical_sharding,
    mesh_size,
    param_shardings,
)

GIB = 1 << 30

# Per chip, by the device_kind jax reports (public specifications): HBM GiB, peak bf16
# TFLOP/s, HBM GB/s. XLA's own time estimate is often missing for a topology without the
# chip; the roofline max(flops / peak, bytes / bandwidth) stands in, named as such.
CHIPS = {"TPU v4": (32, 275, 1200), "TPU v5 lite": (16, 197, 819), "TPU v5e": (16, 197, 819),
         "TPU v5": (95, 459, 2765), "TPU v5p": (95, 459, 2765),
         "TPU v6 lite": (32, 918, 1640), "TPU v6e": (32, 918, 1640)}


def target_devices(topology: str | None, slices: int = 1) -> list:
    """The devices to compile for: a TPU topology's (``"v5e:2x4"``, ``slices`` of them
    joined by the data-center network; needs ``libtpu``) or, without one, this machine's."""
    if not topology:
        return list(jax.devices())
    from jax.experimental import topologies

    try:
        return list(topologies.get_topology_desc(
            platform="tpu", topology_name=topology,
            **({"num_slices": slices} if slices > 1 else {})).devices)
    except Exception as err:  # noqa: BLE001 — libtpu missing or an unknown topology
        text = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"cannot describe TPU topology {topology!r} ({text}): install the "
                         "`tpu-compile` extra (libtpu) and name a topology such as v5e:2x4 "
                         "or v5p:2x2x1") from None


def target_mesh(devices: list, shape: dict[str, int]) -> Mesh:
    """A mesh of ``devices`` with named axes (``{"model": 8}``), as
    :func:`~replug_jax.sharding.make_mesh` lays one out: topology-aware within a slice
    (TPU ICI), hybrid across slices."""
    names = tuple(a for a in MESH_AXES if a in shape)
    sizes = tuple(int(shape[a]) for a in names)
    if math.prod(sizes) != len(devices):
        raise ValueError(f"mesh {shape} has {math.prod(sizes)} devices; the target has "
                         f"{len(devices)}")
    return Mesh(device_grid(names, sizes, devices), names,
                axis_types=(jax.sharding.AxisType.Auto,) * len(names))


def chip_memory(devices: list, override_gib: float | None = None) -> tuple[int | None, str]:
    """(bytes per device, where the number comes from)."""
    if override_gib:
        return int(override_gib * GIB), "given"
    kind = getattr(devices[0], "device_kind", "")
    if kind in CHIPS:
        return CHIPS[kind][0] * GIB, f"{kind} specification"
    try:
        return int(devices[0].memory_stats()["bytes_limit"]), "the device's allocator limit"
    except (AttributeError, KeyError, TypeError, RuntimeError, NotImplementedError):
        return None, "unknown (pass --chip-memory)"


def abstract_state(module_fn: Callable[[], nnx.Module], mesh: Mesh):
    """``(graphdef, state)``: the module's state as ``ShapeDtypeStruct`` s under the
    shardings of the rules table (nothing allocated)."""
    graphdef, state = nnx.split(nnx.eval_shape(module_fn))
    flat = nnx.to_flat_state(state)
    shardings = param_shardings(flat, mesh)
    return graphdef, nnx.from_flat_state([
        (path, var.replace(jax.ShapeDtypeStruct(var.shape, var.dtype,
                                                sharding=shardings[path])))
        for path, var in flat])


def _spec(mesh, shape, dtype, logical) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=logical_sharding(mesh, logical, shape))


def _rows(mesh, shape, dtype=jnp.int32):
    """A batch input: rows split over the batch axes."""
    return _spec(mesh, shape, dtype, ("batch",) + (None,) * (len(shape) - 1))


def _replicated(mesh, shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))


def lm_programs(cfg, mesh: Mesh, dtype, s: Shapes) -> dict[str, Callable[[], object]]:
    """``{name: () -> Lowered}`` for the frozen LM's programs on ``mesh``."""
    from replug_jax.lm.flax_scorer import scoring_programs
    from replug_jax.lm.kv_reuse import compile_fns
    from replug_jax.lm.placement import CACHE_AXES, Placement
    from replug_jax.models import registry
    from replug_jax.models.decoder import configure_attention
    from replug_jax.sharding import check_heads

    check_heads(cfg.num_heads, mesh, f"{cfg.family} ({cfg.num_heads} heads)")
    dtype = jnp.dtype(dtype)
    place = Placement(mesh, dtype)
    def build():
        model = registry.architecture("lm", cfg.family).build(cfg, dtype, nnx.Rngs(0))
        configure_attention(model, mesh_size(mesh, MODEL))  # as FlaxLM does on a mesh
        return model

    graphdef, state = abstract_state(build, mesh)
    score_fn, _, _ = scoring_programs(graphdef, place)
    prefix_fn, suffix_fn = compile_fns(graphdef, cfg, place)
    b, length = s.lm_batch, s.context

    def cache(batch, slots):
        layers, j, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
        kv = (layers, batch, j, slots, d)
        return {"k": _spec(mesh, kv, dtype, CACHE_AXES["k"]),
                "v": _spec(mesh, kv, dtype, CACHE_AXES["v"]),
                "pos": _spec(mesh, (batch, slots), jnp.int32, CACHE_AXES["pos"]),
                "end": _replicated(mesh, (), jnp.int32)}

    decoder = _AbstractDecoder(graphdef, place, cfg.eos_token_id)
    k = max(1, min(s.lsr_docs, b))  # branches per group in decoding
    groups = max(1, b // k)
    rows = groups * k
    pre = cache(b, s.prefix_len)
    return {
        "lm_score": lambda: score_fn.lower(state, _rows(mesh, (b, length)),
                                           _rows(mesh, (b, length)),
                                           _rows(mesh, (b, length))),
        "lm_kv_prefix": lambda: prefix_fn.lower(state, _rows(mesh, (b, s.prefix_len)),
                                                _rows(mesh, (b, s.prefix_len))),
        "lm_kv_suffix": lambda: suffix_fn.lower(
            state, pre["k"], pre["v"], pre["pos"], _rows(mesh, (b, s.suffix_len)),
            _rows(mesh, (b, s.suffix_len)), _rows(mesh, (b, s.suffix_len)),
            _rows(mesh, (b,)), width=s.suffix_len),
        "prefill": lambda: EnsembleDecoding._prefill.lower(
            decoder, state, _rows(mesh, (b, length - s.new_tokens)),
            _rows(mesh, (b, length - s.new_tokens)), cache(b, length)),
        "decode_step": lambda: EnsembleDecoding._decode.lower(
            decoder, state, cache(rows, length), _rows(mesh, (rows, cfg.vocab_size), jnp.float32),
            _replicated(mesh, (groups, k), jnp.float32), _rows(mesh, (rows,)),
            _replicated(mesh, (groups,), jnp.bool_), jax.random.PRNGKey(0),
            jnp.float32(0.0), jnp.float32(1.0), jnp.int32(1), capacity=1, k=k),
    }


class _AbstractDecoder(EnsembleDecoding):
    """What :class:`EnsembleDecoding`'s compiled programs read of an LM, without weights."""

    def __init__(self, graphdef, place, eos_id):
        self._graphdef, self.place, self.eos_id = graphdef, place, eos_id


def retriever_programs(bert_cfg, mesh: Mesh, s: Shapes, *, remat: bool = True,
                       dtype=jnp.float32, index_dtype=jnp.bfloat16
                       ) -> dict[str, Callable[[], object]]:
    """``{name: () -> Lowered}`` for the retriever's programs on a 1-D ``data`` mesh over
    the same devices (parameters and optimizer state replicated, batches and the corpus
    split), as LSR training runs them."""
    from replug_jax.models.bert import BertEncoder, embed
    from replug_jax.models.params import split_params, to_module
    from replug_jax.retrieval.jax_search import _sharded_topk_fn
    from replug_jax.train.lsr import TrainState, make_train_step
    from replug_jax.train.spec import ObjectiveConfig, OptimConfig

    flat = Mesh(mesh.devices.reshape(-1), ("data",),
                axis_types=(jax.sharding.AxisType.Auto,))
    n_dev = flat.devices.size
    encoder = nnx.eval_shape(lambda: BertEncoder(bert_cfg, dtype=jnp.dtype(dtype),
                                                     rngs=nnx.Rngs(0)))
    graphdef, template, params = split_params(encoder)
    rep = NamedSharding(flat, PartitionSpec())
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), params)
    optim = OptimConfig()  # §5.2: Adam 2e-5, as LSRConfig's defaults
    tx = optim.build(1000)
    opt_state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                             jax.eval_shape(tx.init, params))
    state = TrainState(params, opt_state, jax.ShapeDtypeStruct((), jnp.int32, sharding=rep))
    step, _ = make_train_step(graphdef, template, ObjectiveConfig(), tx, "mean", True,
                              schedule=optim.schedule(1000), remat=remat)
    split = NamedSharding(flat, PartitionSpec("data"))
    b, k = s.lsr_batch, s.lsr_docs
    batch = {"query_ids": ((b, s.query_len), jnp.int32), "query_mask": ((b, s.query_len),
                                                                        jnp.int32),
             "doc_ids": ((b, k, s.doc_len), jnp.int32), "doc_mask": ((b, k, s.doc_len),
                                                                     jnp.int32),
             "doc_valid": ((b, k), jnp.bool_), "lm_scores": ((b, k), jnp.float32)}
    batch = {n: jax.ShapeDtypeStruct(shape, dt, sharding=split) for n, (shape, dt) in
             batch.items()}
    d = bert_cfg.hidden_size
    per_device = -(-s.corpus // n_dev)
    topk = _sharded_topk_fn(flat, "data", s.k, s.corpus, per_device, None, 256)
    corpus = jax.ShapeDtypeStruct((per_device * n_dev, d), index_dtype, sharding=split)
    queries = jax.ShapeDtypeStruct((s.topk_queries, d), jnp.float32, sharding=rep)
    encode = jax.jit(lambda p, ids, mask: embed(to_module(graphdef, template, p), ids, mask,
                                                pooling="mean", normalize=True))
    enc_rows = -(-s.encode_batch // n_dev) * n_dev
    ids = jax.ShapeDtypeStruct((enc_rows, s.doc_len), jnp.int32, sharding=split)
    return {"lsr_step": lambda: step.lower(state, batch),
            "topk": lambda: topk.lower(queries, corpus),
            "refresh_encode": lambda: encode.lower(params, ids, ids)}


def measure(lowered_fn: Callable[[], object], memory_bytes: int | None,
            headroom: float, chip: str = "") -> dict:
    """Compile one program; its bytes per device (XLA's memory analysis), whether they fit
    ``memory_bytes`` less ``headroom`` (a fraction kept free), and XLA's cost analysis."""
    compiled = lowered_fn().compile()
    m = compiled.memory_analysis()
    arg, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
    alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
    code = int(m.generated_code_size_in_bytes)
    total = arg + out - alias + temp + code
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    row = {"argument_gib": arg / GIB, "output_gib": out / GIB, "donated_gib": alias / GIB,
           "temporary_gib": temp / GIB, "code_gib": code / GIB, "total_gib": total / GIB,
           "total_bytes": total, "flops": float(cost.get("flops", 0.0)),
           "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
           "xla_estimated_seconds": (float(cost["optimal_seconds"])
                                     if cost.get("optimal_seconds", -1) > 0 else None)}
    if chip in CHIPS:  # the roofline bound at the chip's peak (flops and bytes per device)
        _, tflops, gbps = CHIPS[chip]
        row["roofline_seconds"] = max(row["flops"] / (tflops * 1e12),
                                      row["bytes_accessed"] / (gbps * 1e9))
    if memory_bytes:
        row["fits"] = total <= (1.0 - headroom) * memory_bytes
        row["fraction_of_chip"] = total / memory_bytes
    return row


def compile_check(programs: dict[str, Callable[[], object]], memory_bytes: int | None,
                  headroom: float = 0.1, progress: bool = True, chip: str = ""
                  ) -> dict[str, dict]:
    """Every program compiled and measured (:func:`measure`); a program XLA refuses is
    reported with its error instead of stopping the others."""
    from tqdm.auto import tqdm

    out = {}
    for name, fn in tqdm(programs.items(), desc="compiling", unit="program",
                         disable=not progress):
        try:
            out[name] = measure(fn, memory_bytes, headroom, chip)
        except Exception as err:  # noqa: BLE001 — XLA's errors are many kinds; report them
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            out[name] = {"error": f"{type(err).__name__}: {first[:300]}", "fits": False}
            # the TPU compiler refuses a program that cannot fit: it states what it needs
            need = re.search(r"required for HLO temporaries \(([\d.]+)([KMGT])\)", first)
            if "RESOURCE_EXHAUSTED" in first:
                out[name]["does_not_fit"] = True
                if need:
                    scale = {"K": 1 << 10, "M": 1 << 20, "G": GIB, "T": 1 << 40}[need[2]]
                    out[name]["temporary_gib"] = float(need[1]) * scale / GIB
                    if memory_bytes:
                        out[name]["fraction_of_chip"] = float(need[1]) * scale / memory_bytes
    return out


def format_report(rows: dict[str, dict], memory_bytes: int | None, where: str) -> str:
    head = (f"per device; chip memory {memory_bytes / GIB:.2f} GiB ({where})" if memory_bytes
            else f"per device; chip memory {where}")
    lines = [head, f"{'program':<16}{'args':>8}{'out':>8}{'donated':>9}{'temp':>8}"
             f"{'total GiB':>11}{'fits':>6}{'TFLOP':>9}{'GB moved':>10}{'est. ms':>10}"]
    for name, r in rows.items():
        if "error" in r:
            what = "does not fit" if r.get("does_not_fit") else "does not compile"
            lines.append(f"{name:<16} {what}: {r['error']}")
            continue
        est = r.get("xla_estimated_seconds") or r.get("roofline_seconds")
        lines.append(f"{name:<16}{r['argument_gib']:8.2f}{r['output_gib']:8.2f}"
                     f"{r['donated_gib']:9.2f}{r['temporary_gib']:8.2f}{r['total_gib']:11.2f}"
                     f"{('yes' if r.get('fits') else 'NO') if 'fits' in r else '?':>6}"
                     f"{r['flops'] / 1e12:9.3f}{r['bytes_accessed'] / 1e9:10.2f}"
                     + (f"{est * 1e3:10.2f}" if est is not None else f"{'-':>10}"))
    lines.append("est. ms: XLA's estimate where it gives one, else the roofline bound "
                 "max(flops / peak, bytes / bandwidth) at the chip's specification; totals "
                 "are arguments + outputs - donated + temporaries + code")
    return "\n".join(lines)
