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

NVIDIA GPUs are compiled for without one through the CUDA plugin and a target description
(:mod:`replug_jax.compile_targets`: ``--target h100x8``); XLA then gives the memory but no cost
analysis, and :func:`program_flops` counts the flops.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from replug_jax import compile_targets
from replug_jax.lm.flax_decode import EnsembleDecoding
from replug_jax.compile_targets import Shapes
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
         "TPU v6 lite": (32, 918, 1640), "TPU v6e": (32, 918, 1640), **compile_targets.chips()}


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
        return int(CHIPS[kind][0] * GIB), f"{kind} specification"
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


def lm_programs(cfg, mesh: Mesh, dtype, s: Shapes, *, unroll_layers: bool = False
                ) -> dict[str, Callable[[], object]]:
    """``{name: () -> Lowered}`` for the frozen LM's programs on ``mesh`` (``unroll_layers``:
    the layers as straight-line code, not a loop; see :func:`layer_costs`)."""
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
        model.unroll_layers = unroll_layers
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


def xla_cost(compiled) -> dict[str, float]:
    """XLA's cost analysis of a compiled program: flops, bytes accessed, and its estimated
    seconds (``optimal_seconds``; not positive where XLA gives none)."""
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):  # older jax: one dict per computation
        cost = cost[0] if cost else {}
    return {"flops": float(cost.get("flops", 0.0)),
            "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "optimal_seconds": float(cost.get("optimal_seconds", -1.0))}


def program_flops(lm_cfg, bert_cfg, s: Shapes, devices: int, remat: bool = True
                  ) -> dict[str, float]:
    """Each program's flops per device by arithmetic, for targets whose compiler gives no
    cost analysis (XLA:GPU compiled ahead of time): dense matmuls, 2 flops per multiply-add,
    attention over every key of the cache or sequence (no causal skipping), the work split
    evenly over ``devices``. :func:`DecoderConfig.flops_per_token
    <replug_jax.models.decoder.DecoderConfig.flops_per_token>` is the forward pass per token
    with the vocabulary head; the head is left out where a program computes no logits (the
    KV-reuse prefix) or only the last position's (the prefill). The LSR step is the forward
    pass of both towers three times over (forward and backward), once more under ``remat``;
    the top-k, one dot product per (query, passage); the refresh, the passage tower forward.
    ``tests/test_compile_check.py`` holds these against XLA's own counts on the CPU."""
    fpt = lm_cfg.flops_per_token if lm_cfg is not None else None
    out = {}
    if fpt is not None:
        head = 2 * (lm_cfg.embed_dim or lm_cfg.hidden_size) * lm_cfg.vocab_size
        b, length, prompt = s.lm_batch, s.context, s.context - s.new_tokens
        k = max(1, min(s.lsr_docs, b))
        out.update(
            lm_score=b * length * fpt(length),
            lm_kv_prefix=b * s.prefix_len * (fpt(s.prefix_len) - head),
            lm_kv_suffix=b * s.suffix_len * fpt(s.prefix_len + s.suffix_len),
            prefill=b * prompt * (fpt(length) - head) + b * head,
            decode_step=max(1, b // k) * k * fpt(length))
    if bert_cfg is not None:
        enc = bert_cfg.flops_per_token
        towers = (s.lsr_batch * s.query_len * enc(s.query_len)
                  + s.lsr_batch * s.lsr_docs * s.doc_len * enc(s.doc_len))
        rows = -(-s.encode_batch // devices) * devices
        out.update(lsr_step=towers * (4 if remat else 3), topk=2 * s.topk_queries * s.corpus
                   * bert_cfg.hidden_size, refresh_encode=rows * s.doc_len * enc(s.doc_len))
    return {name: float(total) / devices for name, total in out.items()}


def layer_costs(cfg, mesh: Mesh, dtype, s: Shapes) -> dict[str, Callable[[], dict]]:
    """``{name: () -> cost}``: what XLA's cost analysis leaves out of each LM program.

    The decoder scans its layers, and XLA counts a loop's body once, so a compiled program's
    flops and bytes are those of one layer plus the rest. The layers are alike: one layer's
    cost is the same program with three layers less it with two, both unrolled (a middle
    layer: XLA fuses the first and the last with what is around them, and drops work of the
    last whose output a program does not use, as the KV-reuse prefix does with its MLP), and
    the program's other ``num_layers - 1`` layers add that many times it."""
    if cfg.num_layers < 2:
        return {}
    one, two = (lm_programs(dataclasses.replace(cfg, num_layers=n), mesh, dtype, s,
                            unroll_layers=True) for n in (2, 3))

    def missing(name: str) -> dict:
        c1, c2 = xla_cost(one[name]().compile()), xla_cost(two[name]().compile())
        out = {key: (cfg.num_layers - 1) * (c2[key] - c1[key]) for key in c1}
        if min(c1["optimal_seconds"], c2["optimal_seconds"]) <= 0:
            out["optimal_seconds"] = None
        return out

    return {name: functools.partial(missing, name) for name in one}


def topk_block_costs(bert_cfg, mesh: Mesh, s: Shapes, index_dtype=jnp.bfloat16
                     ) -> dict[str, Callable[[], dict]]:
    """``{"topk": () -> cost}``: what XLA's cost analysis leaves out of the exact top-k when
    each device scans its rows in blocks (a ``lax.map`` whose body XLA counts once): the
    other blocks, each the cost of the same search over one block's rows (straight-line
    code), as :func:`layer_costs` does for the decoder's layers. Empty when one pass reads
    every row (the accelerators' block at the default shapes)."""
    from replug_jax.retrieval.jax_search import _sharded_topk_fn, block_rows

    flat = Mesh(mesh.devices.reshape(-1), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    n_dev, d = flat.devices.size, bert_cfg.hidden_size
    per_device = -(-s.corpus // n_dev)
    block = block_rows(s.topk_queries, per_device, d * jnp.dtype(index_dtype).itemsize)
    blocks = per_device // block
    if blocks <= 1:
        return {}
    rep = NamedSharding(flat, PartitionSpec())
    queries = jax.ShapeDtypeStruct((s.topk_queries, d), jnp.float32, sharding=rep)
    one = jax.ShapeDtypeStruct((block * n_dev, d), index_dtype,
                               sharding=NamedSharding(flat, PartitionSpec("data")))

    def missing() -> dict:
        fn = _sharded_topk_fn(flat, "data", s.k, block * n_dev, block, None, 256)
        c = xla_cost(fn.lower(queries, one).compile())
        out = {key: (blocks - 1) * c[key] for key in ("flops", "bytes_accessed")}
        out["optimal_seconds"] = None if c["optimal_seconds"] <= 0 else \
            (blocks - 1) * c["optimal_seconds"]
        return out

    return {"topk": missing}


def measure(lowered_fn: Callable[[], object], memory_bytes: int | None,
            headroom: float, chip: str = "", missing_cost: Callable[[], dict] | None = None,
            options: dict | None = None, flops: float | None = None) -> dict:
    """Compile one program (with XLA ``options``); its bytes per device (XLA's memory
    analysis), whether they fit ``memory_bytes`` less ``headroom`` (a fraction kept free),
    and XLA's cost analysis, with ``missing_cost()`` added (the layers a loop hides:
    :func:`layer_costs`); where XLA counts no flops, ``flops`` (:func:`program_flops`)."""
    compiled = lowered_fn().compile(compiler_options=options or None)
    m = compiled.memory_analysis()
    arg, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
    alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
    code = int(m.generated_code_size_in_bytes)
    total = arg + out - alias + temp + code
    cost = xla_cost(compiled)
    if missing_cost is not None:
        extra = missing_cost()
        for key in ("flops", "bytes_accessed"):
            cost[key] += extra[key]
        cost["optimal_seconds"] = (cost["optimal_seconds"] + extra["optimal_seconds"]
                                   if extra["optimal_seconds"] is not None else -1.0)
    row = {"argument_gib": arg / GIB, "output_gib": out / GIB, "donated_gib": alias / GIB,
           "temporary_gib": temp / GIB, "code_gib": code / GIB, "total_gib": total / GIB,
           "total_bytes": total, "flops": cost["flops"], "bytes_accessed": cost["bytes_accessed"],
           "xla_estimated_seconds": (cost["optimal_seconds"] if cost["optimal_seconds"] > 0
                                     else None),
           "layers_in_cost": "every layer (a scanned layer's cost times the depth)"
           if missing_cost is not None else "as compiled", "flops_from": "XLA"}
    if not row["flops"] and flops is not None:  # XLA:GPU ahead of time counts nothing
        row.update(flops=flops, flops_from="arithmetic (program_flops)", bytes_accessed=None)
    if chip in CHIPS:  # the roofline bound at the chip's peak (flops and bytes per device)
        _, tflops, gbps = CHIPS[chip]
        row["roofline_seconds"] = max(row["flops"] / (tflops * 1e12),
                                      (row["bytes_accessed"] or 0.0) / (gbps * 1e9))
    if memory_bytes:
        row["fits"] = total <= (1.0 - headroom) * memory_bytes
        row["fraction_of_chip"] = total / memory_bytes
    return row


def compile_check(programs: dict[str, Callable[[], object]], memory_bytes: int | None,
                  headroom: float = 0.1, progress: bool = True, chip: str = "",
                  missing_costs: dict[str, Callable[[], dict]] | None = None,
                  options: dict | None = None, flops: dict[str, float] | None = None
                  ) -> dict[str, dict]:
    """Every program compiled and measured (:func:`measure`, with ``missing_costs[name]``
    and ``flops[name]`` where given); a program XLA refuses is reported with its error
    instead of stopping the others, as not fitting only where the compiler says memory ran
    out (not shared memory: a kernel's limit, a compile error)."""
    from tqdm.auto import tqdm

    out = {}
    for name, fn in tqdm(programs.items(), desc="compiling", unit="program",
                         disable=not progress):
        try:
            out[name] = measure(fn, memory_bytes, headroom, chip,
                                (missing_costs or {}).get(name), options,
                                (flops or {}).get(name))
        except Exception as err:  # noqa: BLE001 — XLA's errors are many kinds; report them
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            out[name] = {"error": f"{type(err).__name__}: {first[:300]}", "fits": False}
            # the TPU compiler refuses a program that cannot fit: it states what it needs
            need = re.search(r"required for HLO temporaries \(([\d.]+)([KMGT])\)", first)
            if "RESOURCE_EXHAUSTED" in first and "shared memory" not in first.lower():
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
        moved = r["bytes_accessed"]
        lines.append(f"{name:<16}{r['argument_gib']:8.2f}{r['output_gib']:8.2f}"
                     f"{r['donated_gib']:9.2f}{r['temporary_gib']:8.2f}{r['total_gib']:11.2f}"
                     f"{('yes' if r.get('fits') else 'NO') if 'fits' in r else '?':>6}"
                     f"{r['flops'] / 1e12:9.3f}"
                     + (f"{moved / 1e9:10.2f}" if moved is not None else f"{'-':>10}")
                     + (f"{est * 1e3:10.2f}" if est is not None else f"{'-':>10}"))
    lines.append("est. ms: XLA's estimate where it gives one, else the roofline bound "
                 "max(flops / peak, bytes / bandwidth) at the chip's specification; totals "
                 "are arguments + outputs - donated + temporaries + code")
    if any(r.get("flops_from", "XLA") != "XLA" for r in rows.values()):
        lines.append("TFLOP by arithmetic (compile_check.program_flops): XLA gives no cost "
                     "analysis for this target; GB moved unknown, so est. ms is flops / peak")
    return "\n".join(lines)
