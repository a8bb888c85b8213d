"""One way to run a pool study (paper §4, LSR on pre-scored pools): pools → variants →
choice on dev → end-to-end test → release rule → report, for any *task* that implements the
few steps that differ (``lsr_study.WindowsTask``: language-modelling windows;
``lsr_qa.QATask``: SQuAD and NQ questions). A new study is a task and a config, not a script.

A task is a class with:

* ``open(cfg, args)`` (classmethod): the models, data and work folder; ``add_args(ap)``
  (optional staticmethod): its own command-line options;
* ``build_pools()``: the base retriever's candidates of every example, scored once by the LM
  (resumable); ``pools_summary()``: lines printed by ``--stage pools``;
* ``diagnostics() -> (dict, stop)``: what is measured before training at no LM cost, and
  whether the study stops there;
* ``folds()``: the :class:`Fold` s the variants are trained and tested in;
* ``measure(fold, params) -> dict``: what each trained run stores beside its curve;
* ``choose(fold, runs) -> name`` and ``test(fold, runs, chosen) -> result``;
* ``summarize(results, diagnostics) -> (payload, release_params)``: the payload holds
  ``passes`` (the release rule) and ``chosen``; ``card(payload) -> (settings, text)``;
  ``report(payload)``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Callable

import numpy as np

from experiments.lib.common import parse_experiment_args, provenance
from experiments.lib.lsr_common import label, save_params, slug, trained_with, variants
from replug_jax.fileio import write_json_atomic
from replug_jax.process import Timer
from replug_jax.train.refresh import unflatten_params


@dataclasses.dataclass
class Fold:
    """One training and test split of a study: its pools and examples per split
    (``"train"``, ``"dev"``, ``"test"``), where its runs are kept, and how a run is selected
    (``dev_recall``: recall@1 of the dev questions over the whole datastore, or None for the
    dev pool's curve). ``reuse_only``: the runs are another config's, read and never trained."""
    index: int
    pools: dict
    examples: dict
    run_dir: pathlib.Path
    dev_recall: Callable | None = None
    reuse_only: bool = False

    @property
    def work(self) -> pathlib.Path:
        """The fold's work folder (its runs are in ``run_dir`` under it): what its test
        scores and generates is kept there."""
        return self.run_dir.parent


def stage_args(ap) -> None:
    ap.add_argument("--stage", choices=("pools", "train", "primary", "all"), default="all",
                    help="pools: build the datastore and score every pool (resumable), then "
                         "stop before any training; train: the pools, then train every "
                         "variant and stop before the test (with --pool-sets train,dev while "
                         "another process scores the test pool); primary: a recall study's "
                         "primary endpoint alone (it needs no LM pair), written as a partial "
                         "result while the test's LM pairs are scored; all: the whole study")


def run_params(retriever, fold: Fold, name: str):
    """The kept parameters of run ``name`` in ``fold`` (``runs/<slug>.npz``)."""
    path = fold.run_dir / f"{slug(name)}.npz"
    if not path.exists():
        raise ValueError(f"{path}: no trained parameters of {name}; delete {fold.run_dir} "
                         "and rerun")
    return unflatten_params(dict(np.load(path, allow_pickle=False)), retriever.params)


def train_variants(task, fold: Fold, on_run=None, only_finished: bool = False) -> dict:
    """Every variant of the config's grid trained on the fold's train pool by the one trainer
    (:class:`~replug_jax.train.loop.LSRTrainer`, ``supervision="pool"``, each in its own
    resumable work folder under ``run_dir``), or its finished run read back when it was
    trained with the same settings: name → the run's JSON (config, temperatures, steps,
    curve, seconds and what ``task.measure`` adds); the kept parameters are in
    ``run_dir/<slug>.npz``; ``on_run(path, runs)`` after each run is written (its JSON's
    path, the runs so far); ``only_finished``: train nothing, return the finished runs."""
    from replug_jax.train.loop import LSRTrainer

    runs = {}
    fold.run_dir.mkdir(parents=True, exist_ok=True)
    for v in variants(task.cfg):
        name = label(v)
        out = fold.run_dir / f"{slug(name)}.json"
        row = json.loads(out.read_text()) if out.exists() else {}
        if trained_with(row.get("config"), v, row.get("models_in_config", False)):
            runs[name] = row
            continue
        if only_finished:
            continue
        if fold.reuse_only:
            raise ValueError(f"{out}: no trained run of {name}; run the config whose work "
                             "this one reuses (work=) first")
        with Timer() as sw:
            trainer = LSRTrainer(v, fold.run_dir / slug(name), retriever=task.retriever,
                                 lm_scorer=None, passages=list(task.by_id.values()),
                                 train=fold.examples["train"], dev=fold.examples["dev"],
                                 progress=task.progress,
                                 pools=(fold.pools["train"], fold.pools["dev"]),
                                 frozen_docs=task.frozen, dev_recall=fold.dev_recall)
            fit = trainer.run()
            _, params = trainer.best_params()
        save_params(params, out.with_suffix(".npz"), {"variant": name})
        row = {"config": v.to_json(), "models_in_config": True,
               "temperatures": fit["temperatures"],
               "best_step": fit["best_step"], "steps_run": fit["step"], "curve": fit["curve"],
               "seconds": round(sw.seconds, 1), **task.measure(fold, params)}
        write_json_atomic(row, out)
        runs[name] = row
        if on_run is not None:
            on_run(out, runs)
    return runs


def release(run_dir: pathlib.Path, out_dir, settings: dict, card: str) -> pathlib.Path:
    """A study's chosen run released by the writer every user runs (`replug
    export-retriever`): its kept step in float16 (two towers when the query tower alone
    learned), the weights' SHA-256 in the card, which the study's result (``card`` below
    its title) leads, and the τ fitted on dev in ``replug.json``."""
    from replug_jax.retrieval import fitted_tau
    from replug_jax.train.export import export_run, record_temperature

    body = card.split("\n", 1)[1] if card.startswith("# ") else card
    out, _, _ = export_run(run_dir, out_dir, lead=body)
    tau = fitted_tau.in_settings(settings)
    if tau is not None:
        record_temperature(out, tau["temperature"], tau["fit"],
                           f"τ = {tau['temperature']:g}, fitted by the study on its dev "
                           "questions (REPLUG then uses it by default).")
    return out


def run_study(task_type, argv, doc: str, configs: dict) -> None:
    """Parse the command line, then run the study ``task_type`` describes: pools
    (``--stage pools`` stops there), diagnostics, per fold the variants, the choice on dev
    and the test, the summary, the release when its rule passes, and the report."""
    def extra(ap):
        stage_args(ap)
        if hasattr(task_type, "add_args"):
            task_type.add_args(ap)

    args, cfg = parse_experiment_args(argv, doc, configs, extra=extra)
    with Timer() as sw:
        task = task_type.open(cfg, args)
        task.build_pools()
        if args.stage == "pools":
            print("\n".join(task.pools_summary()), flush=True)
            return
        if args.stage == "primary":
            if not hasattr(task, "primary"):
                raise SystemExit(f"--stage primary: {type(task).__name__} has no primary "
                                 "endpoint that needs no LM pair")
            task.primary([(fold, train_variants(task, fold, only_finished=True))
                          for fold in task.folds()])
            return
        if args.stage == "train":
            for fold in task.folds():
                runs = train_variants(task, fold)
                print(f"fold {fold.index}: trained {', '.join(runs)} (chosen on dev: "
                      f"{task.choose(fold, runs)}); no test was run", flush=True)
            return
        diagnostics, stop = task.diagnostics()
        if stop:
            return
        tested = []
        for fold in task.folds():
            runs = train_variants(task, fold)
            chosen = task.choose(fold, runs)
            tested.append(task.test(fold, runs, chosen))
        payload, params = task.summarize(tested, diagnostics)
    payload.update(seconds=sw.seconds, provenance=provenance())
    if payload["passes"] and cfg.release and params is not None:
        settings, card = task.card(payload)
        payload["released"] = str(release(fold.run_dir / slug(payload["chosen"]),
                                          cfg.release, settings, card))
    task.report(payload)
