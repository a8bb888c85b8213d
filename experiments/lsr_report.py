"""Summarise a finished REPLUG LSR work directory into ``experiments/results/lsr_nq/``: the
untrained vs trained retriever on dev (recall@1/5 of the gold passage, agreement of the
retriever's top document with the LM's best), the training curves (loss, P_R/Q agreement,
gradient norm; PNG), the LM-score cache and refresh figures, and the wall time.

Usage: ``python -m experiments.lsr_report --workdir runs/lsr_nq [--name default]
[--experiment lsr_nq|lsr_wikitext]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from experiments.lib.common import RESULTS, new_figure, provenance, run, save_figure, write_results
from experiments.lib.lsr_common import BASE_DATA, BASE_DATA_LM
from replug_jax.train.config import LSRConfig

DIFFERENCES_LM = (
    "The paper trains Contriever from GPT-3 Curie likelihoods on 800K Pile sequences (x = 128 "
    "tokens, y = the next 128; k = 20, batch 64, 25K steps, refresh every 3K). Here "
    "all-MiniLM-L6-v2 is trained from SmolLM2-135M likelihoods on windows of 42 WikiText-2 "
    "articles (the same objective and window sizes), with a corpus of 128-token passages of all "
    "62 articles plus NQ passages and Python docs, where an example never retrieves a passage "
    "of its own article (leakage='document'; the run before 2026-12-01 used the window-overlap "
    "filter), at the scale 2 CPU cores allow: k, batch and steps are far smaller. "
    + BASE_DATA_LM)

DIFFERENCES = (
    "The paper trains Contriever from GPT-3 Curie likelihoods on 800K Pile sequences (k = 20, "
    "batch 64, 25K steps, index refresh every 3K steps). Here all-MiniLM-L6-v2 is trained from "
    "SmolLM2-135M likelihoods on NQ questions (question → answer, the paper's QA variant of the "
    "objective) with the 624 gold passages as corpus, at the scale 2 CPU cores allow (see the "
    "config in the JSON): k, batch and steps are far smaller, so the effect is small. " + BASE_DATA)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=pathlib.Path, required=True, help="LSR work directory")
    ap.add_argument("--name", default="default", help="result name (the config variant)")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS, help="results root")
    ap.add_argument("--experiment", default="lsr_nq", choices=("lsr_nq", "lsr_wikitext"),
                    help="the results folder (and the paper comparison it states)")
    args = ap.parse_args(argv)
    config = json.loads((args.workdir / "config.json").read_text())
    log = [json.loads(x) for x in (args.workdir / "metrics.jsonl").read_text().splitlines()
           if x.strip()]
    if not log:
        raise SystemExit(f"{args.workdir}: no training steps logged")
    dev_path = args.workdir / "dev_metrics.json"
    dev = json.loads(dev_path.read_text()) if dev_path.exists() else {}
    initial, final = dev.get("initial") or {}, dev.get("final") or {}
    seconds = float(sum(r["step_seconds"] for r in log))
    quarter = max(len(log) // 4, 1)
    wait = float(sum(r["refresh_wait_seconds"] for r in log))
    prescore_path = args.workdir / "prescore.json"
    prescore = json.loads(prescore_path.read_text()) if prescore_path.exists() else None
    in_step = [r for r in log if r["lm_new_pairs"]]
    per_pair_step = (sum(r["lm_seconds"] for r in in_step)
                     / max(sum(r["lm_new_pairs"] for r in in_step), 1)) if in_step else None
    table = [(metric, f"{initial.get(metric, float('nan')):.3f}",
              f"{final.get(metric, float('nan')):.3f}")
             for metric in sorted(set(initial) | set(final)) if metric != "examples"]
    payload = {"config": config["config"], "dev": dev, "steps": len(log),
               "loss_first": log[0]["loss"], "loss_last": log[-1]["loss"],
               "loss_first_quarter": float(np.mean([r["loss"] for r in log[:quarter]])),
               "loss_last_quarter": float(np.mean([r["loss"] for r in log[-quarter:]])),
               "argmax_agreement_mean": float(np.mean([r["argmax_agreement"] for r in log])),
               "lm_new_pairs": int(sum(r["lm_new_pairs"] for r in log)),
               "lm_seconds": float(sum(r["lm_seconds"] for r in log)),
               "train_seconds": seconds, "refresh_wait_fraction": wait / max(seconds, 1e-9),
               "index_versions": sorted({r["index_version"] for r in log}),
               "prescore": prescore, "lm_seconds_per_pair_in_steps": per_pair_step,
               "lm_seconds_per_step": float(np.mean([r["lm_seconds"] for r in log])),
               "seconds": seconds, "provenance": provenance()}
    cfg = LSRConfig.from_record(config["config"])
    cost = (f" Supervision: {payload['lm_seconds_per_step']:.1f} s of LM scoring per step"
            + (f"; the candidate pool (top-{prescore['pool']} of {prescore['examples']} "
               f"examples, {prescore['new_pairs']} pairs) was scored up front in "
               f"{prescore['seconds']:.0f} s "
               f"({prescore['seconds'] / max(prescore['new_pairs'], 1):.2f}"
               " s per pair)" if prescore else "")
            + (f"; pairs scored inside steps cost {per_pair_step:.2f} s each"
               if per_pair_step else "; no pair had to be scored inside a step") + ".")
    out = write_results(
        args.experiment, args.name, payload, table, ("dev metric", "untrained retriever",
                                              "after LSR"),
        notes=(f"{len(log)} steps of batch {cfg.batch_size}, k={cfg.k}, "
               f"γ={cfg.objective.gamma}, β={cfg.objective.beta}, {cfg.objective.direction}, "
               f"lr {cfg.optim.learning_rate}; loss "
               f"{payload['loss_first_quarter']:.4f} (first quarter) → "
               f"{payload['loss_last_quarter']:.4f} (last quarter); {payload['lm_new_pairs']} "
               f"LM-scored pairs ({payload['lm_seconds']:.0f} s of {seconds:.0f} s); refresh "
               f"wait {100 * payload['refresh_wait_fraction']:.1f} % of step time; index "
               f"versions {payload['index_versions']}. Dev: {initial.get('examples', '?')} "
               "examples; `top1_is_lm_best` = the retriever's top document is the one the LM "
               "scores best among the retrieved." + cost),
        root=args.out, differences=DIFFERENCES if args.experiment == "lsr_nq"
        else DIFFERENCES_LM)
    steps = [r["step"] for r in log]
    fig, axes = new_figure(3, figsize=(11, 3))
    for ax, key, label in zip(axes, ("loss", "argmax_agreement", "grad_norm"),
                              ("LSR loss (KL)", "P_R / Q argmax agreement", "gradient norm")):
        ax.plot(steps, [r[key] for r in log], lw=1)
        ax.set_xlabel("step")
        ax.set_title(label, fontsize=9)
    save_figure(fig, out / f"{args.name}.png")


if __name__ == "__main__":
    run(main)
