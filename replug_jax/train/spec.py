"""The typed pieces of an LSR run that more than one trainer reads, readable without JAX:
what is minimised (:class:`ObjectiveConfig`, paper §4.1–4.3) and how (:class:`OptimConfig`,
§5.2). :class:`~replug_jax.train.config.LSRConfig` (the online trainer) and
:class:`~replug_jax.train.pool.PoolTrainConfig` (a pre-scored pool) both expose theirs as
``objective_config`` and ``optim_config``, and each training function takes the piece it reads.
"""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """The LSR loss: ``kl`` between P_R (Eq. 3, supervision temperature ``gamma``) and Q
    (Eq. 4, ``beta``) in ``direction`` (``retriever_to_lm``: KL(P_R‖Q), the paper's Eq. 5),
    or the ``marginal`` likelihood ``-log Σ_d P_R(d|x) p(y|d,x)`` (``gamma`` only); Q's
    branch score is the ``mean`` or ``sum`` of the continuation's token log-probs."""

    objective: str = "kl"
    direction: str = "retriever_to_lm"
    gamma: float = 0.1
    beta: float = 0.1
    lm_score: str = "mean"

    def __post_init__(self):
        for name, allowed in (("objective", ("kl", "marginal")),
                              ("direction", ("retriever_to_lm", "lm_to_retriever")),
                              ("lm_score", ("mean", "sum"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got "
                                 f"{getattr(self, name)!r}")
        if not (self.gamma > 0 and self.beta > 0):
            raise ValueError("gamma and beta must be > 0")
        if not marginal_score_ok(self.objective, self.lm_score):
            raise ValueError(MARGINAL_NEEDS_SUM)

    @classmethod
    def named(cls, name: str, gamma: float, beta: float, lm_score: str) -> "ObjectiveConfig":
        """From a study's objective name (:data:`OBJECTIVES`)."""
        if name not in OBJECTIVES:
            raise ValueError(f"objective must be one of {sorted(OBJECTIVES)}, got {name!r}")
        objective, direction = OBJECTIVES[name]
        return cls(objective, direction, gamma, beta, lm_score)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Adam or AdamW on a linear warmup over ``warmup_ratio`` of the steps to
    ``learning_rate`` then linear decay to 0, after global-norm clipping at ``grad_clip``
    (0: none); §5.2: Adam, 2e-5, 10 % warmup."""

    optimizer: str = "adam"
    learning_rate: float = 2e-5
    weight_decay: float = 0.0
    warmup_ratio: float = 0.1
    grad_clip: float = 1.0

    def __post_init__(self):
        if self.optimizer not in ("adam", "adamw"):
            raise ValueError(f"optimizer must be adam or adamw, got {self.optimizer!r}")
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
