"""The questions, cross-fitting folds and datastore of the LSR QA study (``lsr_qa``), the
base retrievals it keeps, and its greedy REPLUG answers.

* ``dataset="squad"``: one fold. Train = questions of SQuAD train articles (``train_articles``
  of them), dev = questions of ``dev_articles`` other train articles (early stopping, τ),
  test = questions of the SQuAD dev articles available here, which no retriever trains on
  (``test_source="unused_train"``: of ``test_articles`` train articles that neither the train
  nor the dev split holds, less the ``test_skip_articles`` an earlier config tested; pool set
  "fresh_test"; with ``max_test_lm`` only a seeded subset of the test questions gets an LM
  pool, and recall is measured on all of them: ``Study.recall_test``).
  Datastore: every SQuAD paragraph (train and dev half) plus the distractors.
* ``dataset="nq"``: ``folds`` folds by question over the 624 NQ questions with gold passages.
  In fold f the test is the f-th part; ``max_dev`` of the others (seeded) are its dev and the
  rest its train, so every question is tested exactly once, by retrievers that never trained
  on it. Datastore: the 624 gold passages plus the distractors. Each question is its own
  cluster in the intervals.

``nq_transfer``: a SQuAD-trained retriever against its base on the NQ questions with gold
passages (recall only, no LM cost; reported, not gated).

Pools are scored once per *pool set* (SQuAD: train, dev and test; NQ: all questions, whatever
fold they fall in) and a fold takes rows of them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import numpy as np

from experiments.lib import lm_datastore, squad
from replug_jax.core.ensemble import retrieval_log_weights
from replug_jax.eval.qa import first_line
from replug_jax.fileio import atomic_path, write_json_atomic
from replug_jax.prompts import qa_prompt
from replug_jax.retrieval.search import SearchResult
from replug_jax.train.data import Example
from replug_jax.train.supervision import branch_prompts

SPLITS = ("train", "dev", "test")


@dataclasses.dataclass
class Study:
    store: squad.MergedDatastore
    pool_sets: dict[str, list[squad.Question]]  # the questions whose pools are scored
    # per fold: split -> (pool set, rows of it)
    folds: list[dict[str, tuple[str, np.ndarray]]]
    # the test questions whose recall is measured when only some of them get an LM pool
    # (``max_test_lm``): the pool set's questions are a subset of these
    recall_test: list[squad.Question] | None = None
    # every question of the dev articles (SQuAD), whose recall needs no LM: the temperature
    # study's ≥ 4,000-question dev recall is drawn from them
    dev_all: list[squad.Question] | None = None

    def questions(self, fold: int, split: str) -> list[squad.Question]:
        name, rows = self.folds[fold][split]
        return [self.pool_sets[name][i] for i in rows]


def write_question_file(questions, path: pathlib.Path) -> dict:
    """The test questions as a ``replug eval`` file (``{"id", "question", "answers",
    "gold_passage", "group"}``: the gold paragraph by its datastore id, grouped by article),
    so that ``replug eval --retrieval-only --compare-retriever`` reruns the study's recall
    from the command line; returns its path, question count and SHA-256 for the results.
    It lives in the work folder: the questions are SQuAD's, which stays in the shared data."""
    text = "".join(json.dumps({"id": q.id, "question": q.question, "answers": list(q.answers),
                               "gold_passage": q.paragraph, "group": q.article},
                              ensure_ascii=False) + "\n" for q in questions)
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return {"path": str(path), "questions": len(questions),
            "sha256": hashlib.sha256(text.encode()).hexdigest()}


def examples_of(questions) -> list[Example]:
    """x = the plain QA prompt, y = " " + the first reference answer, query = the question."""
    return [Example(q.id, q.question, qa_prompt(q.question, chat=False), " " + q.answers[0],
                    q.paragraph) for q in questions]


def distractor_index(cfg, retriever, lm, progress: bool, lazy: bool = False):
    """The distractors: ``enwiki:N`` (the first N enwiki articles in 100-word passages,
    indexed once under the work root, shared by every config; ``lazy``: at the first search),
    an index folder, or None."""
    if not cfg.distractors:
        return None
    return lm_datastore.open_datastore(cfg.distractors, retriever, lm, 128,
                                       cache=pathlib.Path(cfg.workdir), progress=progress,
                                       lazy=lazy)[0]


def base_retrieval(study: Study, retriever, questions, k: int, path: pathlib.Path, key: dict):
    """The base retriever's top-``k`` of ``questions`` over the whole datastore, kept in
    ``path`` (ids and scores, with ``key``: the retriever, the questions, the datastore) so
    that a run on another machine takes it from there and, with its pools' pairs in the score
    store, never encodes the datastore to score them."""
    key = json.loads(json.dumps({**key, "k": k, "datastore": len(study.store),
                                 "questions": [q.id for q in questions]}))
    if path.exists():
        with np.load(path, allow_pickle=False) as z:
            if json.loads(str(z["key"])) == key:
                ids, scores = z["ids"], z["scores"]
                return SearchResult(ids, scores, [[study.store.passage(int(i)) for i in row
                                                   if i >= 0] for row in ids])
    res = study.store.search(retriever.encode_queries([q.question for q in questions]), k)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, ids=res.ids, scores=res.scores, key=np.array(json.dumps(key)))
    return res


def open_study(cfg, retriever, lm, work: pathlib.Path, progress: bool) -> Study:
    """The study's questions, folds and datastore; its indexes are loaded or built at their
    first search (a run whose base retrievals are kept searches nothing to score its pools)."""
    distractors = distractor_index(cfg, retriever, lm, progress, lazy=True)
    if cfg.dataset == "squad":
        return _squad(cfg, retriever, work, distractors, progress)
    if cfg.dataset == "nq":
        return _nq(cfg, retriever, work, distractors, progress)
    raise ValueError(f"dataset must be squad or nq, got {cfg.dataset!r}")


def _squad(cfg, retriever, work, distractors, progress) -> Study:
    train_paras, train_qs = squad.load_squad("train-v1.1.json")
    test_paras, test_qs = squad.load_squad("dev-v1.1.half_a.json", first_id=len(train_paras))
    squad_index = lm_datastore.cached_index(train_paras + test_paras, retriever,
                                            work / "squad_index", progress, lazy=True)
    train_qs, dev_qs = squad.split_articles(train_qs, cfg.dev_articles, cfg.seed)
    unused: list = []
    if 0 < cfg.train_articles < len({q.article for q in train_qs}):  # seeded, whole articles
        unused, train_qs = squad.split_articles(train_qs, cfg.train_articles, cfg.seed + 1)
    test_set = "test"
    if cfg.test_source == "unused_train":  # train articles no split holds: fresh for everyone
        if not unused or cfg.test_articles <= 0:
            raise ValueError("test_source='unused_train' needs train_articles > 0 (articles "
                             "left unused) and test_articles > 0")
        if cfg.test_skip_articles:  # the articles an earlier config's draw tested
            unused = squad.split_articles(unused, cfg.test_skip_articles, cfg.seed + 2)[0]
        test_qs = (unused if cfg.test_articles >= len({q.article for q in unused}) else
                   squad.split_articles(unused, cfg.test_articles, cfg.seed + 2)[1])
        test_set = "fresh_test"
    elif cfg.test_source != "dev":
        raise ValueError(f"test_source must be dev or unused_train, got {cfg.test_source!r}")
    test_qs = squad.sample_questions(test_qs, cfg.max_test, cfg.seed)
    recall_test = None
    if 0 < getattr(cfg, "max_test_lm", 0) < len(test_qs):  # the LM endpoint on a subset
        recall_test = test_qs
        test_qs = squad.sample_questions(test_qs, cfg.max_test_lm, cfg.seed + 3)
    sets = {"train": squad.sample_questions(train_qs, cfg.max_train, cfg.seed),
            "dev": squad.sample_questions(dev_qs, cfg.max_dev, cfg.seed),
            test_set: test_qs}
    names = {"train": "train", "dev": "dev", "test": test_set}
    fold = {s: (names[s], np.arange(len(sets[names[s]]))) for s in SPLITS}
    return Study(squad.MergedDatastore(squad_index, distractors), sets, [fold], recall_test,
                 dev_qs)


def _nq(cfg, retriever, work, distractors, progress) -> Study:
    from experiments.lib.datasets import load_nq

    passages, questions, answers = load_nq()
    qs = [squad.Question(f"nq{i}", q, tuple(a), f"nq{i}", i)
          for i, (q, a) in enumerate(zip(questions, answers))]
    if cfg.max_test:  # a seeded subset of the questions (every one tested once)
        qs = [qs[i] for i in sorted(np.random.default_rng(cfg.seed).permutation(len(qs))
                                    [:cfg.max_test])]
    if cfg.folds < 2 or cfg.folds > len(qs):
        raise ValueError(f"folds={cfg.folds}: needs 2..{len(qs)} for {len(qs)} questions")
    gold_index = lm_datastore.cached_index(passages, retriever, work / "nq_index", progress)
    order = np.random.default_rng(cfg.seed).permutation(len(qs))
    folds = []
    for part in np.array_split(order, cfg.folds):
        rest = np.setdiff1d(order, part)
        rest = rest[np.random.default_rng(cfg.seed + 1).permutation(len(rest))]
        dev, train = rest[:cfg.max_dev], rest[cfg.max_dev:]
        if cfg.max_train:
            train = train[:cfg.max_train]
        if not len(train) or not len(dev):
            raise ValueError(f"max_dev={cfg.max_dev} leaves no train or no dev question in a "
                             f"fold of {len(rest)}")
        folds.append({"train": ("all", np.sort(train)), "dev": ("all", np.sort(dev)),
                      "test": ("all", np.sort(part))})
    return Study(squad.MergedDatastore(gold_index, distractors), {"all": qs}, folds)


def nq_transfer(cfg, retriever, params, work, progress, base: str = "base") -> dict:
    """The chosen retriever against its base on the NQ questions with gold passages (their
    624 passages plus the study's distractors, searched exactly): recall@k of the gold
    passage and the paired difference, 95 % interval over questions. No LM cost."""
    from experiments.lib.datasets import load_nq
    from replug_jax.eval.stats import paired_bootstrap

    passages, questions, _ = load_nq()
    store = squad.MergedDatastore(
        lm_datastore.cached_index(passages, retriever, work / "nq_index", progress),
        distractor_index(cfg, retriever, None, progress))
    gold = np.arange(len(questions))
    hits = {}
    for name, p in ((base, None), ("chosen", params)):
        ids = store.search(retriever.encode_queries(questions, p), max(cfg.recall_ks)).ids
        hits[name] = {r: (ids[:, :r] == gold[:, None]).any(1).astype(float)
                      for r in cfg.recall_ks}
    return {"questions": len(questions), "datastore_passages": len(store),
            **{f"recall@{r}": {n: float(h[r].mean()) for n, h in hits.items()}
               for r in cfg.recall_ks},
            **{f"recall@{r}_chosen_vs_base": paired_bootstrap(
                hits["chosen"][r], hits[base][r], clusters=None,
                resamples=cfg.bootstrap_resamples, seed=cfg.seed) for r in cfg.recall_ks}}


def generate_answers(lm, examples, res, tau, k, max_new_tokens, saved: pathlib.Path,
                     batch: int = 8, progress: bool = True) -> list[str]:
    """Greedy REPLUG answers (coordinated decoding over the top-``k`` branches, §3.2),
    ``batch`` questions per call, each batch's answers kept in ``saved`` so a killed run
    resumes where it stopped (``generate_ensemble`` bounds its own memory)."""
    from tqdm.auto import tqdm

    prompts = [branch_prompts([e] * len(ps[:k]), ps[:k], lm)
               for e, ps in zip(examples, res.passages)]
    log_w = np.asarray(retrieval_log_weights(res.scores[:, :k], tau))
    key = hashlib.sha256(json.dumps([prompts, log_w.round(5).tolist(), max_new_tokens])
                         .encode()).hexdigest()
    back = json.loads(saved.read_text()) if saved.exists() else {}
    texts = back["texts"] if back.get("key") == key else []  # else: answered anew
    for lo in tqdm(range(0, len(prompts), batch), desc="greedy answers", unit="batch",
                   disable=not progress):
        if lo < len(texts):
            continue
        texts += lm.generate_ensemble(prompts[lo:lo + batch], log_w[lo:lo + batch],
                                      max_new_tokens=max_new_tokens,
                                      sampling_temperature=0.0).texts
        write_json_atomic({"key": key, "texts": texts}, saved)
    return [first_line(t) for t in texts]
