"""Corpora: streaming JSONL / text / Parquet / DPR TSV readers, chunking into passages, and
the built-in demo corpus.

A :class:`Passage` keeps its stable integer id, the id of the source document it came from and
its character offsets there, so results can always be traced back to the original text.
"""

from __future__ import annotations

import csv
import dataclasses
import gzip
import hashlib
import importlib
import inspect
import io
import json
import pathlib
import re
import warnings
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np


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


def document_id(rec: dict, lineno: int) -> str:
    """A JSONL record's document id: its ``id`` field, else its physical line number (from 1,
    blank lines counted). Every reader of a JSONL corpus or of LSR examples cut from one uses
    this rule, so the leakage filter names the same documents the corpus does."""
    return str(rec["id"]) if rec.get("id") is not None else str(lineno)


def iter_documents(path: str | pathlib.Path) -> Iterator[Document]:
    """Stream documents from ``.jsonl`` (``{"id","text","title"?}``), ``.parquet`` (columns
    ``text`` and optionally ``id``, ``title``), ``.tsv`` (DPR's ``psgs_w100.tsv``: a header
    naming ``id``, ``text`` and optionally ``title``, fields quoted as by ``csv``) or plain text
    (one document per line). ``.jsonl.gz``, ``.tsv.gz`` and ``.txt.gz`` are read through gzip
    as they stream. One record batch or line at a time: memory does not grow with the file.

    Records with empty text are skipped with a warning at the end, and so is a corpus that
    gives two documents the same id (a warning); a line that is not UTF-8,
    not valid JSON or lacks a field raises :class:`CorpusError` naming the file and line.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise CorpusError(f"{path}: no such corpus file")
    ids = _IdTally()
    for doc in _iter_documents(path):
        ids.add(doc.id)
        yield doc
    ids.warn(path)


class _IdTally:
    """8-byte hashes of every document id (168 MB at 21M documents, not the ids themselves),
    to say when a corpus names two documents alike: their passages could not be told apart
    in results, and the leakage filter would hide both."""

    def __init__(self):
        self._parts: list[np.ndarray] = []
        self._now: list[int] = []

    def add(self, doc_id: str) -> None:
        self._now.append(int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8)
                                        .digest(), "little"))
        if len(self._now) >= 1 << 16:
            self._parts.append(np.array(self._now, np.uint64))
            self._now = []

    def warn(self, path) -> None:
        all_ = np.concatenate(self._parts + [np.array(self._now, np.uint64)])
        _, first, counts = np.unique(all_, return_index=True, return_counts=True)
        repeated = int((counts - 1).sum())
        if repeated:
            at = int(np.sort(first[counts > 1])[0]) + 1
            warnings.warn(f"{path}: {repeated} document(s) repeat the id of an earlier one "
                          f"(the first repeated id is document {at}'s); results name passages "
                          "by document id: make the ids unique", stacklevel=3)


def _kind(path: pathlib.Path) -> tuple[str, bool]:
    """The format suffix (``.jsonl``, ``.tsv``, ...) and whether the file is gzipped."""
    if path.suffix == ".gz":
        return pathlib.Path(path.stem).suffix, True
    return path.suffix, False


def _open_binary(path: pathlib.Path):
    return gzip.open(path, "rb") if _kind(path)[1] else open(path, "rb")


def _lines(path: pathlib.Path, f) -> Iterator[bytes]:
    """The file's lines; a damaged or truncated gzip stream is a :class:`CorpusError`."""
    lineno = 0
    try:
        for lineno, line in enumerate(f, start=1):
            yield line
    except (OSError, EOFError, gzip.BadGzipFile) as err:
        raise CorpusError(f"{path}:{lineno + 1}: unreadable compressed stream ({err})") from err


def _iter_documents(path: pathlib.Path) -> Iterator[Document]:
    skipped, where = 0, []  # where: the first few skipped rows (lines, or parquet rows)
    suffix, _ = _kind(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(path)
        if "text" not in pf.schema_arrow.names:
            raise CorpusError(f"{path}: no 'text' column (columns: {pf.schema_arrow.names})")
        row = 0
        for batch in pf.iter_batches(batch_size=8192):
            cols = batch.to_pydict()
            for j, text in enumerate(cols["text"]):
                if not str(text or "").strip():
                    skipped += 1
                    where += [f"row {row + j}"] if len(where) < 5 else []
                else:
                    doc_id = cols["id"][j] if "id" in cols else row + j
                    yield Document(str(doc_id), str(text), str((cols.get("title") or
                                                                [""] * (j + 1))[j] or ""))
            row += batch.num_rows
    elif suffix == ".tsv":
        yield from _iter_tsv(path)
    else:
        with _open_binary(path) as f:
            for lineno, line in enumerate(_lines(path, f), start=1):
                try:
                    text = line.decode("utf-8").rstrip("\r\n")
                except UnicodeDecodeError as err:
                    raise CorpusError(f"{path}:{lineno}: not valid UTF-8 ({err})") from err
                if not text.strip():
                    continue
                if suffix == ".jsonl":
                    try:
                        rec = json.loads(text)
                    except json.JSONDecodeError as err:
                        raise CorpusError(f"{path}:{lineno}: not valid JSON ({err})") from err
                    if not isinstance(rec, dict) or "text" not in rec:
                        raise CorpusError(f"{path}:{lineno}: expected an object with a 'text' "
                                          "field")
                    if rec["text"] is not None and not isinstance(rec["text"], str):
                        raise CorpusError(f"{path}:{lineno}: 'text' must be a string, got "
                                          f"{type(rec['text']).__name__}")
                    if not (rec["text"] or "").strip():  # null or blank
                        skipped += 1
                        where += [f"line {lineno}"] if len(where) < 5 else []
                        continue
                    yield Document(document_id(rec, lineno), rec["text"],
                                   str(rec.get("title") or ""))
                else:
                    yield Document(str(lineno), text)
    if skipped:
        warnings.warn(f"{path}: skipped {skipped} record(s) with empty text ("
                      + ", ".join(where) + (", ..." if skipped > len(where) else "")
                      + "): not indexed", stacklevel=2)


def _iter_tsv(path: pathlib.Path) -> Iterator[Document]:
    """DPR TSV: ``id<TAB>text<TAB>title`` (or ``id<TAB>text``) under a header line."""
    csv.field_size_limit(1 << 30)
    with io.TextIOWrapper(_open_binary(path), encoding="utf-8", newline="") as f:
        rows = csv.reader(f, delimiter="\t")

        def next_row(what: str) -> list[str] | None:
            try:
                return next(rows)
            except StopIteration:
                return None
            except (UnicodeDecodeError, csv.Error) as err:
                raise CorpusError(f"{path}:{rows.line_num + 1}: unreadable {what} ({err})") \
                    from err

        header = next_row("header")
        if header is None:
            return
        names = [h.strip().lower() for h in header]
        if "id" not in names or "text" not in names:
            raise CorpusError(f"{path}:1: the header must name the columns 'id' and 'text' "
                              f"(and optionally 'title'), got {header}")
        i_id, i_text = names.index("id"), names.index("text")
        i_title = names.index("title") if "title" in names else None
        while (fields := next_row("row")) is not None:
            if not fields:
                continue
            if len(fields) != len(names):
                raise CorpusError(f"{path}:{rows.line_num}: {len(fields)} field(s) where the "
                                  f"header has {len(names)} ({', '.join(names)})")
            yield Document(fields[i_id], fields[i_text],
                           fields[i_title] if i_title is not None else "")


def read_documents(path: str | pathlib.Path) -> list[Document]:
    """All documents of a corpus file as a list (see :func:`iter_documents`); raises
    :class:`CorpusError` when there are none."""
    docs = list(iter_documents(path))
    if not docs:
        raise CorpusError(f"{path}: the corpus is empty (no non-empty documents)")
    return docs


def _spans_words(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in re.finditer(r"\S+", text)]


def iter_chunks(docs: Iterable[Document], *, size: int = 100, overlap: int = 0,
                unit: str = "words", tokenizer=None, first_id: int = 0) -> Iterator[Passage]:
    """Stream passages of ``size`` words (DPR: 100) or tokens (REPLUG: 128) from documents.

    ``overlap`` units are shared between consecutive passages. Token chunking needs a
    ``tokenizer`` with offset mapping (any HF fast tokenizer). ``unit="none"`` keeps each
    document whole as one passage (corpora that are already passages, such as DPR's TSV). Ids
    are ``first_id, first_id+1, ...`` in order.
    """
    if unit not in ("words", "tokens", "none"):
        raise ValueError(f"unit must be 'words', 'tokens' or 'none', got {unit!r}")
    if unit != "none" and (size <= 0 or not 0 <= overlap < size):
        raise ValueError(f"need size > 0 and 0 <= overlap < size, got {size=} {overlap=}")
    if unit == "tokens" and tokenizer is None:
        raise ValueError("token chunking needs a tokenizer")
    next_id = first_id
    step = size - overlap
    for doc in docs:
        if unit == "none":
            yield Passage(next_id, doc.text, doc.title, doc.id, 0, len(doc.text))
            next_id += 1
            continue
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
            yield Passage(next_id, doc.text[start:end], doc.title, doc.id, start, end)
            next_id += 1


LEAKAGE = ("window", "document", "none")


def leakage_exclusions(items: Sequence, passages: Iterable[Passage],
                       policy: str = "window") -> list[list[int]]:
    """Per item (anything with ``source_id`` and a character ``span`` of that source, such as
    an evaluation window or an LSR training example), the ids of corpus passages it must not
    retrieve: passages of the same source overlapping the span (``"window"``), every passage
    of the source (``"document"``), or none (``"none"``, for a corpus disjoint from the data).
    When the corpus is built from the evaluated text, a passage overlapping the window would
    hand the LM its own target."""
    if policy not in LEAKAGE:
        raise ValueError(f"leakage must be one of {LEAKAGE}, got {policy!r}")
    # one pass over the passages (a stream from a store is fine), keeping only those of the
    # items' own sources: memory grows with the items, not the corpus
    wanted = {item.source_id for item in items} if policy != "none" else set()
    by_source: dict[str, list[Passage]] = {}
    for p in passages if wanted else ():
        if p.source_id in wanted:
            by_source.setdefault(p.source_id, []).append(p)
    out = []
    for item in items:
        same = by_source.get(item.source_id, []) if policy != "none" else []
        if policy == "window":
            same = [p for p in same if p.start < item.span[1] and p.end > item.span[0]]
        out.append([p.id for p in same])
    return out


def chunk_documents(docs: Iterable[Document], **kwargs) -> list[Passage]:
    """:func:`iter_chunks` as a list; raises :class:`CorpusError` when there are none."""
    passages = list(iter_chunks(docs, **kwargs))
    if not passages:
        raise CorpusError("chunking produced no passages (all documents empty?)")
    return passages


class PassageHasher:
    """The corpus checksum, fed one passage at a time (SHA-256 over each passage's JSON)."""

    def __init__(self):
        self._h = hashlib.sha256()

    def update(self, p: Passage) -> None:
        self._h.update(json.dumps(p.to_json(), sort_keys=True).encode())
        self._h.update(b"\n")

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def corpus_checksum(passages: Iterable[Passage]) -> str:
    h = PassageHasher()
    for p in passages:
        h.update(p)
    return h.hexdigest()


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


class _Elided:
    def __repr__(self) -> str:
        return "..."


_LITERALS = (int, float, complex, str, bytes, bool, type(None))


def _stable_signature(obj) -> str:
    """``inspect.signature`` text with run-time defaults elided: a default such as
    ``logging.shutdown``'s list of live handlers depends on what the process has imported, and
    would make the demo corpus (and its checksum) differ from one run to the next."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return ""
    params = [p.replace(default=_Elided()) if p.default is not p.empty
              and not isinstance(p.default, _LITERALS) else p for p in sig.parameters.values()]
    return str(sig.replace(parameters=params))


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
            sig = _stable_signature(obj)
            qual = f"{mod_name}.{name}"
            yield Document(qual, f"{qual}{sig}: {_clean(obj_doc)}", qual)


def demo_corpus(size: int = 100, overlap: int = 0) -> list[Passage]:
    """The demo's passages: Python docs chunked into ``size``-word passages."""
    return chunk_documents(python_docs_documents(), size=size, overlap=overlap)


def corpus_text(passage: Passage) -> str:
    """The text the retriever embeds for a passage (title prepended, as in DPR/Contriever)."""
    if passage.title and not passage.text.startswith(passage.title):
        return f"{passage.title}. {passage.text}"
    return passage.text
