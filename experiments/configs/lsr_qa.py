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
  held out for early stopping and τ); only the query tower learns
  (``train.supervision.towers="query"``): documents keep the base encoder's embeddings, so the
  datastore is embedded once and the released retriever carries both towers.

The ``nq`` config is the same study on NQ (the 624 questions with gold passages, plus the same
distractors), cross-fitted in folds by question; the variant is chosen on dev in each fold and
the endpoint compares every question's test value with the base (intervals over questions). It
releases nothing: each fold trains its own retriever.
"""

import dataclasses
import typing

from replug_jax.train.config import (
    LMConfig,
    LSRConfig,
    RetrievalConfig,
    RetrieverConfig,
    SelectionConfig,
    SupervisionConfig,
)
from replug_jax.train.spec import ObjectiveConfig, OptimConfig

PRIMARY_ENDPOINT = ("mean gold-answer log-likelihood per question, REPLUG k=4 from the whole "
                    "datastore, τ fitted on dev; chosen LSR variant − base; 95 % CI over "
                    "test articles (over questions when the study is cross-fitted by "
                    "question, as NQ is)")

RECALL_ENDPOINT = ("gold-paragraph recall@1 over the whole datastore on every test question; "
                   "chosen LSR variant − base; 95 % CI clustered by article; gated by the "
                   "gold-answer log-likelihood (REPLUG k=4, τ fitted on dev) on the questions "
                   "with an LM pool, whose lower bound must stay above −loglik_margin")


# What every variant trains with: the one trainer's config (each variant takes its objective
# from the grid and names the study's own pools). The retriever's lengths are those the study
# encodes with (MiniLM's and Contriever's 512 positions), so the released card states them.
TRAIN = LSRConfig(
    retriever=RetrieverConfig("minilm", query_max_length=512, doc_max_length=512),
    lm=LMConfig("smollm2", max_context=1024),  # paper: GPT-3 Curie / Codex
    supervision=SupervisionConfig(kind="pool", train_pool="<study>:train",
                                  dev_pool="<study>:dev", towers="query"),
    objective=ObjectiveConfig(lm_score="mean"),  # KL; the marginal likelihood always sums
    # what early-stops training and chooses among variants: "pool_loglik" (the dev pool's
    # REPLUG log-likelihood at selection.tau; 0: fitted over selection.tau_grid at every
    # evaluation, the τ the endpoint uses) | "recall@1" (the gold paragraph at rank 1 of the
    # whole datastore on dev, no LM cost; a step counts only if its dev pool log-likelihood
    # at the fitted τ is not below the base's)
    selection=SelectionConfig(metric="pool_loglik", patience=3, every=150, tau=1.0),
    optim=OptimConfig(learning_rate=2e-5),  # §5.2
    retrieval=RetrievalConfig(refresh_every=250),  # towers="shared" only: re-embed the pool
    k=4,  # documents in REPLUG's ensemble (the primary endpoint's k too)
    total_steps=1500, batch_size=16, num_devices=1, keep_checkpoints=1)
# the step kept by dev recall@1 over the datastore, guarded by the dev pool at the fitted τ
RECALL = {"selection.metric": "recall@1", "selection.tau": 0.0}
# CI: a few steps of two documents
TINY = TRAIN.updated({"k": 2, "total_steps": 4, "batch_size": 2, "selection.every": 2,
                      "selection.patience": 2, "selection.tau_grid": (0.1, 1.0),
                      "lm.max_context": 512})


@dataclasses.dataclass(frozen=True)
class QAStudyConfig:
    # the study's names before it held a training config -> their place in `train`
    RENAMED: typing.ClassVar[dict] = {
        "retriever": "train.retriever.name", "lm": "train.lm.name",
        "lm_max_context": "train.lm.max_context", "k": "train.k",
        "towers": "train.supervision.towers", "steps": "train.total_steps",
        "batch_size": "train.batch_size", "learning_rate": "train.optim.learning_rate",
        "refresh_every": "train.retrieval.refresh_every", "eval_every": "train.selection.every",
        "patience": "train.selection.patience", "lm_score": "train.objective.lm_score",
        "eval_temperature": "train.selection.tau", "select_on": "train.selection.metric",
        "tau_grid": "train.selection.tau_grid"}

    train: LSRConfig = dataclasses.field(default_factory=lambda: TRAIN)
    # squad: train / dev articles / test articles (one fold); nq: `folds` folds by question
    dataset: str = "squad"
    folds: int = 4  # nq only
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
    # squad, train.selection.metric="recall@1": the dev recall@1 that selects reads this many
    # questions of the dev articles (seeded; no LM cost) rather than the dev pool's max_dev (0)
    recall_dev: int = 0
    max_test: int = 1500  # ≥ 1,500: see detectable_effect (nq: questions, all folds)
    # squad: the test questions' articles: "dev" (the SQuAD dev articles here) or
    # "unused_train" (`test_articles` SQuAD train articles in neither the train nor the dev
    # articles, seeded; their pool set is "fresh_test")
    test_source: str = "dev"
    test_articles: int = 0
    # unused_train: the articles an earlier config tested (its seeded draw of this many,
    # `confirm`'s 120) are dropped before the test articles are drawn from the rest
    test_skip_articles: int = 0
    # test questions that get the LM endpoints (gold-answer log-likelihood; a seeded subset of
    # the max_test, spread over the articles; 0: all); recall is measured on all max_test
    max_test_lm: int = 0
    pool_size: int = 8  # M: the base retriever's top-M per question, scored once by the LM
    # the test pool's M (0: pool_size); a test pool of k holds the base's top-k only, and the
    # pairs other retrievers bring in are scored as they are needed (no test oracle then)
    test_pool_size: int = 0
    # questions scored per LM call (and per resumable part): questions come grouped by
    # article, and document KV reuse shares a paragraph among the questions of one call
    part_size: int = 64
    recall_ks: tuple = (1, 5)
    objectives: tuple = ("kl_retriever_to_lm", "kl_lm_to_retriever", "marginal")
    grid: tuple = ((0.1, 0.1), (1.0, 1.0))  # (γ, β): numbers, "fitted" or (γ) "learned"
    # a registered config whose variant a finished temperature study picks by a rule fixed
    # before it finished (experiments.lib.lsr_common.registered_variant): that study's
    # results JSON; its variant replaces objectives, grid and lm_score when training starts
    variant_from: str = ""
    # the shuffled-Q control: trained for exactly this many steps (0: early-stopped like the
    # variants, so that it may return the base and show nothing)
    control_steps: int = 0
    # the primary endpoint: "loglik" (gold-answer log-likelihood under REPLUG) | "recall@1"
    primary: str = "loglik"
    # primary = recall@1: the release also needs the log-likelihood interval's lower bound
    # above -loglik_margin nats per question (the gatekeeping secondary)
    loglik_margin: float = 0.10
    # the released retriever also tested on the NQ questions with their gold passages
    # (reported, not gated)
    transfer_nq: bool = False
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
    seed: int = 0  # the study's draws (articles, examples); train.seed orders the batches


CONFIGS = {
    "default": QAStudyConfig(),
    # NQ, cross-fitted in 4 folds by question: all 624 questions tested once; per fold 60 dev
    # and ~408 train questions; the two objectives the SQuAD study compares most directly
    "nq": QAStudyConfig(train=TRAIN.updated({"total_steps": 600, "selection.every": 60}),
                        dataset="nq", folds=4, max_train=0, max_dev=60, max_test=624,
                        objectives=("kl_retriever_to_lm", "marginal"), grid=((0.1, 0.1),),
                        max_generate=200, release=""),
    # The confirmatory test, registered on 2026-12-03 after the `default` run's results and
    # before any of its pools was scored. Hypothesis (generated post hoc by `default`): the
    # variant with the best dev-pool log-likelihood at the fitted τ there (labelled "end to
    # end" when this was registered; it is within the dev pools), the paper's KL(P_R‖Q) at
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
    # The second confirmatory study (issue 50), registered on 2026-12-04 before any of its
    # pairs was scored (the runs of `default` and `confirm` are not on this machine: nothing
    # is reused). Hypothesis, from `default`'s post hoc result: the paper's KL(P_R‖Q) at
    # γ = β = 1, trained ~4× longer and selected by what the test measures, raises the gold
    # paragraph's recall@1 (default's test: +0.021 [+0.009, +0.035]).
    # - base: all-MiniLM-L6-v2, query tower trained (documents keep the base embeddings;
    #   released as two towers). Its own training data (~1B pairs) include SQuAD, NQ and
    #   TriviaQA (question, paragraph) pairs.
    # - training: 4,800 questions of `default`'s 100 train articles (its 1,200 are the first
    #   rounds of the same seeded draw), pools of the base's top-8, k = 4, batch 16, up to
    #   3,000 steps; dev = `default`'s 320 questions of 40 held-out train articles.
    # - selection: every 150 steps, dev recall@1 over the whole datastore, patience 4; a step
    #   counts only if its dev pool log-likelihood at the τ fitted then is not below the base's.
    #   Dev curves at the fitted τ (fitted at every evaluation).
    # - primary endpoint: gold-paragraph recall@1 over the whole datastore, LSR − base, on
    #   12,000 questions of the 182 SQuAD train articles no split has held (not train, dev or
    #   `confirm`'s 120 test articles), 95 % interval clustered by article. Detectable effect
    #   0.007 (default's paired recall@1 variance 0.068 per question: 2.8 × √(0.068/12,000)
    #   ≈ 0.0067, before the between-article component).
    # - gatekeeping secondary: gold-answer log-likelihood under REPLUG (k = 4, τ fitted on dev
    #   per retriever) on 4,800 of those questions (a seeded subset, test pool = the base's
    #   top-4, other retrievers' pairs scored as needed); release needs its 95 % lower bound
    #   above −0.10 nats per question.
    # - release: both rules pass → float16 two towers at checkpoints/replug-lsr-minilm-squad.
    # - the shuffled-Q control trained for a fixed 1,500 steps (reported, informative);
    #   transfer to the NQ questions with gold passages reported, not gated.
    "confirm_recall": QAStudyConfig(
        train=TRAIN.updated({"total_steps": 3000, "selection.patience": 4, **RECALL}),
        max_train=4800, test_source="unused_train", test_skip_articles=120, test_articles=182,
        max_test=12000, max_test_lm=4800, test_pool_size=4, objectives=("kl_retriever_to_lm",),
        grid=((1.0, 1.0),), control_steps=1500, primary="recall@1", loglik_margin=0.10,
        transfer_nq=True, max_generate=300, detectable_effect=0.007),
    # The third confirmatory study (issue 66), registered on 2026-12-07, after the temperature
    # study's first 7 of 15 variants and before any of its test pairs was scored.
    # - variant: the one the temperature study (experiments/results/lsr_temperature/
    #   default.json, all 15 variants finished) picks on dev by this rule, fixed now: the
    #   highest dev recall@1 at its kept step (4,000 dev questions over the whole datastore),
    #   ties broken by the dev-pool log-likelihood, then the study's order. Hypothesis (from
    #   its first variants, γ from 0.02 to 0.1 with Q from the summed log-probability:
    #   dev recall@1 +0.014 to +0.025 over the base's 0.527, chosen on the same questions):
    #   that variant raises the gold paragraph's recall@1 on articles no study has tested.
    # - training: the one trainer (LSRTrainer, supervision="pool", as `replug train-lsr`
    #   runs it) on confirm_recall's train pools (4,800 questions of 100 train articles ×
    #   the base's top-8, every pair in the carry), query tower, k = 4, batch 16, lr 2e-5,
    #   1,000 steps (the temperature study kept steps 400-500 of 1,000).
    # - selection: every 100 steps, recall@1 over the whole datastore of 4,000 questions of
    #   the 40 dev articles (the temperature study's); a step counts only if its dev-pool
    #   log-likelihood (confirm_recall's 320 dev-pool questions, τ fitted then) is not below
    #   the base's. τ of each retriever fitted on that dev pool.
    # - primary endpoint: gold-paragraph recall@1 over the whole datastore (46,737 passages),
    #   LSR − base, on all 23,477 questions of the 120 SQuAD train articles `confirm` drew and
    #   never ran (no study trained, selected or tested on them), 95 % interval clustered by
    #   article. Primary because it needs no LM, so every test question counts: detectable
    #   effect 0.0064 at 80 % power (confirm_recall's per-question variance of the paired
    #   difference, 0.122 with its clustering: 2.8 × √(0.122 / 23,477)).
    # - gatekeeping secondary: the gold-answer log-likelihood under REPLUG (k = 4, each
    #   retriever at its own τ fitted on dev) on 4,800 of those questions (seeded; test pool =
    #   the base's top-4, the pairs the LSR retriever brings scored as needed). Per-question SD
    #   of the difference 3.75 nats (confirm_recall): interval ±0.106, so the gate (lower
    #   bound above −0.10 nats per question) passes with 80 % power when the true difference
    #   is ≥ +0.05; a difference of 0.15 is detectable.
    # - release: both pass → float16 two towers at checkpoints/replug-lsr-minilm-squad by the
    #   export every user runs (`replug export-retriever`'s writer), τ in replug.json.
    # - reported whatever the primary: both endpoints, the shuffled-Q control trained a fixed
    #   1,000 steps, EM / F1 of 300 greedy answers, transfer to NQ's questions with gold
    #   passages (not gated).
    # - caveat: MiniLM's own training data include SQuAD (question, paragraph) pairs.
    "tau_confirm": QAStudyConfig(
        train=TRAIN.updated({"objective.lm_score": "sum", "total_steps": 1000,
                             "selection.every": 100, "selection.patience": 0, **RECALL}),
        max_train=4800, recall_dev=4000, test_source="unused_train", test_articles=120,
        max_test=0, max_test_lm=4800, test_pool_size=4,
        variant_from="experiments/results/lsr_temperature/default.json", control_steps=1000,
        primary="recall@1", loglik_margin=0.10, transfer_nq=True, max_generate=300,
        detectable_effect=0.0064),
    # confirm_recall's design at the paper's sizes, on an accelerator: Contriever under a 1B
    # LM, k = 20 within pools of 32, every training question of the default articles
    "confirm_recall_gpu": QAStudyConfig(
        train=TRAIN.updated({"retriever.name": "facebook/contriever",
                             "lm.name": "meta-llama/Llama-3.2-1B", "lm.max_context": 2048,
                             "k": 20, "total_steps": 3000, "batch_size": 64,
                             "selection.patience": 4, **RECALL}),
        max_train=0, test_source="unused_train", test_skip_articles=120, test_articles=182,
        max_test=12000, max_test_lm=4800, pool_size=32, test_pool_size=20,
        objectives=("kl_retriever_to_lm",), grid=((1.0, 1.0),), control_steps=1500,
        primary="recall@1", loglik_margin=0.10, transfer_nq=True, max_generate=300,
        detectable_effect=0.007, release=""),
    # CI: seconds (a few questions, two variants, a few steps, 4 enwiki articles as distractors)
    "tiny": QAStudyConfig(train=TINY, distractors="enwiki:4", dev_articles=1, train_articles=0,
                          max_train=8, max_dev=4, max_test=4, pool_size=3, recall_ks=(1, 2),
                          objectives=("kl_retriever_to_lm", "marginal"), grid=((0.1, 0.1),),
                          max_generate=2, max_new_tokens=4, bootstrap_resamples=200,
                          release=""),
    # CI: the confirmatory design (after `tiny --set train_articles=1`, whose work it shares)
    "tiny_confirm": QAStudyConfig(train=TINY, distractors="enwiki:4", dev_articles=1,
                                  train_articles=1, max_train=8, max_dev=4, max_test=3,
                                  pool_size=3, recall_ks=(1, 2), test_source="unused_train",
                                  test_articles=1, test_pool_size=2,
                                  objectives=("kl_retriever_to_lm",), grid=((0.1, 0.1),),
                                  shuffled_control=False, max_generate=0,
                                  bootstrap_resamples=200, release="", work="tiny"),
    # CI: the design of confirm_recall (selection on dev recall@1 at the fitted τ, a fixed-
    # budget control, recall on every test question and the LM endpoint on a subset)
    "tiny_recall": QAStudyConfig(train=TINY.updated(RECALL), distractors="enwiki:4",
                                 dev_articles=1, train_articles=1, max_train=8, max_dev=4,
                                 test_source="unused_train", test_articles=1, max_test=3,
                                 max_test_lm=2, test_pool_size=2, pool_size=3,
                                 recall_ks=(1, 2), objectives=("kl_retriever_to_lm",),
                                 grid=((1.0, 1.0),), control_steps=2, primary="recall@1",
                                 max_generate=0, transfer_nq=True, bootstrap_resamples=200,
                                 release=""),
    # CI: tau_confirm's design (the variant a finished temperature study's rule picks, given
    # by --set variant_from=…; the step selected on recall@1 of more dev questions than the
    # dev pool holds)
    "tiny_tau": QAStudyConfig(train=TINY.updated({"objective.lm_score": "sum",
                                                  "selection.patience": 0, **RECALL}),
                              distractors="enwiki:4", dev_articles=1, train_articles=1,
                              max_train=8, max_dev=2, recall_dev=7, test_source="unused_train",
                              test_articles=1, max_test=3, max_test_lm=2, test_pool_size=2,
                              pool_size=3, recall_ks=(1, 2), control_steps=2, primary="recall@1",
                              max_generate=0, bootstrap_resamples=200, release=""),
    "tiny_nq": QAStudyConfig(train=TINY, dataset="nq", folds=2, distractors="enwiki:4",
                             max_train=6, max_dev=2, max_test=8, pool_size=3, recall_ks=(1, 2),
                             objectives=("kl_retriever_to_lm",), grid=((0.1, 0.1),),
                             max_generate=2, max_new_tokens=4, bootstrap_resamples=200,
                             release=""),
}
