"""LSR temperature and KL-direction sweep on a tiny NQ setting (the research use the design
card names: "try other temperatures and objectives")."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class SweepConfig:
    base: str = "experiments/configs/lsr_nq.py:tiny"  # the LSR config every run starts from
    data_dir: str = ""  # a folder of train/dev/corpus.jsonl replacing the base's data
    gammas: tuple = (0.01, 0.1, 1.0)  # supervision temperature γ of P_R (Eq. 3)
    betas: tuple = (0.01, 0.1, 1.0)  # supervision temperature β of Q (Eq. 4)
    directions: tuple = ("retriever_to_lm", "lm_to_retriever")
    train_examples: int = 96  # the first N questions of the base config's training data
    dev_examples: int = 32  # and of its dev data; the corpus is their gold passages
    k: int = 4
    batch_size: int = 8
    total_steps: int = 12
    learning_rate: float = 1e-4
    workdir: str = "runs/temperature_sweep"


CONFIGS = {
    "default": SweepConfig(),
    "tiny": SweepConfig(gammas=(0.1, 1.0), betas=(0.1,), directions=("retriever_to_lm",),
                        train_examples=8, dev_examples=4, k=2, batch_size=4, total_steps=2),
    # The full grid on an accelerator with the paper's model sizes.
    "sweep_gpu": SweepConfig(base="experiments/configs/lsr_nq.py:nq_gpu", train_examples=0,
                             dev_examples=0, k=20, batch_size=64, total_steps=2000,
                             learning_rate=2e-5),
}
