"""``replug compile-check``: every program of a paper-scale run compiled ahead of time for a
target (a TPU topology from this machine, or the local devices), with its memory per device
against the chip's (:mod:`replug_jax.compile_check`)."""

from __future__ import annotations

import json
import pathlib

from replug_jax.cli.common import command, emit, mesh_shape, positive_int
from replug_jax.compile_targets import HELP, Shapes

PROGRAM_GROUPS = ("lm", "retriever")
LM_PROGRAMS = ("lm_score", "lm_kv_prefix", "lm_kv_suffix", "prefill", "decode_step")
RETRIEVER_PROGRAMS = ("lsr_step", "topk", "refresh_encode")


def add_parsers(sub) -> None:
    d = Shapes()
    p = command(sub, "compile-check", cmd_compile_check, check=_before_jax,
                help="compile a paper-scale run's programs for a target and check each fits",
                description="Compiles, ahead of time and with nothing allocated, the frozen "
                            "LM's scoring (whole sequences and the KV-reuse prefix and suffix), "
                            "prefill and one decode step, and the retriever's LSR step with its "
                            "update, the exact top-k over a corpus shard and the refresh's "
                            "encode step, for a TPU topology (with the tpu-compile extra: "
                            "libtpu answers on a CPU-only machine), NVIDIA GPUs (--target, "
                            "with the gpu extra's CUDA plugin: no GPU needed) or this "
                            "machine's devices. Prints per program and device the argument, "
                            "output, donated, temporary and total bytes against the chip's "
                            "memory, and the flops (XLA's, or by arithmetic for GPUs) and "
                            "estimated time. Exit status 1 if any does not fit or compile.")
    p.add_argument("--topology", default="",
                   help="a TPU topology such as v5e:2x4, v5e:4x4 or v5p:2x2x1 (default: this "
                        "machine's devices)")
    p.add_argument("--target", default="",
                   help="NVIDIA GPUs on one host, compiled for without them (the gpu extra's "
                        "CUDA plugin): h100xN, h200xN or a100xN, e.g. h100x8")
    p.add_argument("--slices", type=positive_int, default=1,
                   help="with --topology: this many slices of it, joined by the data-center "
                        "network (the mesh's data or fsdp axis spans them; default 1)")
    p.add_argument("--lm-config", type=pathlib.Path, required=True,
                   help="the LM's HF config.json (or its folder): Llama family, GPT-2 or OPT; "
                        "experiments/configs/lm_shapes/ holds Llama-2-7B and 70B")
    p.add_argument("--retriever-config", type=pathlib.Path, default=None,
                   help="the retriever's BERT config.json (default: BERT-base, the "
                        "paper's Contriever)")
    p.add_argument("--mesh", type=mesh_shape, default=None, metavar="AXIS=SIZE,...",
                   help="the LM's mesh over the target's devices, e.g. model=8 or "
                        "data=2,model=4 (default: model over every device); the retriever "
                        "runs data-parallel over the same devices")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the LM's parameter and activation dtype (default bfloat16)")
    p.add_argument("--programs", nargs="+", choices=PROGRAM_GROUPS + LM_PROGRAMS
                   + RETRIEVER_PROGRAMS, default=list(PROGRAM_GROUPS), metavar="PROGRAM",
                   help="which programs: lm (all the LM's), retriever (all the retriever's), "
                        f"or any of {', '.join(LM_PROGRAMS + RETRIEVER_PROGRAMS)} "
                        "(default: lm retriever)")
    for name in HELP:  # every size of a run (compile_targets.Shapes), one option each
        p.add_argument(f"--{name.replace('_', '-')}", type=positive_int,
                       default=getattr(d, name), help=HELP[name]
                       + f" (default {getattr(d, name):,})")
    p.add_argument("--no-remat", action="store_true",
                   help="compile the LSR step without recomputing encoder activations in the "
                        "backward pass (the accelerator default is remat on)")
    p.add_argument("--chip-memory", type=float, default=None, metavar="GIB",
                   help="memory per device in GiB (default: the TPU's specification, or the "
                        "local device's allocator limit)")
    p.add_argument("--headroom", type=float, default=0.1,
                   help="fraction of the chip kept free for what XLA does not count "
                        "(the runtime, fragmentation); default 0.1")
    p.add_argument("--out", type=pathlib.Path, default=None,
                   help="also write the report as JSON to this file")


def _check_args(args) -> None:
    """Every argument problem in one line, before anything is compiled."""
    import math

    if not 0 <= args.headroom < 1:
        raise ValueError(f"--headroom must be in [0, 1), got {args.headroom}")
    if args.chip_memory is not None and not (math.isfinite(args.chip_memory)
                                             and args.chip_memory > 0):
        raise ValueError(f"--chip-memory is a device's memory in GiB, a finite positive "
                         f"number; got {args.chip_memory}")
    if args.target and args.topology:
        raise ValueError("give --topology (a TPU) or --target (NVIDIA GPUs), not both")
    if args.target:
        from replug_jax.compile_targets import parse_target

        parse_target(args.target)
    if args.slices > 1 and not args.topology:
        raise ValueError("--slices joins slices of a --topology; give one (e.g. --topology "
                         "v5e:2x4 --slices 2)")
    if args.new_tokens >= args.context:
        raise ValueError(f"--new-tokens ({args.new_tokens}) must be below --context "
                         f"({args.context}): the prefill is context − new-tokens of prompt")


def _before_jax(args) -> None:
    """Before JAX loads: libtpu's lockfile would let only one process at a time describe a
    topology (a second gets ABORTED); compiling for one needs no exclusive chip. For a GPU
    target, JAX runs on the CPU: the CUDA plugin then describes GPUs without starting on
    one (started as a backend on a machine without a GPU, it fails and offers no target)."""
    import os

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # a topology needs no cloud metadata
    if getattr(args, "target", "") and "JAX_PLATFORMS" not in os.environ:
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax  # imported already by the parser's modules: the setting, not the variable

        jax.config.update("jax_platforms", "cpu")


def cmd_compile_check(args) -> int:
    from replug_jax import compile_check as cc
    from replug_jax.fileio import write_json_atomic
    from replug_jax.lm.memory import read_lm_config
    from replug_jax.models.bert import BertConfig
    from replug_jax.sharding import for_target

    _check_args(args)
    lm_cfg = read_lm_config(args.lm_config)
    if args.retriever_config is not None:
        path = args.retriever_config
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such config file")
        bert_cfg = BertConfig.from_hf(json.loads(path.read_text()))
    else:
        bert_cfg = BertConfig()
    from replug_jax.compile_targets import COMPILE_OPTIONS, gpu_devices

    devices = (gpu_devices(args.target) if args.target else
               cc.target_devices(args.topology or None, args.slices))
    options = COMPILE_OPTIONS if args.target else None  # stated in the report
    wanted_retriever = {"lsr_step", "retriever"} & set(args.programs)
    if wanted_retriever and args.lsr_batch % len(devices):
        raise ValueError(f"--lsr-batch {args.lsr_batch} does not divide over the target's "
                         f"{len(devices)} devices (the LSR step splits its batch over them): "
                         "give a multiple")
    mesh = cc.target_mesh(devices, args.mesh or {"model": len(devices)})
    memory, where = cc.chip_memory(devices, args.chip_memory)
    shapes = Shapes(**{f: getattr(args, f) for f in HELP})
    wanted = set(args.programs)
    wanted |= set(LM_PROGRAMS) if "lm" in wanted else set()
    wanted |= set(RETRIEVER_PROGRAMS) if "retriever" in wanted else set()
    programs, missing_costs = {}, {}
    with for_target(devices):  # the target's code paths, not this machine's
        if wanted & set(LM_PROGRAMS):
            programs.update(cc.lm_programs(lm_cfg, mesh, args.dtype, shapes))
            if not args.target:  # XLA:GPU ahead of time counts no cost to correct
                missing_costs = cc.layer_costs(lm_cfg, mesh, args.dtype, shapes)
        if wanted & set(RETRIEVER_PROGRAMS):
            programs.update(cc.retriever_programs(bert_cfg, mesh, shapes,
                                                  remat=not args.no_remat))
            if not args.target:  # the blocks of the top-k's scan, as the layers above
                missing_costs.update(cc.topk_block_costs(bert_cfg, mesh, shapes))
        programs = {name: fn for name, fn in programs.items() if name in wanted}
        rows = cc.compile_check(programs, memory, args.headroom, progress=not args.json,
                                chip=getattr(devices[0], "device_kind", ""),
                                missing_costs=missing_costs, options=options,
                                flops=cc.program_flops(lm_cfg, bert_cfg, shapes, len(devices),
                                                       remat=not args.no_remat))
    report = {"target": args.target or args.topology or f"{len(devices)} local "
                                                        f"{devices[0].platform} device(s)",
              "xla_options": options or {},
              "device_kind": getattr(devices[0], "device_kind", ""),
              "devices": len(devices), "mesh": dict(mesh.shape), "dtype": args.dtype,
              "chip_memory_gib": memory / cc.GIB if memory else None, "chip_memory_from": where,
              "headroom": args.headroom, "shapes": vars(shapes), "programs": rows}
    if args.out is not None:
        write_json_atomic(report, args.out)
    flags = ", ".join(f"{k}={v}" for k, v in (options or {}).items())
    emit(args, report, f"{report['target']} ({report['device_kind']}), mesh "
         f"{report['mesh']}, {args.dtype}" + (f"; XLA options {flags}" if flags else "")
         + "\n" + cc.format_report(rows, memory, where))
    return 0 if all(r.get("fits", True) and "error" not in r for r in rows.values()) else 1
