"""The passage store: passages in a memory-mapped Arrow IPC file, random access by id.

A datastore of tens of millions of passages (DPR's 21M Wikipedia passages, the paper's 36M Pile
documents) does not fit in memory as Python objects. :class:`PassageStore` keeps the columns
``id, text, title, source_id, start, end`` in record batches of a fixed number of rows in an
Arrow IPC file (``passages.arrow``) that is memory-mapped, not read: resident memory holds only
the pages a lookup touches, whatever N is. A small sidecar ``passages.json`` records the row
count, the batch size, the corpus checksum and, when the ids are ``first, first+1, ...`` (what
chunking produces), ``contiguous_from``, so that a lookup by id is arithmetic. Other id orders
(a hand-made passage list) keep a sorted id array in memory.

Writes stream (one record batch in memory at a time) to a temporary file that is renamed.
"""

from __future__ import annotations

import json
import pathlib
from typing import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from replug_jax.fileio import atomic_path, write_json_atomic
from replug_jax.retrieval.corpus import CorpusError, Passage, PassageHasher, corpus_text

STORE_FORMAT = 1
# Field order = Passage's, so rows construct positionally.
SCHEMA = pa.schema([("id", pa.int64()), ("text", pa.string()), ("title", pa.string()),
                    ("source_id", pa.string()), ("start", pa.int64()), ("end", pa.int64())])
_FIELDS = [f.name for f in SCHEMA]
BATCH_ROWS = 65536  # passages per Arrow record batch


def _batch(rows: list[Passage]) -> pa.RecordBatch:
    return pa.record_batch([pa.array([getattr(p, f) for p in rows], type=SCHEMA.field(f).type)
                            for f in _FIELDS], schema=SCHEMA)


class _Tally:
    """What the sidecar records about passages seen one at a time: their count, checksum and
    whether the ids run ``first, first+1, ...``."""

    def __init__(self):
        self.hasher, self.n, self.first, self.contiguous = PassageHasher(), 0, None, True

    def add(self, p: Passage) -> None:
        if self.first is None:
            self.first = p.id
        self.contiguous = self.contiguous and p.id == self.first + self.n
        self.hasher.update(p)
        self.n += 1

    def meta(self, batch_rows: int) -> dict:
        return {"format": STORE_FORMAT, "n": self.n, "batch_rows": batch_rows,
                "checksum": self.hasher.hexdigest(),
                "contiguous_from": self.first if self.contiguous else None}


def write_store(passages: Iterable[Passage], path: str | pathlib.Path, *,
                batch_rows: int = BATCH_ROWS, progress: bool = False) -> dict:
    """Stream ``passages`` into ``path`` (``.arrow``) and its ``.json`` sidecar; returns the
    sidecar (``n``, ``checksum``, ``batch_rows``, ``contiguous_from``)."""
    from tqdm.auto import tqdm

    if batch_rows <= 0:
        raise ValueError(f"batch_rows must be positive, got {batch_rows}")
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tally, rows = _Tally(), []
    bar = tqdm(desc="passages", unit="passage", disable=not progress, mininterval=0.5)
    with atomic_path(path) as tmp:
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, SCHEMA) as writer:
            for p in passages:
                tally.add(p)
                rows.append(p)
                if len(rows) == batch_rows:
                    writer.write_batch(_batch(rows))
                    bar.update(len(rows))
                    rows = []
            if rows:
                writer.write_batch(_batch(rows))
                bar.update(len(rows))
        bar.close()
        if tally.n == 0:
            raise CorpusError(f"{path}: no passages to store (empty corpus?)")
    meta = tally.meta(batch_rows)
    write_json_atomic(meta, sidecar(path))
    return meta


def sidecar(path: pathlib.Path) -> pathlib.Path:
    return path.with_suffix(".json")


class PassageStore:
    """Read-only passages by id or row: ``store[id]``, ``store.take(ids)``, ``store.row(i)``,
    iteration in row order, ``len(store)``. Open a file with :meth:`open` (memory-mapped) or
    wrap a list with :meth:`from_passages` (in memory)."""

    def __init__(self, batches: list[pa.RecordBatch] | None, meta: dict, *, reader=None,
                 name: str = "<memory>"):
        self._batches = batches
        self._reader = reader
        self._open_batches: dict[int, pa.RecordBatch] = {}
        self.meta = meta
        self.name = name
        self.n = int(meta["n"])
        self.batch_rows = int(meta["batch_rows"])
        self.checksum = meta["checksum"]
        self._first = meta.get("contiguous_from")
        self._sorted_ids = self._order = None
        if self._first is None:  # arbitrary ids: a sorted index in memory (8 bytes per row)
            ids = np.concatenate([self._get_batch(b).column("id").to_numpy()
                                  for b in range(self.num_batches)])
            self._order = np.argsort(ids, kind="stable")
            self._sorted_ids = ids[self._order]
            if len(np.unique(ids)) != len(ids):
                raise CorpusError(f"{name}: passage ids are not unique")

    @classmethod
    def open(cls, path: str | pathlib.Path) -> "PassageStore":
        path = pathlib.Path(path)
        side = sidecar(path)
        if not path.exists() or not side.exists():
            raise CorpusError(f"{path}: no passage store here (need {path.name} and {side.name})")
        try:
            meta = json.loads(side.read_text())
            reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        except (json.JSONDecodeError, pa.ArrowInvalid, OSError) as err:
            raise CorpusError(f"{path}: corrupt passage store ({err})") from err
        if meta.get("format") != STORE_FORMAT or reader.schema != SCHEMA:
            raise CorpusError(f"{path}: not a passage store of format {STORE_FORMAT}")
        expect = -(-int(meta["n"]) // int(meta["batch_rows"]))
        if reader.num_record_batches != expect:
            raise CorpusError(f"{path}: {reader.num_record_batches} record batches where "
                              f"{meta['n']} passages need {expect}: the file is truncated or "
                              "does not match its sidecar")
        return cls(None, meta, reader=reader, name=str(path))

    @classmethod
    def from_passages(cls, passages: Sequence[Passage], batch_rows: int = BATCH_ROWS
                      ) -> "PassageStore":
        passages = list(passages)
        if not passages:
            raise CorpusError("no passages (empty corpus)")
        tally = _Tally()
        for p in passages:
            tally.add(p)
        batches = [_batch(passages[i:i + batch_rows])
                   for i in range(0, len(passages), batch_rows)]
        return cls(batches, tally.meta(batch_rows))

    def write(self, path: str | pathlib.Path) -> dict:
        return write_store(iter(self), path, batch_rows=self.batch_rows)

    @property
    def num_batches(self) -> int:
        return -(-self.n // self.batch_rows)

    def _get_batch(self, b: int) -> pa.RecordBatch:
        if self._batches is not None:
            return self._batches[b]
        batch = self._open_batches.get(b)
        if batch is None:  # zero-copy views of the mapped file: only metadata is kept
            batch = self._open_batches[b] = self._reader.get_batch(b)
        return batch

    def __len__(self) -> int:
        return self.n

    def rows_of(self, ids) -> np.ndarray:
        """Row numbers of passage ``ids``; raises ``KeyError`` for an id not in the store."""
        ids = np.asarray(ids, np.int64).reshape(-1)
        if self._first is not None:
            rows = ids - self._first
            bad = (rows < 0) | (rows >= self.n)
        else:
            pos = np.searchsorted(self._sorted_ids, ids).clip(0, self.n - 1)
            bad = self._sorted_ids[pos] != ids
            rows = self._order[pos]
        if bad.any():
            raise KeyError(f"passage id {int(ids[bad][0])} is not in {self.name}")
        return rows

    def ids_of(self, rows) -> np.ndarray:
        rows = np.asarray(rows, np.int64)
        if self._first is not None:
            return rows + self._first
        flat = rows.reshape(-1)
        out = np.array([self._get_batch(int(r) // self.batch_rows).column("id")[
            int(r) % self.batch_rows].as_py() for r in flat], np.int64)
        return out.reshape(rows.shape)

    def row(self, r: int) -> Passage:
        if not 0 <= r < self.n:
            raise IndexError(f"row {r} out of range for {self.n} passages")
        b = self._get_batch(r // self.batch_rows)
        i = r % self.batch_rows
        return Passage(**{f: b.column(f)[i].as_py() for f in _FIELDS})

    def rows(self, rows) -> list[Passage]:
        """Passages at row numbers ``rows`` (in that order), one vectorised ``take`` per
        record batch touched."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.n):
            raise IndexError(f"rows out of range for {self.n} passages")
        out: list[Passage | None] = [None] * len(rows)
        batch_of = rows // self.batch_rows
        for b in np.unique(batch_of):
            where = np.flatnonzero(batch_of == b)
            part = self._get_batch(int(b)).take(pa.array(rows[where] % self.batch_rows))
            cols = [part.column(f).to_pylist() for f in _FIELDS]
            for j, values in zip(where, zip(*cols)):
                out[j] = Passage(*values)
        return out

    def __getitem__(self, passage_id: int) -> Passage:
        return self.row(int(self.rows_of([passage_id])[0]))

    def take(self, ids) -> list[Passage]:
        return self.rows(self.rows_of(ids))

    def __iter__(self) -> Iterator[Passage]:
        for b in range(self.num_batches):
            batch = self._get_batch(b)
            cols = [batch.column(f).to_pylist() for f in _FIELDS]
            for values in zip(*cols):
                yield Passage(*values)

    def slice(self, lo: int, hi: int) -> Iterator[Passage]:
        """Passages of rows ``lo..hi-1`` in order, one record batch at a time."""
        r = lo
        while r < hi:
            b, i = divmod(r, self.batch_rows)
            batch = self._get_batch(b)
            j = min(batch.num_rows, i + hi - r)
            part = batch.slice(i, j - i)
            cols = [part.column(f).to_pylist() for f in _FIELDS]
            for values in zip(*cols):
                yield Passage(*values)
            r += j - i


def _known(store: PassageStore, ids: list[int]) -> list[int]:
    """Those of passage ``ids`` that ``store`` holds (one vectorised lookup when it holds
    them all, the usual case; id by id to find the missing)."""
    try:
        store.rows_of(ids)
        return list(ids)
    except KeyError:
        pass
    known = []
    for i in ids:
        try:
            store.rows_of([i])
        except KeyError:
            continue
        known.append(i)
    return known


def gold_of(row: dict, where: str) -> int | str | tuple[int, ...] | None:
    """The gold of one question line: ``gold_doc`` (a document id of the corpus, an integer
    or a string) or ``gold_passage`` (one passage id, or a list of them: the paragraph itself
    where a document is cut into many), as :func:`gold_passages` takes it (passage ids as a
    tuple). Both on one line, or a value of the wrong type, is refused naming ``where``."""
    doc, psg = row.get("gold_doc"), row.get("gold_passage")
    if doc is not None and psg is not None:
        raise ValueError(f"{where}: give 'gold_doc' (a document) or 'gold_passage' (passage "
                         "ids), not both")
    if doc is not None:
        if isinstance(doc, bool) or not isinstance(doc, (int, str)):
            raise ValueError(f"{where}: 'gold_doc' must be a document id of the corpus "
                             f"(a string or an integer), got {doc!r}")
        return doc
    if psg is None:
        return None
    ids = psg if isinstance(psg, list) else [psg]
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"{where}: 'gold_passage' must be a passage id of the store (an "
                         f"integer) or a non-empty list of them, got {psg!r}")
    return tuple(ids)


def gold_passages(gold_docs: Sequence, store, names: Sequence[str]) -> list:
    """The passage ids each gold names in ``store`` (any iterable of passages with ``id``
    and ``source_id``): a ``gold_doc`` is a document id of the corpus, whatever its JSON type
    (``7`` and ``"7"`` name the same document: DPR's ``psgs_w100.tsv`` numbers its passages
    from 1, a corpus without ids numbers its lines from 1), and every passage cut from that
    document counts; a tuple (:func:`gold_of`'s ``gold_passage``) is passage ids already and
    each must be in the store. None passes through. A value that names nothing in the store
    is refused in one line, naming the example (``names``), rather than scoring recall 0
    before and after training."""
    for name, g in zip(names, gold_docs):
        if g is not None and not isinstance(g, tuple) and (
                isinstance(g, bool) or not isinstance(g, (int, str))):
            raise ValueError(f"example {name!r}: gold_doc must be a document id of the corpus "
                             f"(a string or an integer), got {g!r}")
    wanted = {str(g) for g in gold_docs if g is not None and not isinstance(g, tuple)}
    named_ids = {i for g in gold_docs if isinstance(g, tuple) for i in g}
    by_source: dict[str, list[int]] = {}
    present: set[int] = set()
    scan_ids = bool(named_ids) and not isinstance(store, PassageStore)
    if named_ids and not scan_ids:  # a store looks its ids up without a pass
        present = set(_known(store, sorted(named_ids)))
    if wanted or scan_ids:  # one pass over the store, only when it must be read
        for p in store:
            if p.source_id in wanted:
                by_source.setdefault(p.source_id, []).append(p.id)
            if scan_ids and p.id in named_ids:
                present.add(p.id)
    out = []
    for name, g in zip(names, gold_docs):
        if g is None:
            out.append(g)
            continue
        if isinstance(g, tuple):
            missing = [i for i in g if i not in present]
            if missing:
                raise ValueError(f"example {name!r}: gold_passage {missing[0]} is no passage "
                                 f"id of the store ({len(store)} passages)")
            out.append(g)
            continue
        ids = by_source.get(str(g))
        if not ids:
            raise ValueError(f"example {name!r}: gold_doc {g!r} is no document id of the "
                             f"corpus ({len(store)} passages; ids are the corpus's `id` "
                             "field, or line numbers from 1 where it has none)")
        out.append(tuple(ids))
    return out


class PassageTexts(Sequence[str]):
    """The texts the retriever embeds (:func:`corpus_text`) of rows ``lo..hi-1`` of a store,
    read a slice at a time: what an index refresh encodes, without the corpus in memory."""

    def __init__(self, store: PassageStore, lo: int = 0, hi: int | None = None):
        self.store, self.lo = store, lo
        self.hi = len(store) if hi is None else hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, i):
        if isinstance(i, slice):
            a, b, step = i.indices(len(self))
            if step != 1:
                raise ValueError("PassageTexts slices must be contiguous")
            return [corpus_text(p) for p in self.store.slice(self.lo + a, self.lo + b)]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return corpus_text(self.store.row(self.lo + i % len(self)))
