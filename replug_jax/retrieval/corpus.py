"""Corpora: reading JSONL / text / Parquet, chunking into passages, the built-in demo corpus.

A :class:`Passage` keeps its stable integer id, the id of the source document it came from and
its character offsets there, so results can always be traced back to the original text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import json
import pathlib
import re
import warnings
from typing import Callable, Iterable, Iterator


@dataclasses.dataclass(frozen=True)
class Document:
    id: str
    text: str
    title: str = ""


@dataclasses.dataclass(frozen=True)
class Passage:
    id: int  # stable integer id: position in the chunked corpus
    text: str
    title: str = ""
    source_id: str = ""
    start: int = 0  # character offsets in the source document's text
    end: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


class CorpusError(ValueError):
    """A corpus that cannot be used: the message names the file and the problem."""


def read_documents(path: str | pathlib.Path) -> list[Document]:
    """Read ``.jsonl`` (``{"id","text","title"?}``), ``.parquet`` or plain text (one per line).

    Empty lines and records with empty text are skipped with a warning; lines that are not
    UTF-8 or not valid JSON raise :class:`CorpusError` naming the line.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise CorpusError(f"{path}: no such corpus file")
    docs: list[Document] = []
    skipped = 0
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path).to_pylist()
        for i, row in enumerate(table):
            if "text" not in row:
                raise CorpusError(f"{path}: row {i} has no 'text' column")
            if not str(row["text"] or "").strip():
                skipped += 1
                continue
            docs.append(Document(str(row.get("id", i)), str(row["text"]),
                                 str(row.get("title") or "")))
    else:
        raw = path.read_bytes()
        for lineno, line in enumerate(raw.split(b"\n"), start=1):
            try:
                text = line.decode("utf-8").rstrip("\r")
            except UnicodeDecodeError as err:
                raise CorpusError(f"{path}:{lineno}: not valid UTF-8 ({err})") from err
            if not text.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    rec = json.loads(text)
                except json.JSONDecodeError as err:
                    raise CorpusError(f"{path}:{lineno}: not valid JSON ({err})") from err
                if not isinstance(rec, dict) or "text" not in rec:
                    raise CorpusError(f"{path}:{lineno}: expected an object with a 'text' field")
                if not str(rec["text"]).strip():
                    skipped += 1
                    continue
                docs.append(Document(str(rec.get("id", lineno)), str(rec["text"]),
                                     str(rec.get("title") or "")))
            else:
                docs.append(Document(str(lineno), text))
    if skipped:
        warnings.warn(f"{path}: skipped {skipped} record(s) with empty text", stacklevel=2)
    if not docs:
        raise CorpusError(f"{path}: the corpus is empty (no non-empty documents)")
    return docs


def _spans_words(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"\S+", text)]


def chunk_documents(docs: Iterable[Document], *, size: int = 100, overlap: int = 0,
                    unit: str = "words", tokenizer=None) -> list[Passage]:
    """Split documents into passages of ``size`` words (DPR: 100) or tokens (REPLUG: 128).

    ``overlap`` units are shared between consecutive passages. Token chunking needs a
    ``tokenizer`` with offset mapping (any HF fast tokenizer). Ids are 0..N-1 in order.
    """
    if size <= 0 or not 0 <= overlap < size:
        raise ValueError(f"need size > 0 and 0 <= overlap < size, got {size=} {overlap=}")
    if unit not in ("words", "tokens"):
        raise ValueError(f"unit must be 'words' or 'tokens', got {unit!r}")
    if unit == "tokens" and tokenizer is None:
        raise ValueError("token chunking needs a tokenizer")
    passages: list[Passage] = []
    step = size - overlap
    for doc in docs:
        if unit == "words":
            spans = _spans_words(doc.text)
        else:
            enc = tokenizer(doc.text, add_special_tokens=False, return_offsets_mapping=True)
            spans = [s for s in enc["offset_mapping"] if s[1] > s[0]]
        for i in range(0, max(len(spans) - overlap, 1), step):
            window = spans[i:i + size]
            if not window:
                break
            start, end = window[0][0], window[-1][1]
            passages.append(Passage(len(passages), doc.text[start:end], doc.title, doc.id,
                                    start, end))
    if not passages:
        raise CorpusError("chunking produced no passages (all documents empty?)")
    return passages


def corpus_checksum(passages: list[Passage]) -> str:
    h = hashlib.sha256()
    for p in passages:
        h.update(json.dumps(p.to_json(), sort_keys=True).encode())
        h.update(b"\n")
    return h.hexdigest()


def write_passages(passages: list[Passage], path: pathlib.Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for p in passages:
            f.write(json.dumps(p.to_json(), ensure_ascii=False) + "\n")
    tmp.replace(path)


def read_passages(path: pathlib.Path) -> list[Passage]:
    with open(path, encoding="utf-8") as f:
        return [Passage(**json.loads(line)) for line in f if line.strip()]


# -- the built-in demo corpus: the Python standard library's own documentation -------------

DEMO_MODULES = (
    "abc", "argparse", "array", "asyncio", "base64", "bisect", "calendar", "collections",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "enum",
    "fractions", "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client",
    "io", "itertools", "json", "logging", "math", "operator", "os", "os.path", "pathlib",
    "pickle", "pprint", "queue", "random", "re", "secrets", "shlex", "shutil", "socket",
    "sqlite3", "statistics", "string", "struct", "subprocess", "tarfile", "tempfile",
    "textwrap", "threading", "time", "timeit", "typing", "unittest", "urllib.parse", "uuid",
    "weakref", "zipfile", "zlib",
)


def _clean(doc: str) -> str:
    return re.sub(r"\s+", " ", doc).strip()


def python_docs_documents(modules: Iterable[str] = DEMO_MODULES,
                          importer: Callable[[str], object] = importlib.import_module,
                          ) -> Iterator[Document]:
    """Module, class and function docstrings of the standard library, via ``inspect``.

    Every fresh Python has them, so the demo needs no downloaded data. Each document is
    ``"<qualified name><signature>: <docstring>"``, titled with the qualified name.
    """
    for mod_name in modules:
        try:
            module = importer(mod_name)
        except ImportError:
            continue
        doc = inspect.getdoc(module)
        if doc:
            yield Document(mod_name, f"The {mod_name} module. {_clean(doc)}", mod_name)
        public = getattr(module, "__all__", None) or [n for n in dir(module)
                                                      if not n.startswith("_")]
        for name in sorted(set(public)):
            obj = getattr(module, name, None)
            if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            home = (getattr(obj, "__module__", None) or mod_name).lstrip("_").split(".")[0]
            if home != mod_name.split(".")[0] and mod_name != "os.path":
                continue  # re-exported from another module
            obj_doc = inspect.getdoc(obj)
            if not obj_doc or len(obj_doc) < 40:
                continue
            try:
                sig = re.sub(r" at 0x[0-9a-f]+", "", str(inspect.signature(obj)))
            except (TypeError, ValueError):
                sig = ""
            qual = f"{mod_name}.{name}"
            yield Document(qual, f"{qual}{sig}: {_clean(obj_doc)}", qual)


def demo_corpus(size: int = 100, overlap: int = 0) -> list[Passage]:
    """The demo's passages: Python docs chunked into ``size``-word passages."""
    return chunk_documents(python_docs_documents(), size=size, overlap=overlap)
