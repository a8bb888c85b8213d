"""``replug train-lsr`` and ``replug export-retriever``: REPLUG LSR from the command line."""

from __future__ import annotations

import pathlib

from replug_jax.cli.common import (
    command,
    emit,
    existing_dir,
    existing_file,
    mesh_shape,
    positive_int,
)


def cmd_train_lsr(args) -> int:
    from replug_jax.sharding import format_mesh, initialize_distributed
    from replug_jax.train.assemble import build_trainer
    from replug_jax.train.config import load_config

    initialize_distributed()
    lm_flags = [f"lm.{name}={value}" for name, value in
                (("dtype", args.dtype), ("mesh", format_mesh(args.mesh) if args.mesh else None))
                if value is not None]
    cfg, variant = load_config(args.config, args.set + lm_flags)
    trainer = build_trainer(cfg, args.workdir, progress=not args.json)
    result = trainer.run(stop_after=args.max_steps)
    result["variant"] = variant
    last = result["last"]
    if cfg.supervision.kind == "pool":
        best = result["best"]
        emit(args, result,
             f"step {result['step']}/{cfg.total_steps}"
             + (" (stopped early)" if result["stopped_early"] else "")
             + f": kept step {result['best_step']} ({cfg.selection.metric}): "
             + ", ".join(f"{k} {best[k]:.4f}" for k in ("dev_recall@1", "dev_loglik", "tau")
                         if k in best)
             + f"; γ {trainer.temperatures['gamma_used']:g}, β "
             f"{trainer.temperatures['beta_used']:g}")
        return 0
    emit(args, result,
         f"step {result['step']}/{cfg.total_steps}: loss {last.get('loss', float('nan')):.4f}, "
         f"P_R/Q argmax agreement {last.get('argmax_agreement', float('nan')):.2f}, LM cache "
         f"{result['lm_cache_hits']} hits / {result['lm_cache_misses']} misses"
         + (f"\ndev: {result['dev']}" if "dev" in result else ""))
    return 0


def cmd_export_retriever(args) -> int:
    from replug_jax.train.export import export_run

    from replug_jax.train.release import verdict

    out, step, tested = export_run(args.workdir, args.out, args.step, dtype=args.dtype,
                                   comparison=args.comparison, metric=args.metric,
                                   mode=args.mode)
    emit(args, {"out": str(out), "step": step, "dtype": args.dtype, "comparison": tested},
         f"exported step {step} ({args.dtype}) -> {out}\n{verdict(tested)}")
    return 0


def config_file(text: str) -> str:
    """``path/to/config.py[:variant]`` whose file exists."""
    import argparse

    if not pathlib.Path(text.split(":")[0]).is_file():
        raise argparse.ArgumentTypeError(f"{text.split(':')[0]}: no such file")
    return text


def add_parsers(sub) -> None:
    tr = command(sub, "train-lsr", cmd_train_lsr,
                 help="REPLUG LSR: train the retriever from LM likelihoods",
                 description="Train the retriever so that its distribution over the "
                             "top-k documents matches the frozen LM's (paper §4). Resumes "
                             "automatically from the latest checkpoint in --workdir.")
    tr.add_argument("--config", required=True, type=config_file,
                    help="config file and variant, e.g. experiments/configs/lsr_nq.py:tiny")
    tr.add_argument("--workdir", required=True, type=pathlib.Path,
                    help="run directory: checkpoints, index versions, metrics, LM-score cache")
    tr.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="override config fields by their dotted key in the config's tree, "
                         "e.g. --set k=10 objective.gamma=0.5 optim.learning_rate=1e-5 "
                         "lm.dtype=bfloat16 retrieval.index_factory=IVF4096,Flat (repeatable; "
                         "an old flat name such as gamma is refused with its new key)")
    tr.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default=None,
                    help="the in-process LM's dtype (the config's lm.dtype; default auto: "
                         "bfloat16 on GPUs and TPUs, float32 on a CPU)")
    tr.add_argument("--mesh", type=mesh_shape, default=None, metavar="AXIS=SIZE,...",
                    help="shard the in-process LM over a device mesh, e.g. model=8 or "
                         "data=2,model=4 (the config's lm.mesh; the retriever stays data-"
                         "parallel over every device)")
    tr.add_argument("--max-steps", type=positive_int, default=None,
                    help="stop after this many steps of this invocation (resume later)")

    ex = command(sub, "export-retriever", cmd_export_retriever,
                 help="write a trained retriever in HF layout",
                 description="Export the latest checkpoint of an LSR run (or the "
                             "one of --step) as a transformers- and sentence-transformers-"
                             "loadable BERT folder (float16 by default) with a README.md card: "
                             "metadata, the weights' SHA-256, the lengths it was trained with, "
                             "how to load it, and its comparison with its base (--comparison) "
                             "or the statement that it was not tested against it.")
    ex.add_argument("--workdir", required=True, type=existing_dir, help="the LSR run directory")
    ex.add_argument("--step", type=int, default=None,
                    help="export the checkpoint saved at this step (default: the newest; "
                         "keep_checkpoints decides which are kept)")
    ex.add_argument("--out", required=True, type=pathlib.Path,
                    help="output folder, e.g. checkpoints/minilm-lsr-nq")
    ex.add_argument("--dtype", choices=("float16", "float32"), default="float16",
                    help="weight dtype of the release (default float16)")
    ex.add_argument("--comparison", type=existing_file, default=None,
                    help="results.json of `replug eval --compare-retriever <this folder>` on "
                         "held-out data: the card then states the difference from the base "
                         "and whether it passes the release rule (checkpoints/README.md); "
                         "without it the card says it was not tested against its base")
    ex.add_argument("--metric", choices=("answer_loglik", "exact_match", "f1",
                                         "answer_contained", "gold_recall", "bits_per_byte"),
                    default=None,
                    help="the comparison's deciding metric (default: answer_loglik for QA, "
                         "bits_per_byte for texts)")
    ex.add_argument("--mode", choices=("replug", "top1", "concat", "random"), default="replug",
                    help="the eval mode whose rows decide (default replug; top1 with "
                         "--metric gold_recall: gold-passage recall@1)")
