"""The typed pieces of an LSR run, readable without JAX: what is minimised
(:class:`ObjectiveConfig`, paper §4.1–4.3) and how (:class:`OptimConfig`, §5.2).
:class:`~replug_jax.train.config.LSRConfig` holds them as ``objective`` and ``optim`` beside
its other pieces, and each training function takes the piece it reads.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from replug_jax.config import choice_errors

MARGINAL_NEEDS_SUM = ("objective 'marginal' needs lm_score 'sum': the marginal likelihood "
                      "sum_d P_R(d|x) p(y|d,x) is over whole-continuation probabilities, not "
                      "per-token means")

# the names the studies give the objectives -> (objective, direction)
OBJECTIVES = {"kl_retriever_to_lm": ("kl", "retriever_to_lm"),
              "kl_lm_to_retriever": ("kl", "lm_to_retriever"),
              "marginal": ("marginal", "retriever_to_lm")}


def marginal_score_ok(objective: str, lm_score: str) -> bool:
    """The one rule every LSR trainer checks: the marginal likelihood needs summed token
    log-probs (``log p(y|d,x)``), never their mean."""
    return objective != "marginal" or lm_score == "sum"


# γ and β as research variables (issue 66): a number, or a name resolved before training
GAMMA_NAMES = ("fitted", "learned")
BETA_NAMES = ("fitted",)
LM_SCORE_MEAN_NOTE = ("lm_score='mean' (Q from the mean per-token log-probability) is a named "
                      "alternate, not the paper's Q: the paper's Q(d|x,y) uses P_LM(y|d,x), the "
                      "continuation's probability (the sum); the mean exists for long "
                      "continuations whose summed scores span hundreds of nats, where Q at "
                      "β = 0.1 would be one-hot, and it flattens Q on 128-token windows")


def _temperature_ok(value, names) -> bool:
    if isinstance(value, str):
        return value in names
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """The LSR loss (``kind``): ``kl`` between P_R (Eq. 3, supervision temperature ``gamma``) and Q
    (Eq. 4, ``beta``) in ``direction`` (``retriever_to_lm``: KL(P_R‖Q), the paper's Eq. 5),
    or the ``marginal`` likelihood ``-log Σ_d P_R(d|x) p(y|d,x)`` (``gamma`` only).

    ``gamma``: a number; ``"fitted"``, the base retriever's τ fitted on the dev pools (the τ
    REPLUG infers at); or ``"learned"``, a trainable log-temperature beside the encoder
    (started at the fitted τ, Adam at ``gamma_learning_rate``), as CLIP and
    sentence-transformers scale cosine logits. ``beta``: a number or ``"fitted"`` (the β at
    which Q over the base retriever's top-k is nearest to P_R at the fitted τ on the dev pools:
    the loss then measures disagreement in ranking, not in sharpness). Names are resolved by
    the trainer (:meth:`resolved`) before the step is built. Q's branch score is the ``sum``
    of the continuation's token log-probs, ``log P_LM(y|d,x)`` as the paper writes it, or their
    ``mean`` (:data:`LM_SCORE_MEAN_NOTE`)."""

    kind: Literal["kl", "marginal"] = "kl"
    direction: Literal["retriever_to_lm", "lm_to_retriever"] = "retriever_to_lm"
    gamma: float | str = 0.1
    beta: float | str = 0.1
    lm_score: Literal["mean", "sum"] = "sum"
    gamma_learning_rate: float = 1e-3

    def __post_init__(self):
        for message in choice_errors(self):
            raise ValueError(message)
        if not _temperature_ok(self.gamma, GAMMA_NAMES):
            raise ValueError(f"gamma must be > 0 or one of {GAMMA_NAMES}, got {self.gamma!r}")
        if not _temperature_ok(self.beta, BETA_NAMES):
            raise ValueError(f"beta must be > 0 or one of {BETA_NAMES}, got {self.beta!r}")
        if not self.gamma_learning_rate > 0:
            raise ValueError("gamma_learning_rate must be > 0")
        if not marginal_score_ok(self.kind, self.lm_score):
            raise ValueError(MARGINAL_NEEDS_SUM)

    @property
    def learns_gamma(self) -> bool:
        return self.gamma == "learned"

    @property
    def needs_fit(self) -> bool:
        """Whether γ or β is named and must be fitted on dev pools before training."""
        return isinstance(self.gamma, str) or isinstance(self.beta, str)

    def resolved(self, tau: float | None = None, beta: float | None = None
                 ) -> "ObjectiveConfig":
        """This objective with numbers in place of names: ``tau`` (the fitted τ) for
        ``gamma="fitted"`` and as the start of ``"learned"`` (kept as the name's
        ``learns_gamma`` flag: the step then reads γ from the state), ``beta`` for
        ``beta="fitted"``."""
        gamma, b = self.gamma, self.beta
        if isinstance(gamma, str):
            if tau is None:
                raise ValueError(f"gamma={gamma!r} needs a τ fitted on dev pools")
            gamma = float(tau)
        if isinstance(b, str):
            if beta is None:
                raise ValueError("beta='fitted' needs dev pools to fit it on")
            b = float(beta)
        return ResolvedObjective(self.kind, self.direction, gamma, b, self.lm_score,
                                 self.gamma_learning_rate, learned=self.learns_gamma)

    @classmethod
    def named(cls, name: str, gamma, beta, lm_score: str) -> "ObjectiveConfig":
        """From a study's objective name (:data:`OBJECTIVES`)."""
        if name not in OBJECTIVES:
            raise ValueError(f"objective must be one of {sorted(OBJECTIVES)}, got {name!r}")
        objective, direction = OBJECTIVES[name]
        return cls(objective, direction, gamma, beta, lm_score)


@dataclasses.dataclass(frozen=True)
class ResolvedObjective(ObjectiveConfig):
    """An objective whose γ and β are numbers (``learned``: γ is trained, from ``gamma``)."""

    learned: bool = False

    @property
    def learns_gamma(self) -> bool:
        return self.learned


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Adam or AdamW on a linear warmup over ``warmup_ratio`` of the steps to
    ``learning_rate`` then linear decay to 0, after global-norm clipping at ``grad_clip``
    (0: none); §5.2: Adam, 2e-5, 10 % warmup."""

    optimizer: Literal["adam", "adamw"] = "adam"
    learning_rate: float = 2e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1
    grad_clip: float = 1.0

    def __post_init__(self):
        for message in choice_errors(self):
            raise ValueError(message)
        if not self.learning_rate > 0:
            raise ValueError("learning_rate must be > 0")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError("warmup_ratio must be in [0, 1)")

    def schedule(self, num_steps: int):
        """The learning rate at each step (an ``optax`` schedule)."""
        import optax

        warmup = max(int(self.warmup_ratio * num_steps), 1)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, self.learning_rate, warmup),
             optax.linear_schedule(self.learning_rate, 0.0, max(num_steps - warmup, 1))],
            [warmup])

    def build(self, num_steps: int):
        """The ``optax`` transformation for a run of ``num_steps`` steps."""
        import optax

        schedule = self.schedule(num_steps)
        opt = (optax.adamw(schedule, weight_decay=self.weight_decay)
               if self.optimizer == "adamw" else optax.adam(schedule))
        chain = [optax.clip_by_global_norm(self.grad_clip)] if self.grad_clip > 0 else []
        return optax.chain(*chain, opt)
