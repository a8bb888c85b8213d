"""LSR with the supervision temperatures γ (of P_R) and β (of Q) ∈ {0.01, 0.1, 1.0} and both KL
directions, on a tiny NQ setting: what the temperatures of paper §4 do to training.

Every run starts from the same retriever, data order and seed and differs only in (γ, β,
direction). The frozen LM's scores do not depend on them, so every run reads and writes one
score store (``supervision.lm_scores``): only the first run pays for the LM. Reported per
run: the loss at the first and last step, the P_R/Q argmax agreement, the entropy of P_R,
and dev recall@1/5 and agreement after training (the untrained retriever's are the same for
every run). The index is not refreshed within these short runs.
Usage: ``python -m experiments.temperature_sweep [--config tiny]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import pathlib
import shutil

import numpy as np

from experiments.lib.common import (
    add_standard_args,
    load_lm,
    new_figure,
    pick_config,
    provenance,
    run,
    save_figure,
    write_results,
)
from experiments.configs.temperature_sweep import CONFIGS
from experiments.lib.lsr_common import BASE_DATA
from replug_jax.retrieval.encoder import Retriever
from replug_jax.process import Timer
from replug_jax.train.config import load_config
from replug_jax.train.spec import ObjectiveConfig
from replug_jax.fileio import read_jsonl
from replug_jax.train.data import qa_examples, read_demonstrations
from replug_jax.train.loop import LSRTrainer
from replug_jax.train.assemble import load_passages

DIFFERENCES = (
    "The paper trains with γ = β = 0.1 (its §5.2 values) and KL(P_R ‖ Q) only, on 800K Pile "
    "sequences for 25K steps. This sweep is a tiny NQ setting (tens of questions, a few "
    "optimizer steps at a raised learning rate, no index refresh), meant to show the direction "
    "of each effect and to exercise the research workflow, not to rank settings. " + BASE_DATA)


def subset_data(base, sweep, folder: pathlib.Path):
    """Train/dev JSONL with the first N questions each and a corpus of their gold passages
    (ids renumbered), written to ``folder``; returns the three paths."""
    folder.mkdir(parents=True, exist_ok=True)
    train = read_jsonl(base.data.train)
    dev = read_jsonl(base.data.dev)
    if sweep.train_examples:
        train = train[:sweep.train_examples]
    if sweep.dev_examples:
        dev = dev[:sweep.dev_examples]
    if not sweep.train_examples and not sweep.dev_examples:
        return base.data.train, base.data.dev, base.data.corpus
    passages = load_passages(base.data)
    gold = sorted({int(r["gold_doc"]) for r in train + dev})
    new_id = {g: i for i, g in enumerate(gold)}
    paths = {name: folder / f"{name}.jsonl" for name in ("train", "dev", "corpus")}
    for name, rows in (("train", train), ("dev", dev)):
        paths[name].write_text("".join(json.dumps({**r, "gold_doc": new_id[int(r["gold_doc"])]})
                                       + "\n" for r in rows))
    paths["corpus"].write_text("".join(json.dumps({"id": str(i), "text": passages[g].text}) + "\n"
                                       for i, g in enumerate(gold)))
    return str(paths["train"]), str(paths["dev"]), str(paths["corpus"])


def sweep_base(sweep, root: pathlib.Path):
    """The LSR config every run of the sweep shares (its data subset under ``root``)."""
    base, _ = load_config(sweep.base)
    if sweep.data_dir:
        folder = pathlib.Path(sweep.data_dir)
        shots = folder / "demonstrations.jsonl"  # prepare.nq writes it beside the splits
        base = dataclasses.replace(base, data=dataclasses.replace(
            base.data, train=str(folder / "train.jsonl"), dev=str(folder / "dev.jsonl"),
            corpus=str(folder / "corpus.jsonl"),
            qa_demonstrations=str(shots) if shots.exists() else ""))
    train_path, dev_path, corpus_path = subset_data(base, sweep, root / "data")
    return dataclasses.replace(
        base, data=dataclasses.replace(base.data, train=train_path, dev=dev_path,
                                       corpus=corpus_path),
        k=sweep.k, batch_size=sweep.batch_size, total_steps=sweep.total_steps,
        retrieval=dataclasses.replace(base.retrieval, refresh_every=sweep.total_steps,
                                      refresh_mode="sync"),
        checkpoint_every=sweep.total_steps,
        supervision=dataclasses.replace(base.supervision, lm_scores=str(root / "lm_scores")),
        optim=dataclasses.replace(base.optim, learning_rate=sweep.learning_rate), num_devices=1)


def grid(sweep, base: ObjectiveConfig) -> list[ObjectiveConfig]:
    """The swept objectives: ``base`` at every (direction, γ, β) of the sweep, in that order."""
    return [dataclasses.replace(base, direction=direction, gamma=gamma, beta=beta)
            for direction, gamma, beta in itertools.product(sweep.directions, sweep.gammas,
                                                            sweep.betas)]


def train_one(cfg, workdir: pathlib.Path, lm, passages, train, dev, progress: bool) -> dict:
    """One (direction, γ, β) run from the shared start (its LM scores in the sweep's one
    store): the summary row of its metrics."""
    retriever = Retriever.load(cfg.retriever.name, similarity=cfg.retriever.similarity,
                               max_length=cfg.retriever.doc_max_length)
    trainer = LSRTrainer(cfg, workdir, retriever=retriever, lm_scorer=lm, passages=passages,
                         train=train, dev=dev, progress=progress)
    result = trainer.run()
    log = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    dev_metrics = json.loads((workdir / "dev_metrics.json").read_text())
    return {"direction": cfg.objective.direction, "gamma": cfg.objective.gamma,
            "beta": cfg.objective.beta,
            "loss_first": log[0]["loss"], "loss_last": log[-1]["loss"],
            "agreement_mean": float(np.mean([r["argmax_agreement"] for r in log])),
            "entropy_p_r_last": log[-1].get("entropy_retriever"),
            "dev_initial": dev_metrics.get("initial"), "dev_final": dev_metrics.get("final"),
            "lm_cache_hits": result["lm_cache_hits"],
            "lm_cache_misses": result["lm_cache_misses"]}


def plot(sweep, runs: list[dict], path: pathlib.Path) -> None:
    """Each direction's loss decrease over the (γ, β) grid."""
    dirs = list(sweep.directions)
    fig, axes = new_figure(len(dirs), figsize=(4.2 * len(dirs), 3.4), squeeze=False)
    for ax, direction in zip(axes[0], dirs):
        grid = np.full((len(sweep.gammas), len(sweep.betas)), np.nan)
        for r in runs:
            if r["direction"] == direction:
                grid[sweep.gammas.index(r["gamma"]), sweep.betas.index(r["beta"])] = (
                    r["loss_first"] - r["loss_last"])
        im = ax.imshow(grid, cmap="viridis")
        ax.set_xticks(range(len(sweep.betas)), [str(b) for b in sweep.betas])
        ax.set_yticks(range(len(sweep.gammas)), [str(g) for g in sweep.gammas])
        ax.set_xlabel("β (supervision temperature of Q)")
        ax.set_ylabel("γ (supervision temperature of P_R)")
        ax.set_title(f"loss decrease, {direction}", fontsize=9)
        fig.colorbar(im, ax=ax)
    save_figure(fig, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_standard_args(ap, CONFIGS)
    ap.add_argument("--fresh", action="store_true",
                    help="delete the sweep's work directory first (default: finished runs "
                         "are reused, so an interrupted sweep resumes)")
    args = ap.parse_args(argv)
    sweep = pick_config(CONFIGS, args.config, args.set)
    root = pathlib.Path(sweep.workdir) / args.config
    if args.fresh and root.exists():
        shutil.rmtree(root)
    common = sweep_base(sweep, root)
    lm = load_lm(common.lm.name, common.lm.max_context)
    passages = load_passages(common.data)
    shots = (read_demonstrations(common.data.qa_demonstrations)
             if common.data.qa_demonstrations else [])
    train, dev = qa_examples(common.data.train, shots), qa_examples(common.data.dev, shots)
    with Timer() as sw:
        runs = [train_one(dataclasses.replace(common, objective=objective),
                          root / f"{objective.direction}_g{objective.gamma}_b{objective.beta}",
                          lm, passages, train, dev, not args.no_progress)
                for objective in grid(sweep, common.objective)]
    table = [(r["direction"], r["gamma"], r["beta"], f"{r['loss_first']:.4f}",
              f"{r['loss_last']:.4f}", f"{r['agreement_mean']:.2f}",
              f"{r['dev_final'].get('recall@1', float('nan')):.3f}",
              f"{r['dev_final'].get('recall@5', float('nan')):.3f}",
              f"{r['dev_final'].get('top1_is_lm_best', float('nan')):.3f}") for r in runs]
    initial = runs[0]["dev_initial"] or {}
    payload = {"config": dataclasses.asdict(sweep), "base": common.to_json(), "runs": runs,
               "seconds": sw.seconds, "provenance": provenance()}
    out = write_results(
        "temperature_sweep", args.config, payload, table,
        ("direction", "γ", "β", "loss (first step)", "loss (last step)", "P_R/Q agreement",
         "dev recall@1", "dev recall@5", "dev top-1 = LM best"),
        notes=(f"{len(train)} train / {len(dev)} dev questions, {len(passages)} passages, "
               f"k={common.k}, batch {common.batch_size}, {common.total_steps} steps, lr "
               f"{common.optim.learning_rate}; untrained retriever on dev: recall@1 "
               f"{initial.get('recall@1', float('nan')):.3f}, recall@5 "
               f"{initial.get('recall@5', float('nan')):.3f}, top-1 = LM best "
               f"{initial.get('top1_is_lm_best', float('nan')):.3f}; {sw.seconds:.0f} s."),
        root=args.out, differences=DIFFERENCES)
    plot(sweep, runs, out / f"{args.config}.png")


if __name__ == "__main__":
    run(main)
