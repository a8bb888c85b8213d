"""What the two LSR studies share (``lsr_study``: language modelling on WikiText;
``lsr_qa``: SQuAD and NQ): the variants of a grid (and a registered config's, by its rule),
their labels, the power of a paired test, the models a study's training config names, and
saved parameters."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from replug_jax.fileio import atomic_path, write_json_atomic
from replug_jax.train.config import LSRConfig
from replug_jax.train.export import base_training_data
from replug_jax.train.spec import OBJECTIVES, ObjectiveConfig
from replug_jax.train.refresh import flatten_params

# What every card and results page of a study trained from all-MiniLM-L6-v2 states (its model
# card, shipped with the packaged weights, lists the ~1.17B pairs it was trained on).
BASE_DATA = (base_training_data("minilm").rstrip(".")
             + ", and its supervision can only favour the base.")
BASE_DATA_LM = ("The base, all-MiniLM-L6-v2, was itself trained contrastively (by "
                "sentence-transformers) on about 1.17B text pairs (Reddit, S2ORC, WikiAnswers, "
                "PAQ, Stack Exchange, MS MARCO, and SQuAD 2.0, Natural Questions and TriviaQA "
                "(question, paragraph) pairs among others; its model card), none of them "
                "language-modelling windows.")

# z-values of a two-sided 5 % test with 80 % power: the smallest detectable effect is about
# (1.96 + 0.84) standard errors of the paired difference.
Z_ALPHA, Z_POWER = 1.959964, 0.841621


def variants(cfg) -> list[LSRConfig]:
    """The study's runs as configs of the one trainer: its training config (``cfg.train``,
    ``supervision="pool"``) with each objective × (γ, β) of its grid (the marginal likelihood
    has no β, and sums), its pools named ``<workdir>:train``/``:dev`` (the trainer is handed
    the pools themselves) and a checkpoint at every evaluation; then the shuffled-Q control of
    the first."""
    t, out, seen = cfg.train, [], set()
    pools = dataclasses.replace(t.supervision, train_pool=f"{cfg.workdir}:train",
                                dev_pool=f"{cfg.workdir}:dev")
    for gamma, beta in cfg.grid:
        for objective in cfg.objectives:
            key = (objective, gamma, None if objective == "marginal" else beta)
            if key in seen:  # the marginal likelihood has no β
                continue
            seen.add(key)
            kind, direction = OBJECTIVES[objective]
            marginal = objective == "marginal"
            out.append(dataclasses.replace(
                t, supervision=pools, checkpoint_every=t.selection.every or t.checkpoint_every,
                objective=dataclasses.replace(
                    t.objective, kind=kind, direction=direction, gamma=gamma,
                    beta=1.0 if marginal else beta,
                    lm_score="sum" if marginal else t.objective.lm_score)))
    if cfg.shuffled_control and out:  # the first variant again, on Q permuted within pools
        fixed = getattr(cfg, "control_steps", 0)  # a fixed budget: it cannot return the base
        control = dataclasses.replace(out[0].supervision, shuffle_q=True)
        out.append(dataclasses.replace(out[0], supervision=control, **(
            {"total_steps": fixed,
             "selection": dataclasses.replace(out[0].selection, metric="last")}
            if fixed else {})))
    return out


def study_models(train: LSRConfig):
    """``(lm, retriever)`` a study's training config names, the retriever cutting queries and
    passages at the config's lengths (so that its release states what the study encoded)."""
    from experiments.lib.common import load_lm
    from replug_jax.retrieval.encoder import Retriever

    r = train.retriever
    return (load_lm(train.lm.name, train.lm.max_context),
            Retriever.load(r.name, max_length=r.doc_max_length,
                           query_max_length=r.query_max_length))


REGISTERED_RULE = ("the finished temperature study's variant with the highest dev recall@1 at "
                   "its kept step; ties: the higher dev-pool log-likelihood, then its order")


def registered_variant(cfg):
    """``cfg`` with the variant its registration names by rule (``cfg.variant_from``: a
    finished temperature study's results JSON, ``experiments.lsr_temperature``): the variant
    with the highest dev recall@1 at its kept step, ties broken by the higher dev-pool
    log-likelihood, then by the study's order. Refused while that study is partial: the rule
    reads every variant or none."""
    path = pathlib.Path(cfg.variant_from)
    if not path.is_file():
        raise ValueError(f"variant_from={path}: no such results file; run "
                         "`python -m experiments.lsr_temperature` to the end first")
    study = json.loads(path.read_text())
    rows = study.get("rows") or []
    if "partial" in study.get("finished", "partial") or not rows:
        raise ValueError(f"variant_from={path}: the study is not finished "
                         f"({study.get('finished', 'no rows')}); the registered rule reads "
                         "every variant: finish it (`python -m experiments.lsr_temperature`)")
    best = max(enumerate(rows), key=lambda ir: (ir[1]["dev_recall@1"],
                                                ir[1]["dev_pool_loglik"], -ir[0]))[1]
    c = best["config"]  # the row's summary of its config (lsr_temperature.summarize)
    name = objective_name(ObjectiveConfig(c["objective"], c["direction"], c["gamma"],
                                          c["beta"], c["lm_score"]))
    return dataclasses.replace(cfg, objectives=(name,), grid=((c["gamma"], c["beta"]),),
                               train=cfg.train.updated({"objective.lm_score": c["lm_score"]}))


def trained_with(stored: dict | None, v: LSRConfig, models_in_config: bool = True) -> bool:
    """Whether a run saved with config ``stored`` (its JSON) was trained as ``v`` would be:
    the same fingerprint (what changes the trajectory) and the same budget.
    ``models_in_config=False``: a run saved before a study's config held its training config,
    whose record named the retriever and the LM but not the lengths, LM context and windows
    the study ran them at (the trainer takes those from the models it is handed): those are
    read as ``v``'s."""
    if not isinstance(stored, dict):
        return False
    old = run_config(stored)
    if old is None:  # a run of the retired pool trainer's config
        return False
    if not models_in_config:
        r = v.retriever
        old = dataclasses.replace(
            old, data=v.data, lm=dataclasses.replace(old.lm, max_context=v.lm.max_context),
            retriever=dataclasses.replace(old.retriever, query_max_length=r.query_max_length,
                                          doc_max_length=r.doc_max_length))
    return old.fingerprint() == v.fingerprint() and old.total_steps == v.total_steps


def run_config(record: dict) -> LSRConfig | None:
    """A study run's stored config (the tree, or the flat form of earlier runs), or None
    for a run of the retired pool trainer, whose config the one trainer does not read."""
    try:
        return LSRConfig.from_record(record)
    except ValueError:
        return None


def objective_name(objective: ObjectiveConfig) -> str:
    """The study's name of an objective (:data:`OBJECTIVES`)."""
    return next(n for n, (kind, d) in OBJECTIVES.items()
                if kind == objective.kind and (kind == "marginal" or d == objective.direction))


def label(v: LSRConfig) -> str:
    o = v.objective
    gamma = f"{o.gamma:g}" if isinstance(o.gamma, float) else o.gamma
    beta = (f"/β={o.beta:g}" if isinstance(o.beta, float) else f"/β={o.beta}") \
        if o.kind != "marginal" else ""
    # the studies before issue 66 ran KL on the mean (their labels name no Q); the sum, the
    # paper's Q, is named
    q = "/Q=sum" if o.lm_score == "sum" and o.kind != "marginal" else ""
    return f"{objective_name(o)}/γ={gamma}{beta}{q}" + (
        "/shuffled-Q control" if v.supervision.shuffle_q else "")


def slug(name: str) -> str:
    """A variant label as a file name."""
    return name.replace("/", "_").replace("=", "").replace("γ", "g").replace("β", "b")


def min_detectable(diff: dict) -> float:
    """The smallest true difference the paired test detects 80 % of the time: the interval's
    half-width is z_α standard errors."""
    return (diff["high"] - diff["low"]) / 2 / Z_ALPHA * (Z_ALPHA + Z_POWER)


def save_params(params, path: pathlib.Path, info: dict) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **flatten_params(params))
    write_json_atomic(info, path.with_suffix(".json"))
