"""Embeddings on disk: ``.npy`` rows read with ``pread`` (:class:`NpyRows`), row-addressable
sources over one file or consecutive shards (:class:`EmbeddingSource`), and the resumable,
multi-process embedding of a passage store into fixed-size shards (:func:`embed_store`)."""

from __future__ import annotations

import json
import os
import pathlib
import weakref
from typing import Callable, Sequence

import numpy as np

from replug_jax.fileio import atomic_path, write_json_atomic
from replug_jax.retrieval.corpus import corpus_text
from replug_jax.retrieval.integrity import IndexLoadError, sample_offsets, sample_sha256
from replug_jax.retrieval.store import PassageStore
from replug_jax.sharding import barrier

EMBED_SHARD_ROWS = 65536  # passages per embedding shard (the unit of resumption and of work split)


class NpyRows:
    """Rows of a 2-D ``.npy`` file read with ``pread`` rather than a memory map: what a build
    reads goes through the page cache without staying in the process's resident memory, so
    peak RSS does not grow with the file."""

    def __init__(self, path: str | pathlib.Path, *, n: int | None = None,
                 dim: int | None = None):
        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise IndexLoadError(f"{self.path}: no such embeddings file")
        try:
            with open(self.path, "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0) else
                               np.lib.format.read_array_header_2_0)
                shape, fortran, dtype = read_header(f)
                self.offset = f.tell()
        except ValueError as err:
            raise IndexLoadError(f"{self.path}: not a .npy array ({err})") from err
        if len(shape) != 2:
            raise IndexLoadError(f"{self.path}: embeddings must be a 2-D [N, D] array, got "
                                 f"shape {shape}")
        if dtype not in (np.float32, np.float16) or fortran:
            raise IndexLoadError(f"{self.path}: embeddings must be C-ordered float32 or "
                                 f"float16, got {dtype}{' (Fortran order)' if fortran else ''}")
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.row_bytes = shape[1] * self.dtype.itemsize
        expected = self.offset + shape[0] * self.row_bytes
        size = self.path.stat().st_size
        if size < expected:
            raise IndexLoadError(f"{self.path}: truncated ({size} bytes, the header's shape "
                                 f"{shape} needs {expected})")
        if n is not None and shape[0] != n:
            raise IndexLoadError(f"{self.path}: {shape[0]} embeddings for {n} passages")
        if dim is not None and shape[1] != dim:
            raise IndexLoadError(f"{self.path}: embedding dimension {shape[1]}, the "
                                 f"retriever's is {dim}")
        self._fd = os.open(self.path, os.O_RDONLY)
        # a finalizer, not __del__: it runs before interpreter teardown, so never warns
        weakref.finalize(self, os.close, self._fd)

    def __len__(self) -> int:
        return self.shape[0]

    def read(self, lo: int, hi: int) -> np.ndarray:
        raw = os.pread(self._fd, (hi - lo) * self.row_bytes, self.offset + lo * self.row_bytes)
        return np.frombuffer(raw, self.dtype).reshape(hi - lo, self.shape[1])

    def take(self, rows: np.ndarray) -> np.ndarray:
        return np.stack([self.read(int(r), int(r) + 1)[0] for r in rows]) if len(rows) else \
            np.zeros((0, self.shape[1]), self.dtype)


class EmbeddingSource:
    """Row-addressable ``[N, D]`` embeddings: in-memory arrays or ``.npy`` files (one, or
    consecutive shards); :meth:`rows` returns float32 for a row range."""

    def __init__(self, parts: list):
        self.parts = parts  # np.ndarray or NpyRows, consecutive row ranges
        self.starts = np.cumsum([0] + [len(a) for a in parts])
        self.n = int(self.starts[-1])
        dims = {a.shape[1] for a in parts}
        if len(dims) != 1:
            raise IndexLoadError(f"embedding parts of different dimensions {sorted(dims)}")
        self.dim = dims.pop()

    @classmethod
    def from_files(cls, paths: Sequence[str | pathlib.Path], **kwargs) -> "EmbeddingSource":
        return cls([NpyRows(p, **kwargs) for p in paths])

    @staticmethod
    def _read(part, lo: int, hi: int) -> np.ndarray:
        return part.read(lo, hi) if isinstance(part, NpyRows) else part[lo:hi]

    def rows(self, lo: int, hi: int) -> np.ndarray:
        out = []
        for part, start in zip(self.parts, self.starts[:-1]):
            a, b = max(lo, start), min(hi, start + len(part))
            if a < b:
                out.append(self._read(part, a - start, b - start))
        x = np.ascontiguousarray(np.concatenate(out) if len(out) > 1 else out[0], np.float32)
        if not np.isfinite(x).all():
            bad = lo + int(np.argwhere(~np.isfinite(x).all(axis=1))[0, 0])
            raise IndexLoadError(f"embeddings contain NaN or inf (row {bad}); refusing to "
                                 "index them")
        return x

    def take(self, rows: np.ndarray) -> np.ndarray:
        out = np.empty((len(rows), self.dim), np.float32)
        part = np.searchsorted(self.starts, rows, side="right") - 1
        for p in np.unique(part):
            sel = part == p
            local = rows[sel] - self.starts[p]
            src = self.parts[p]
            out[sel] = src.take(local) if isinstance(src, NpyRows) else src[local]
        return out


def embeddings_key(path: str | pathlib.Path) -> dict:
    """What identifies a user's embeddings file without reading it: its resolved path, size,
    modification time and a hash of its header and first and last MiB."""
    path = pathlib.Path(path).resolve()
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sample_sha256": sample_sha256(path, sample_offsets(st.st_size, 2))}


def embed_store(store: PassageStore, retriever, emb_dir: pathlib.Path, *,
                shard_rows: int = EMBED_SHARD_ROWS, params=None, progress: bool = True,
                process_index: int = 0, process_count: int = 1,
                on_shard: Callable[[int], None] | None = None) -> list[pathlib.Path]:
    """Embed the store into ``emb_dir/emb-XXXXX.npy``, ``shard_rows`` passages per file.

    Process ``p`` of ``P`` embeds the shards ``p, p+P, ...``; a finished shard is a complete
    file (written to a temporary name, then renamed), so a rerun skips it: an interrupted build
    resumes at shard granularity. ``emb.json`` records the encoder and corpus; a folder made
    with others is cleared first. Returns every shard's path (all processes' shards).
    """

    emb_dir.mkdir(parents=True, exist_ok=True)
    key = {"n": len(store), "shard_rows": shard_rows, "corpus_checksum": store.checksum,
           "encoder": retriever.identity, "dim": retriever.dim}
    key_path = emb_dir / "emb.json"
    if key_path.exists() and json.loads(key_path.read_text()) != key:
        if process_index == 0:
            for f in emb_dir.glob("emb-*.npy"):
                f.unlink()
    barrier("replug_emb_key")
    if process_index == 0:
        write_json_atomic(key, key_path)
    n_shards = -(-len(store) // shard_rows)
    paths = [emb_dir / f"emb-{s:05d}.npy" for s in range(n_shards)]
    mine = [s for s in range(process_index, n_shards, process_count)]

    def complete(s: int) -> bool:
        if not paths[s].exists():
            return False
        try:
            arr = np.load(paths[s], mmap_mode="r")
        except ValueError:
            return False
        rows = min(shard_rows, len(store) - s * shard_rows)
        return arr.shape == (rows, retriever.dim)

    todo = [s for s in mine if not complete(s)]
    total = sum(min(shard_rows, len(store) - s * shard_rows) for s in mine)
    bar = encoding_bar(total, progress)
    bar.update(total - sum(min(shard_rows, len(store) - s * shard_rows) for s in todo))
    for s in todo:
        lo, hi = s * shard_rows, min(len(store), (s + 1) * shard_rows)
        texts = [corpus_text(p) for p in store.slice(lo, hi)]
        emb = retriever.encode(texts, params, on_batch=bar.update)
        with atomic_path(paths[s], suffix=".npy") as tmp:
            np.save(tmp, emb)
        if on_shard is not None:
            on_shard(s)
    bar.close()
    barrier("replug_emb_done")
    return paths


def encoding_bar(total: int, enabled: bool = True, desc: str = "encoding"):
    """A progress bar that advances per batch, with passages/s and the time left."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="passage", disable=not enabled, smoothing=0.1,
                mininterval=0.5, dynamic_ncols=True)
