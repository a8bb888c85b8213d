"""The retrieval temperature τ of λ = softmax(s / τ) (paper §3.2), swept from cached branches.

``retrievers`` are ``label=source`` pairs (a packaged name, a hub id or an exported folder).
NQ: the dev questions, 4-shot prompts, gold-answer log-likelihood; τ is fitted on the same dev
questions and reported by 2-fold cross-fitting. WikiText: windows of the dev articles fit τ,
windows of the test articles report bits per byte (prepare both with
``python -m experiments.prepare.wikitext`` and ``python -m experiments.prepare.nq
--distractors experiments/data/wikitext/distractors.jsonl``)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class TemperatureConfig:
    dataset: str = "nq"  # nq | wikitext
    retrievers: tuple = ("base=minilm", "lsr=checkpoints/replug-lsr-minilm-nq")
    lm: str = "smollm2"
    k: int = 4
    temperatures: tuple = (1.0, 0.3, 0.1, 0.05, 0.02)
    max_context: int = 512
    corpus: str = "experiments/data/nq/corpus_distractors.jsonl"
    chunk_tokens: int = 0  # 0: every corpus record is one passage; else LM-token passages
    # nq: questions (JSONL with gold_doc) and few-shot demonstrations
    questions: str = "experiments/data/nq/dev.jsonl"
    demonstrations: str = "experiments/data/nq/demonstrations.jsonl"
    # wikitext: articles whose windows fit τ (fit) and report (test)
    fit_articles: str = "experiments/data/wikitext/dev.jsonl"
    test_articles: str = "experiments/data/wikitext/test.jsonl"
    context_tokens: int = 128
    stride: int = 128
    # wikitext: "document" never retrieves a passage of the window's own article (the paper's
    # disjoint datastore); "window" hides only passages overlapping the window
    leakage: str = "document"
    max_windows_per_document: int = 2
    num_examples: int = 80  # cap on questions / windows per split (0 = all)
    record: str = "lsr"  # write the fitted τ into this retriever's folder ("" = none)
    # wikitext: the LSR training step of each retriever, in order (e.g. checkpoints exported
    # with `replug export-retriever --step`): dev and test bits per byte against the step
    steps: tuple = ()
    workdir: str = "runs/inference_temperature"  # the LM-score store (resumable)
    bootstrap_resamples: int = 10_000
    seed: int = 0


# "lsr": the retriever of `replug train-lsr --config experiments/configs/lsr_wikitext.py
# --workdir runs/lsr_wikitext`, exported with `replug export-retriever --workdir
# runs/lsr_wikitext --out runs/lsr_wikitext_export` (its weights are not released).
_WIKI = dict(dataset="wikitext", corpus="experiments/data/wikitext/corpus.jsonl",
             chunk_tokens=128, retrievers=("base=minilm", "lsr=runs/lsr_wikitext_export"))

CONFIGS = {
    "default": TemperatureConfig(),  # = nq
    "nq": TemperatureConfig(),
    "wikitext": TemperatureConfig(**_WIKI),
    # The language-modelling LSR run's dev curve: its checkpoints at steps 4 and 8 exported
    # with `replug export-retriever --workdir runs/lsr_wikitext --step N --out
    # runs/lsr_wikitext_stepN`, between the base retriever (step 0) and the release (step 12).
    "wikitext_curve": TemperatureConfig(**{
        **_WIKI, "retrievers": ("base=minilm", "step4=runs/lsr_wikitext_step4",
                                "step8=runs/lsr_wikitext_step8",
                                "lsr=checkpoints/replug-lsr-minilm-wikitext")},
        steps=(0, 4, 8, 12), record=""),
    # On an accelerator: a 1B LM, every dev question, k = 20 and a finer grid of τ.
    "nq_gpu": TemperatureConfig(lm="meta-llama/Llama-3.2-1B", k=20, max_context=2048,
                                num_examples=0, record="",
                                temperatures=(1.0, 0.5, 0.3, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01)),
    # CI: seconds (the packaged retriever under two labels, a few examples).
    "tiny": TemperatureConfig(retrievers=("base=minilm",), k=2, num_examples=4,
                              temperatures=(1.0, 0.1), record="", bootstrap_resamples=200),
    "tiny_wikitext": TemperatureConfig(**{**_WIKI, "retrievers": ("base=minilm",), "k": 2},
                                       num_examples=3, max_windows_per_document=3,
                                       context_tokens=32, stride=32,
                                       temperatures=(1.0, 0.1), record="",
                                       bootstrap_resamples=200),
}
