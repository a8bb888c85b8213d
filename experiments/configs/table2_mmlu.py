"""Table 2 (5-shot MMLU) at laptop scale: a few subjects per category, with and without
retrieval, on whatever Wikipedia text is available offline."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class MMLUConfig:
    retriever: str = "minilm"
    lm: str = "smollm2"
    lsr_retriever: str | None = None
    # One subject per Table 2 category by default (all 57: subjects=[]).
    subjects: tuple = ("astronomy", "prehistory", "high_school_geography", "nutrition")
    questions_per_subject: int = 6  # the first N test questions (0 = all)
    shots: int = 5  # paper: 5-shot
    corpus: str = "nq_passages"  # nq_passages | wikitext | both (no Wikipedia dump offline)
    k: int = 3  # paper: 10
    temperature: float = 1.0  # the retrieval temperature τ of λ = softmax(s/τ) (paper: 1)
    query_with_options: bool = False  # retrieval query: the question (+ its four options)
    modes: tuple = ("none", "replug")
    max_context: int = 1536
    seed: int = 0


CONFIGS = {
    "default": MMLUConfig(),
    "tiny": MMLUConfig(subjects=("astronomy",), questions_per_subject=2, shots=1, k=2,
                       max_context=512),
    # The paper's setting on an accelerator: all 57 subjects, top-10, a 1B+ LM.
    "mmlu_gpu": MMLUConfig(retriever="facebook/contriever", lm="meta-llama/Llama-3.2-1B",
                           subjects=(), questions_per_subject=0, k=10, corpus="both",
                           max_context=4096),
}
