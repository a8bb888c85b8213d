"""What the two LSR studies share (``lsr_study``: language modelling on WikiText;
``lsr_qa``: SQuAD and NQ): the variants of a grid, their labels, the power of a paired test,
and saved parameters."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from replug_jax.fileio import atomic_path, write_json_atomic
from replug_jax.train.pool import PoolTrainConfig
from replug_jax.train.refresh import flatten_params

# z-values of a two-sided 5 % test with 80 % power: the smallest detectable effect is about
# (1.96 + 0.84) standard errors of the paired difference.
Z_ALPHA, Z_POWER = 1.959964, 0.841621


def variants(cfg) -> list[PoolTrainConfig]:
    out, seen = [], set()
    for gamma, beta in cfg.grid:
        for objective in cfg.objectives:
            key = (objective, gamma, None if objective == "marginal" else beta)
            if key in seen:  # the marginal likelihood has no β
                continue
            seen.add(key)
            out.append(PoolTrainConfig(
                objective=objective, gamma=gamma, beta=beta, k=cfg.k,
                lm_score="sum" if objective == "marginal" else cfg.lm_score,  # its only score
                steps=cfg.steps, batch_size=cfg.batch_size, learning_rate=cfg.learning_rate,
                refresh_every=cfg.refresh_every, eval_every=cfg.eval_every,
                patience=cfg.patience, eval_temperature=cfg.eval_temperature,
                towers=getattr(cfg, "towers", "shared"), seed=cfg.seed))
    if cfg.shuffled_control and out:  # the first variant again, on Q permuted within pools
        out.append(dataclasses.replace(out[0], shuffle_q=True))
    return out


def label(v: PoolTrainConfig) -> str:
    beta = f"/β={v.beta:g}" if v.objective != "marginal" else ""
    return f"{v.objective}/γ={v.gamma:g}{beta}" + ("/shuffled-Q control" if v.shuffle_q else "")


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
