"""The LSR temperature study (``experiments/lsr_temperature.py``, issue 66): the training
temperatures as research variables, on pools already scored (no new LM pair).

γ (the retriever's temperature in P_R, Eq. 3) ∈ {fitted: the base's τ fitted on the dev pool,
the τ REPLUG infers at; 0.05; 0.1, the paper's; 1, the earlier studies'; learned: a trainable
log-temperature started at the fitted τ} × β (Q's, Eq. 4) ∈ {1 on the summed log-probability,
which makes Q the posterior p(d|x,y) under a uniform prior; fitted: Q nearest the base's P_R
at the fitted τ} × {KL(P_R‖Q), the paper's Eq. 5; the marginal likelihood (no β)}; Q from
the continuation's summed log-probabilities (the paper's P_LM(y|d,x)). Every variant is
trained by the one trainer on ``confirm_recall``'s train pools (4,800 questions of 100 SQuAD
train articles × the base's top-8, all in its carry folder) for a fixed budget, its dev curve
read every ``eval_every`` steps: recall@1 over the whole datastore (46,737 passages) of
``recall_dev`` questions of the 40 held-out dev articles, and REPLUG's log-likelihood of the
gold answers within the dev pools (320 questions) at the τ fitted at that point.
"""

import dataclasses
import typing

from experiments.configs.lsr_qa import RECALL, TINY, TRAIN
from replug_jax.train.config import LSRConfig

# Every variant's training config but its objective (γ, β and the objective come from the
# grid): lsr_qa's, with Q from the summed log-probability, a fixed budget read every 100
# steps, and the step kept by dev recall@1 over the datastore among the steps whose dev-pool
# log-likelihood (at the τ fitted then) is not below the base's (confirm_recall's guard).
STUDY = {"objective.lm_score": "sum", "selection.patience": 0, **RECALL}


@dataclasses.dataclass(frozen=True)
class TemperatureStudyConfig:
    # the study's names before it held a training config -> their place in `train`
    RENAMED: typing.ClassVar[dict] = {
        "lm_score": "train.objective.lm_score", "steps": "train.total_steps",
        "eval_every": "train.selection.every", "batch_size": "train.batch_size",
        "learning_rate": "train.optim.learning_rate", "select_on": "train.selection.metric"}

    study: str = "confirm_recall"  # the lsr_qa config whose train and dev pools are read
    carry: str = "experiments/results/lsr_qa/confirm_recall_carry"  # its scored pairs
    train: LSRConfig = dataclasses.field(default_factory=lambda: TRAIN.updated(
        {**STUDY, "total_steps": 1000, "selection.every": 100}))
    gammas: tuple = ("fitted", 0.05, 0.1, 1.0, "learned")
    betas: tuple = (1.0, "fitted")
    objectives: tuple = ("kl_retriever_to_lm", "marginal")
    recall_dev: int = 4000  # dev questions whose recall@1 over the datastore is read
    bootstrap_resamples: int = 2000
    workdir: str = "runs/lsr_qa"  # the lsr_qa work root (its index and pools are reused)
    seed: int = 0  # the study's draws (articles, examples); train.seed orders the batches
    # lsr_qa overrides for the tiny CI variant ("key=value" strings)
    study_overrides: tuple = ()


CONFIGS = {
    "default": TemperatureStudyConfig(),
    # an accelerator: the same pools at confirm_recall's budget (3,000 steps), every dev
    # question's recall@1 read every 100 steps
    "gpu": TemperatureStudyConfig(train=TRAIN.updated(
        {**STUDY, "total_steps": 3000, "selection.every": 100, "batch_size": 64}),
        recall_dev=0),
    # CI: the design on lsr_qa's tiny config (a few questions, two γ, a few steps)
    "tiny": TemperatureStudyConfig(study="tiny", carry="", gammas=("fitted", "learned"),
                                   betas=(1.0, "fitted"), recall_dev=6,
                                   train=TINY.updated(STUDY),
                                   bootstrap_resamples=200, workdir="runs/lsr_qa_tiny"),
}
