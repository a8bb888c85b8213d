"""A user's evaluation file, read and checked: questions with answers, or texts.

Both are JSONL, one example per line (the formats, with a worked example: ``docs/data.md``):

- **QA**: ``{"question": str, "answer": str | [str, ...], "id"?: str, "gold_doc"?: int | str,
  "gold_passage"?: int | [int, ...], "group"?: str}``. ``"answers"``, and FlashRAG's
  ``"golden_answers"`` (its dataset files ``{"id", "question", "golden_answers", "metadata"}``
  read as they are), are accepted for ``"answer"``; the first answer is the one whose
  log-likelihood is scored, any of them counts for exact match and F1. ``gold_doc`` names the
  document that answers the question: the corpus's document id, an integer or a string alike
  (every passage cut from it counts), the same convention as LSR training files;
  ``gold_passage`` names passages of the store by id instead (the paragraph itself, where one
  document is cut into many). ``group`` clusters questions for the bootstrap (questions about
  one article are not independent).
- **Text**: ``{"text": str, "id"?: str, "group"?: str}``; each text is cut into windows that
  are scored in turn (language modelling, bits per byte). A ``.txt`` file is one text.

Errors name the file and line and lose nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib

from replug_jax.fileio import read_jsonl_lines
from replug_jax.retrieval.store import gold_of

KINDS = ("qa", "text")


@dataclasses.dataclass(frozen=True)
class QAItem:
    id: str
    question: str
    answers: tuple[str, ...]
    gold_doc: int | str | tuple[int, ...] | None = None  # a document, or passage ids
    group: str | None = None


@dataclasses.dataclass(frozen=True)
class TextItem:
    id: str
    text: str
    group: str | None = None


@dataclasses.dataclass(frozen=True)
class EvalData:
    """The examples of one file: ``kind`` is ``"qa"`` or ``"text"``; ``checksum`` the file's
    SHA-256 (what resumable records are keyed by)."""

    kind: str
    items: tuple
    path: str
    checksum: str

    def __len__(self) -> int:
        return len(self.items)

    @property
    def groups(self) -> list[str] | None:
        """Each item's cluster label, or None when the file names no group (items then count
        as independent)."""
        if not any(it.group is not None for it in self.items):
            return None
        return [it.group if it.group is not None else f"item:{it.id}" for it in self.items]


ANSWER_KEYS = ("answer", "answers", "golden_answers")  # the last: FlashRAG's jsonl


def _answers(row: dict, where: str) -> tuple[str, ...]:
    value = next((row[k] for k in ANSWER_KEYS if k in row), None)
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise ValueError(f"{where}: 'answer' must be a string or a non-empty list of strings, "
                         f"got {value!r}")
    answers = tuple(a.strip() for a in value)
    if not all(answers):
        raise ValueError(f"{where}: an empty answer")
    return answers


def _group(row: dict, where: str) -> str | None:
    g = row.get("group")
    if g is not None and not isinstance(g, (str, int)):
        raise ValueError(f"{where}: 'group' must be a string, got {g!r}")
    return None if g is None else str(g)


def _kind_of(rows: list[tuple[int, dict]], path: pathlib.Path) -> str:
    first = rows[0][1]
    if not isinstance(first, dict):
        raise ValueError(f"{path}:{rows[0][0]}: expected a JSON object")
    if "question" in first:
        return "qa"
    if "text" in first:
        return "text"
    raise ValueError(f"{path}:{rows[0][0]}: a line needs 'question' and 'answer' (QA) or "
                     f"'text' (language modelling); found keys {sorted(first)}")


def spread_sample(groups: list[str], limit: int, seed: int) -> list[int]:
    """``limit`` item positions drawn with ``seed`` across the groups (``groups[i]``: item
    ``i``'s group): each group's items in a seeded order, taken one per group in turn (groups
    in a seeded order), so an article-ordered file's sample spans its articles instead of
    its first one or two. Returned in file order."""
    import numpy as np

    rng = np.random.default_rng(seed)
    by_group: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    queues = [list(rng.permutation(members)) for members in by_group.values()]
    queues = [queues[j] for j in rng.permutation(len(queues))]
    picked: list[int] = []
    while len(picked) < min(limit, len(groups)):
        for q in queues:
            if q and len(picked) < limit:
                picked.append(int(q.pop()))
    return sorted(picked)


def read_eval_file(path: str | pathlib.Path, kind: str | None = None,
                   limit: int | None = None, sample_seed: int | None = None) -> EvalData:
    """The examples of ``path``: all, the first ``limit`` of them, or with ``sample_seed``
    ``limit`` drawn across the file's groups (:func:`spread_sample`; each item its own group
    where the file names none). ``kind`` (``"qa"`` or ``"text"``) is read from the first
    line unless given; every line must then be of it."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    raw = path.read_bytes()
    checksum = hashlib.sha256(raw).hexdigest()
    if limit is not None and limit <= 0:
        raise ValueError(f"limit must be positive, got {limit}")
    if path.suffix == ".txt":
        text = raw.decode("utf-8")
        if not text.strip():
            raise ValueError(f"{path}: empty text")
        if kind not in (None, "text"):
            raise ValueError(f"{path}: a .txt file is one text, not {kind!r} data")
        return EvalData("text", (TextItem(path.stem, text),), str(path), checksum)
    rows = read_jsonl_lines(path)
    kind = kind or _kind_of(rows, path)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if sample_seed is not None and limit is not None:
        rows = [rows[i] for i in spread_sample(
            [str(r.get("group", f"line:{n}")) if isinstance(r, dict) else str(n)
             for n, r in rows], limit, sample_seed)]
    items, seen = [], set()
    for lineno, row in rows[:limit]:
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object")
        item_id = str(row.get("id", lineno))
        if item_id in seen:
            raise ValueError(f"{where}: id {item_id!r} appears twice")
        seen.add(item_id)
        if kind == "qa":
            q = row.get("question")
            if not isinstance(q, str) or not q.strip():
                raise ValueError(f"{where}: needs a non-empty 'question' (QA file)")
            items.append(QAItem(item_id, q.strip(), _answers(row, where), gold_of(row, where),
                                _group(row, where)))
        else:
            t = row.get("text")
            if not isinstance(t, str) or not t.strip():
                raise ValueError(f"{where}: needs a non-empty 'text' (text file)")
            items.append(TextItem(item_id, t, _group(row, where)))
    return EvalData(kind, tuple(items), str(path), checksum)
