"""A user's evaluation file, read and checked: questions with answers, or texts.

Both are JSONL, one example per line (the formats, with a worked example: ``docs/data.md``):

- **QA**: ``{"question": str, "answer": str | [str, ...], "id"?: str, "gold_doc"?: int | str,
  "group"?: str}``. ``"answers"`` is accepted for ``"answer"``; the first answer is the one
  whose log-likelihood is scored, any of them counts for exact match and F1. ``gold_doc`` names
  the passage that answers the question: an integer passage id (``#id`` in ``replug index
  search``) or a string document id of the corpus (every passage cut from it counts), the
  same convention as LSR training files. ``group`` clusters questions for the bootstrap
  (questions about one article are not independent).
- **Text**: ``{"text": str, "id"?: str, "group"?: str}``; each text is cut into windows that
  are scored in turn (language modelling, bits per byte). A ``.txt`` file is one text.

Errors name the file and line and lose nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pathlib

from replug_jax.fileio import read_jsonl_lines

KINDS = ("qa", "text")


@dataclasses.dataclass(frozen=True)
class QAItem:
    id: str
    question: str
    answers: tuple[str, ...]
    gold_doc: int | str | None = None
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


def _answers(row: dict, where: str) -> tuple[str, ...]:
    value = row.get("answer", row.get("answers"))
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


def read_eval_file(path: str | pathlib.Path, kind: str | None = None,
                   limit: int | None = None) -> EvalData:
    """The examples of ``path`` (the first ``limit`` of them). ``kind`` (``"qa"`` or
    ``"text"``) is read from the first line unless given; every line must then be of it."""
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
            gold = row.get("gold_doc")
            if gold is not None and (isinstance(gold, bool) or not isinstance(gold, (int, str))):
                raise ValueError(f"{where}: 'gold_doc' must be a passage id (an integer) or a "
                                 f"document id of the corpus (a string), got {gold!r}")
            items.append(QAItem(item_id, q.strip(), _answers(row, where), gold,
                                _group(row, where)))
        else:
            t = row.get("text")
            if not isinstance(t, str) or not t.strip():
                raise ValueError(f"{where}: needs a non-empty 'text' (text file)")
            items.append(TextItem(item_id, t, _group(row, where)))
    return EvalData(kind, tuple(items), str(path), checksum)
