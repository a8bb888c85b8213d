"""SQuAD v1.1 for retrieval-augmented QA: articles, paragraphs and questions; splits by
article; and the open-domain datastore of the LSR QA study (every SQuAD paragraph plus the
enwiki sample's passages as distractors), searched exactly as one index.

**Datastore.** Two exact (Flat) indexes searched together: the SQuAD paragraphs (ids
``0..P-1``, built by the study into its work folder, resumable) and the distractor passages
(an index folder from ``replug index build``, or ``enwiki:N`` in memory), whose ids are offset
by :data:`DISTRACTOR_OFFSET`. The top-k of their union is the merge of each one's top-k, so the
search is the one exact search over all passages.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from experiments.lib.common import require_data
from replug_jax.retrieval.corpus import Passage
from replug_jax.retrieval.search import SearchResult

DISTRACTOR_OFFSET = 100_000_000  # distractor passage id = offset + its id in its own index


@dataclasses.dataclass(frozen=True)
class Question:
    id: str
    question: str
    answers: tuple[str, ...]  # the first is the reference answer; EM/F1 use all
    article: str  # title: the unit of splits and of clustered intervals
    paragraph: int  # datastore id of the paragraph it was asked on (the gold passage)


def load_squad(name: str, first_id: int = 0) -> tuple[list[Passage], list[Question]]:
    """Paragraphs (ids from ``first_id``, titled by article) and questions of
    ``squad_v1.1/<name>`` (``train-v1.1.json`` or ``dev-v1.1.half_a.json``)."""
    data = json.loads(require_data("squad_v1.1", name).read_text(encoding="utf-8"))["data"]
    passages, questions = [], []
    for art in data:
        title = art["title"].replace("_", " ")
        for para in art["paragraphs"]:
            pid = first_id + len(passages)
            passages.append(Passage(pid, para["context"].strip(), title, art["title"]))
            for qa in para["qas"]:
                answers = tuple(dict.fromkeys(a["text"].strip() for a in qa["answers"]))
                if qa["question"].strip() and answers:
                    questions.append(Question(qa["id"], qa["question"].strip(), answers,
                                              art["title"], pid))
    if not passages:
        raise ValueError(f"squad_v1.1/{name}: no paragraphs")
    return passages, questions


def split_articles(questions: list[Question], dev_articles: int, seed: int
                   ) -> tuple[list[Question], list[Question]]:
    """(train, dev) questions, whole articles on each side (``dev_articles`` of them, seeded)."""
    titles = sorted({q.article for q in questions})
    if dev_articles >= len(titles):
        raise ValueError(f"dev_articles={dev_articles} leaves no training article of "
                         f"{len(titles)}")
    dev = set(np.random.default_rng(seed).permutation(titles)[:dev_articles].tolist())
    return ([q for q in questions if q.article not in dev],
            [q for q in questions if q.article in dev])


def sample_questions(questions: list[Question], limit: int, seed: int) -> list[Question]:
    """``limit`` questions (0: all) spread over the articles: a seeded permutation within
    each article, then taken in rounds over the articles (so every article counts). Returned
    grouped by article (articles in order of appearance, the rounds' order within one): a
    pool scored one LM call at a time then holds few articles per call, and document KV reuse
    shares their paragraphs across the call's questions."""
    if not limit or limit >= len(questions):
        return list(questions)
    rng = np.random.default_rng(seed)
    by_article: dict[str, list[Question]] = {}
    for q in questions:
        by_article.setdefault(q.article, []).append(q)
    queues = [[qs[i] for i in rng.permutation(len(qs))] for _, qs in sorted(by_article.items())]
    out, depth = [], 0
    while len(out) < limit:
        for qs in queues:
            if depth < len(qs) and len(out) < limit:
                out.append(qs[depth])
        depth += 1
    order = {a: i for i, a in enumerate(dict.fromkeys(q.article for q in questions))}
    return sorted(out, key=lambda q: order[q.article])  # stable: the rounds within an article


class MergedDatastore:
    """Exact search over the SQuAD paragraphs and the distractors as one index."""

    def __init__(self, squad_index, distractor_index=None):
        self.parts = [(squad_index, 0)]
        if distractor_index is not None:
            self.parts.append((distractor_index, DISTRACTOR_OFFSET))

    def __len__(self) -> int:
        return sum(len(ix) for ix, _ in self.parts)

    def passage(self, pid: int) -> Passage:
        """The passage of datastore id ``pid`` (a distractor's id offset, as search gives it)."""
        for ix, off in reversed(self.parts):
            if pid >= off:
                p = ix.passages[pid - off]
                return p if off == 0 else dataclasses.replace(p, id=pid)
        raise KeyError(pid)

    def search(self, queries_BD: np.ndarray, k: int) -> SearchResult:
        found = [(ix.search(queries_BD, min(k, len(ix))), off) for ix, off in self.parts]
        b = len(queries_BD)
        ids = np.full((b, k), -1, np.int64)
        scores = np.full((b, k), -np.inf, np.float32)
        passages: list[list[Passage]] = []
        for i in range(b):
            cand = [(float(r.scores[i, j]), int(r.ids[i, j]) + off,
                     r.passages[i][j] if off == 0 else dataclasses.replace(
                         r.passages[i][j], id=int(r.ids[i, j]) + off))
                    for r, off in found for j in range(len(r.passages[i]))]
            cand.sort(key=lambda c: (-c[0], c[1]))
            cand = cand[:k]
            for j, (s, pid, _) in enumerate(cand):
                ids[i, j], scores[i, j] = pid, s
            passages.append([p for _, _, p in cand])
        return SearchResult(ids, scores, passages)
