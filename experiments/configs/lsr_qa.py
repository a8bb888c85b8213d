"""The cross-fitted LSR study on SQuAD v1.1 and NQ (``experiments/lsr_qa.py``).

**Pre-registered before any run** (this file's ``default`` is what the results report):

- *Primary endpoint*: the mean gold-answer log-likelihood (nats per question) of REPLUG with
  k = 4 documents retrieved from the whole datastore, ``λ = softmax(s/τ)`` with τ fitted on dev
  for each retriever (``tau_grid``), on SQuAD questions of the 24 dev articles available here,
  which no retriever trained on; the chosen LSR variant (best dev value, the shuffled-Q
  control excluded) minus the base retriever, 95 % interval bootstrapped over **articles**.
- *Release rule*: release only if that interval excludes zero in the LSR retriever's favour.
- *Secondary*: gold-paragraph recall@1 and @5 over the whole datastore; every variant vs the
  base on the primary endpoint; EM / F1 of greedy REPLUG answers (``max_generate`` questions).
- *Smallest detectable effect*, stated before the run: ``detectable_effect`` nats per question
  with 1,500 test questions; the realised one (80 % power, 5 % level, from the interval) is
  reported beside it.
- *Training*: questions of ``train_articles`` SQuAD train articles (``dev_articles`` others
  held out for early stopping and τ); only the query tower learns (``towers="query"``):
  documents keep the base encoder's embeddings, so the datastore is embedded once and the
  released retriever carries both towers.

The ``nq`` config is the same study on NQ (the 624 questions with gold passages, plus the same
distractors), cross-fitted in folds by question; the variant is chosen on dev in each fold and
the endpoint compares every question's test value with the base (intervals over questions). It
releases nothing: each fold trains its own retriever.
"""

import dataclasses

PRIMARY_ENDPOINT = ("mean gold-answer log-likelihood per question, REPLUG k=4 from the whole "
                    "datastore, τ fitted on dev; chosen LSR variant − base; 95 % CI over "
                    "test articles")


@dataclasses.dataclass(frozen=True)
class QAStudyConfig:
    # squad: train / dev articles / test articles (one fold); nq: `folds` folds by question
    dataset: str = "squad"
    folds: int = 4  # nq only
    retriever: str = "minilm"  # paper: Contriever
    lm: str = "smollm2"  # paper: GPT-3 Curie / Codex
    lm_max_context: int = 1024
    # distractors beside every SQuAD paragraph: an index folder (`replug index build` of the
    # enwiki sample: runs/enwiki_idx), enwiki:N (the first N enwiki articles in 100-word
    # passages, indexed once in the work folder), or "" (none)
    distractors: str = "enwiki:1000"
    dev_articles: int = 40  # SQuAD train articles held out: early stopping and τ
    # the train questions come from this many of the other train articles (seeded; 0 = all):
    # fewer articles, more questions each, so KV reuse shares more paragraphs per LM call
    train_articles: int = 100
    max_train: int = 1200  # questions, spread over the articles (0 = all; nq: per fold)
    max_dev: int = 320  # (nq: per fold)
    max_test: int = 1500  # ≥ 1,500: see detectable_effect (nq: questions, all folds)
    # squad: the test questions' articles: "dev" (the SQuAD dev articles here) or
    # "unused_train" (`test_articles` SQuAD train articles in neither the train nor the dev
    # articles, seeded; their pool set is "fresh_test")
    test_source: str = "dev"
    test_articles: int = 0
    pool_size: int = 8  # M: the base retriever's top-M per question, scored once by the LM
    # the test pool's M (0: pool_size); a test pool of k holds the base's top-k only, and the
    # pairs other retrievers bring in are scored as they are needed (no test oracle then)
    test_pool_size: int = 0
    # questions scored per LM call (and per resumable part): questions come grouped by
    # article, and document KV reuse shares a paragraph among the questions of one call
    part_size: int = 64
    k: int = 4  # documents in REPLUG's ensemble (the primary endpoint's k)
    recall_ks: tuple = (1, 5)
    objectives: tuple = ("kl_retriever_to_lm", "kl_lm_to_retriever", "marginal")
    grid: tuple = ((0.1, 0.1), (1.0, 1.0))  # (γ, β)
    towers: str = "query"  # query: only the query tower learns | shared: one encoder
    steps: int = 1500
    batch_size: int = 16
    learning_rate: float = 2e-5  # §5.2
    refresh_every: int = 250  # towers="shared" only: re-embed the pool passages
    eval_every: int = 150
    patience: int = 3
    lm_score: str = "mean"  # KL objectives; the marginal likelihood always sums
    eval_temperature: float = 1.0  # τ of the dev curve that early-stops training
    tau_grid: tuple = (0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.5, 1.0)
    shuffled_control: bool = True
    require_headroom: bool = False  # stop before training when the oracle shows none
    max_generate: int = 300  # test questions answered greedily for EM / F1 (0 = none)
    max_new_tokens: int = 16
    detectable_effect: float = 0.10  # nats per question, stated before the run
    bootstrap_resamples: int = 10_000
    workdir: str = "runs/lsr_qa"  # index, pools, runs (resumable)
    work: str = ""  # the work folder under workdir ("": the config's name); shared by a config
    # that reuses another's train and dev pools and trained variants
    release: str = "checkpoints/replug-lsr-minilm-squad"  # written only if the rule passes
    seed: int = 0


CONFIGS = {
    "default": QAStudyConfig(),
    # NQ, cross-fitted in 4 folds by question: all 624 questions tested once; per fold 60 dev
    # and ~408 train questions; the two objectives the SQuAD study compares most directly
    "nq": QAStudyConfig(dataset="nq", folds=4, max_train=0, max_dev=60, max_test=624,
                        objectives=("kl_retriever_to_lm", "marginal"), grid=((0.1, 0.1),),
                        steps=600, eval_every=60, max_generate=200,
                        release=""),
    # The confirmatory test, registered on 2026-12-03 after the `default` run's results and
    # before any of its pools was scored. Hypothesis (generated post hoc by `default`): the
    # variant with the best end-to-end dev log-likelihood there, the paper's KL(P_R‖Q) at
    # γ = β = 1, beats the base on the primary endpoint (default's test: +0.126
    # [−0.002, +0.243]). The same trained retriever (default's train and dev pools and trained
    # variant are reused: work="default") and τ fitted on the same dev pool, tested on 4,800
    # questions of 120 SQuAD train articles that neither the train nor the dev split holds.
    # detectable_effect: 2.8 × √(9.26 / 4,800) from default's per-question variance of this
    # variant's difference (9.26 nats²; no between-article component was measurable). Release
    # rule unchanged. Caveat: MiniLM's own training data include SQuAD train (question,
    # paragraph) pairs, which can only favour the base on these articles.
    "confirm": QAStudyConfig(test_source="unused_train", test_articles=120, max_test=4800,
                             test_pool_size=4, objectives=("kl_retriever_to_lm",),
                             grid=((1.0, 1.0),), shuffled_control=False, max_generate=0,
                             detectable_effect=0.123, work="default"),
    # CI: seconds (a few questions, two variants, a few steps, 4 enwiki articles as distractors)
    "tiny": QAStudyConfig(distractors="enwiki:4", dev_articles=1, train_articles=0,
                          max_train=8, max_dev=4, max_test=4, pool_size=3, k=2, recall_ks=(1, 2),
                          objectives=("kl_retriever_to_lm", "marginal"), grid=((0.1, 0.1),),
                          steps=4, batch_size=2, eval_every=2, patience=2,
                          tau_grid=(0.1, 1.0), max_generate=2, max_new_tokens=4,
                          lm_max_context=512, bootstrap_resamples=200, release=""),
    # CI: the confirmatory design (after `tiny --set train_articles=1`, whose work it shares)
    "tiny_confirm": QAStudyConfig(distractors="enwiki:4", dev_articles=1, train_articles=1,
                                  max_train=8, max_dev=4, max_test=3, pool_size=3, k=2,
                                  recall_ks=(1, 2), test_source="unused_train", test_articles=1,
                                  test_pool_size=2, objectives=("kl_retriever_to_lm",),
                                  grid=((0.1, 0.1),), shuffled_control=False, steps=4,
                                  batch_size=2, eval_every=2, patience=2, tau_grid=(0.1, 1.0),
                                  max_generate=0, lm_max_context=512, bootstrap_resamples=200,
                                  release="", work="tiny"),
    "tiny_nq": QAStudyConfig(dataset="nq", folds=2, distractors="enwiki:4", max_train=6,
                             max_dev=2, max_test=8, pool_size=3, k=2, recall_ks=(1, 2),
                             objectives=("kl_retriever_to_lm",), grid=((0.1, 0.1),),
                             steps=4, batch_size=2, eval_every=2, patience=2,
                             tau_grid=(0.1, 1.0), max_generate=2, max_new_tokens=4,
                             lm_max_context=512, bootstrap_resamples=200, release=""),
}
