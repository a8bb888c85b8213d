"""Dense indexes at any scale: FAISS shards over a memory-mapped passage store, and exact
top-k in JAX over a device-sharded embedding matrix.

An index directory::

    manifest.json            encoder, factory, dim, n, corpus checksum, shards, file table
    passages.arrow/.json     the passage store (memory-mapped, see retrieval/store.py)
    shard-00000/index.faiss  FAISS index of rows lo..hi-1 (labels are rows - lo)
    shard-00000/shard.json   its range, encoder and corpus, so a stray shard is refused
    shard-00000/vectors.npy  with --rerank: float16 vectors to re-score candidates exactly

Every FAISS shard covers a contiguous range of store rows and is built, trained and saved on
its own (on any host); a search queries every shard and merges their top-k exactly. FAISS is
exact inner product by default (cosine, since the retriever normalises embeddings) or any
``faiss.index_factory`` string (``IVF4096,Flat``, ``IVF4096,PQ48``, ``OPQ48,IVF4096,PQ48``):
quantizers are trained on a seeded sample sized from ``nlist`` and vectors are added in
batches read from memmaps, so peak memory is about the index's own bytes plus one batch.

Loading memory-maps the FAISS files and the store. It checks every file's size, hashes the
small ones, and hashes a large one in full only when its size or mtime differs from the
manifest; ``replug index verify`` (:meth:`Index.verify`) hashes everything.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import shutil
import time
import warnings
import weakref
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from replug_jax.retrieval.corpus import Passage
from replug_jax.fileio import atomic_path, replace_dir, write_json_atomic
from replug_jax.retrieval.store import PassageStore
from replug_jax.sharding import host_copy, replicate

INDEX_VERSION = 3  # 3: build key with every shard setting, sampled hashes
SMALL_FILE_BYTES = 64 << 20  # always hashed on load
STORE = "passages.arrow"


class IndexLoadError(ValueError):
    """A missing, corrupt or mismatched index directory or embeddings file."""


@dataclasses.dataclass
class SearchResult:
    ids: np.ndarray  # [B, k] int64 passage ids, -1 where fewer than k exist
    scores: np.ndarray  # [B, k] float32 similarities, -inf where missing
    passages: list[list[Passage]]  # [B][<=k]

    @property
    def valid(self) -> np.ndarray:
        return self.ids >= 0


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


SAMPLE_BYTES = 1 << 20  # one sampled block of a large file


def _sample_offsets(size: int, count: int = 4) -> list[int]:
    """``count`` block offsets spread evenly over a file of ``size`` bytes (first and last
    block included): where a large file is sampled at every load."""
    last = max(0, size - SAMPLE_BYTES)
    return sorted({int(x) for x in np.linspace(0, last, count)})


def _sample_sha256(path: pathlib.Path, offsets: Sequence[int]) -> str:
    """SHA-256 of the ``SAMPLE_BYTES`` blocks of ``path`` at ``offsets``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for offset in offsets:
            f.seek(offset)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


# -- exact top-k in JAX ----------------------------------------------------------------------

def _blocked_topk(q_BD, c_ND, k: int, block: int, n_valid, offset):
    """Top-k of ``q_BD @ c_ND.T`` scanning ``c_ND`` in blocks (memory ``O(B·block)``); rows
    at or past ``n_valid`` (a traced bound: the corpus's padding rows) are ignored and
    ``offset`` is added to the returned row numbers. The blocks' own padding (``c_ND`` cut
    into whole blocks) is never visible, whatever ``n_valid`` says: on a device that is not
    the last, ``n_valid`` exceeds its own row count."""
    n = c_ND.shape[0]
    block = min(block, n)
    n_blocks = -(-n // block)
    c_blocks = jnp.pad(c_ND, ((0, n_blocks * block - n), (0, 0))).reshape(n_blocks, block, -1)
    starts = jnp.arange(n_blocks) * block
    kb = min(k, block)
    limit = jnp.minimum(n_valid, n)

    def one_block(args):
        cb, start = args
        s = jnp.dot(q_BD.astype(cb.dtype), cb.T, preferred_element_type=jnp.float32)
        s = jnp.where(start + jnp.arange(block)[None, :] < limit, s, -jnp.inf)
        vals, idx = jax.lax.top_k(s, kb)
        return vals, idx + start + offset

    vals, idx = jax.lax.map(one_block, (c_blocks, starts))  # [nb, B, kb]
    vals = jnp.moveaxis(vals, 0, 1).reshape(q_BD.shape[0], -1)
    idx = jnp.moveaxis(idx, 0, 1).reshape(q_BD.shape[0], -1)
    top, pos = jax.lax.top_k(vals, min(k, vals.shape[1]))
    return top, jnp.take_along_axis(idx, pos, axis=1)


def exact_topk(queries_BD, corpus_ND, k: int, block: int = 65536):
    """Exact maximum-inner-product top-k in JAX on one device: the oracle FAISS is tested
    against. Returns ``(scores [B, k], rows [B, k])``."""
    q = jnp.asarray(queries_BD, jnp.float32)
    c = jnp.asarray(corpus_ND)
    return _blocked_topk(q, c, min(k, c.shape[0]), block, c.shape[0], 0)


def corpus_rows(n: int, mesh: jax.sharding.Mesh, axis: str = "data") -> slice:
    """The rows of an ``n``-row corpus that this process holds when it is sharded along N on
    ``mesh`` (all of them for one process): the process's devices hold a contiguous block of
    the corpus padded to a multiple of the device count."""
    per_process = -(-n // mesh.shape[axis]) * mesh.shape[axis] // jax.process_count()
    lo = jax.process_index() * per_process
    return slice(min(lo, n), min(lo + per_process, n))


def shard_corpus(corpus_ND, mesh: jax.sharding.Mesh, *, axis: str = "data",
                 dtype=jnp.bfloat16, n: int | None = None):
    """Place a corpus on ``mesh`` split along N (padded to a multiple of the device count with
    rows that never win), in ``dtype``. ``corpus_ND`` is the whole corpus (each process takes
    its rows), or, with ``n`` given, only this process's rows :func:`corpus_rows` ``(n)``, so
    that no host ever holds all of it. Returns ``(array [N_pad, D], n)``."""
    full = n is None
    n = len(corpus_ND) if full else n
    d = mesh.shape[axis]
    n_pad = -(-n // d) * d
    rows = corpus_rows(n, mesh, axis)
    local = np.asarray(corpus_ND[rows] if full else corpus_ND)
    if len(local) != rows.stop - rows.start:
        raise ValueError(f"{len(local)} local rows where this process holds rows "
                         f"{rows.start}..{rows.stop - 1}")
    per_process = n_pad // jax.process_count()
    if len(local) < per_process:
        local = np.concatenate([local, np.zeros((per_process - len(local), local.shape[1]),
                                                local.dtype)])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(axis))
    array = jax.make_array_from_process_local_data(sharding, np.asarray(local, dtype),
                                                   (n_pad, local.shape[1]))
    return array, n


def sharded_topk(queries_BD, corpus_ND: jax.Array, k: int, n_valid: int,
                 mesh: jax.sharding.Mesh, *, axis: str = "data", block: int = 65536):
    """Exact top-k over a corpus sharded along N on ``mesh`` (from :func:`shard_corpus`).

    Each device takes the top-k of its own rows (``lax.top_k`` over blocks), the per-device
    candidates are gathered (``all_gather``, k·d per query) and merged: the same top-k as one
    device over the whole corpus (what Atlas does with PyTorch, here one jitted function).
    Returns ``(scores [B, k] f32, rows [B, k] int32)``, replicated.
    """
    fn = _sharded_topk_fn(mesh, axis, min(k, n_valid), n_valid,
                          corpus_ND.shape[0] // mesh.shape[axis], block)
    return fn(replicate(np.asarray(queries_BD, np.float32), mesh), corpus_ND)


@functools.lru_cache(maxsize=64)
def _sharded_topk_fn(mesh, axis: str, k: int, n_valid: int, rows_per_device: int, block: int):
    """The jitted shard_map of :func:`sharded_topk` (cached: one compilation per shape)."""
    P = jax.sharding.PartitionSpec

    def local(q, c):
        offset = jax.lax.axis_index(axis) * rows_per_device
        vals, idx = _blocked_topk(q, c, min(k, rows_per_device), block, n_valid - offset,
                                  offset)
        vals = jax.lax.all_gather(vals, axis, axis=1, tiled=True)
        idx = jax.lax.all_gather(idx, axis, axis=1, tiled=True)
        top, pos = jax.lax.top_k(vals, k)
        return top, jnp.take_along_axis(idx, pos, axis=1)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(axis)),
                                 out_specs=(P(), P()), check_vma=False))


class DeviceIndex:
    """Training-time retrieval in JAX: the corpus embeddings as one array sharded along N over
    a mesh (bf16 by default), searched exactly with :func:`sharded_topk`. The same
    ``search`` contract as :class:`Index`, and no FAISS rebuild: a refresh re-embeds and
    swaps the array in. Scores are exact inner products of the stored (possibly bf16)
    vectors, accumulated in float32."""

    def __init__(self, embeddings_ND, passages: Sequence[Passage] | PassageStore,
                 mesh: jax.sharding.Mesh, *, dtype=jnp.bfloat16, axis: str = "data",
                 encoder: dict | None = None, local: bool = False):
        emb = np.asarray(embeddings_ND)
        self.store = passages if isinstance(passages, PassageStore) else \
            PassageStore.from_passages(passages)
        if emb.ndim != 2 or (not local and emb.shape[0] != len(self.store)):
            raise ValueError(f"{emb.shape} embeddings for {len(self.store)} passages")
        self.mesh, self.axis = mesh, axis
        self.array, self.n = shard_corpus(emb, mesh, axis=axis, dtype=dtype,
                                          n=len(self.store) if local else None)
        self.manifest = {"factory": f"jax-exact-{jnp.dtype(dtype).name}", "dim": emb.shape[1],
                         "n": self.n, "encoder": encoder or {},
                         "corpus_checksum": self.store.checksum}

    def __len__(self) -> int:
        return self.n

    @property
    def passages(self) -> PassageStore:
        return self.store

    def search(self, queries_BD, k: int, exclude_ids=None, *, nprobe: int | None = None,
               rerank: int | None = None) -> SearchResult:
        """Exact top-``k``: ``nprobe`` and ``rerank`` (the knobs of an approximate
        :class:`Index`) are accepted and have nothing to change."""
        q = _checked_queries(queries_BD, self.manifest["dim"], k)
        excl = per_query_exclusions(exclude_ids, q.shape[0])
        fetch = min(self.n, k + max((len(e) for e in excl), default=0))
        scores, rows = host_copy(sharded_topk(q, self.array, fetch, self.n, self.mesh,
                                              axis=self.axis))
        return _assemble(self.store, scores.astype(np.float32), rows.astype(np.int64), excl, k)

    def reconstruct_all(self) -> np.ndarray:
        """The stored vectors (this process's single-process view: tests and small runs)."""
        return np.asarray(self.array, np.float32)[:self.n]


def _checked_queries(queries_BD, dim: int, k: int) -> np.ndarray:
    """``[B, dim]`` float32 queries for a top-``k`` search, or a ``ValueError``."""
    q = np.ascontiguousarray(np.asarray(queries_BD, np.float32))
    if q.ndim != 2 or q.shape[1] != dim:
        raise ValueError(f"queries must be [B, {dim}], got {q.shape}")
    if k <= 0:
        raise ValueError(f"k must be positive, got {k}")
    return q


def _set_nprobe(index, nprobe: int) -> bool:
    """Set the IVF lists searched per query through FAISS's parameter space (which reaches
    inside pre-transforms, shards and replicas; ``GpuParameterSpace`` for GPU indexes, which
    ``extract_index_ivf`` does not accept); False for an index without inverted lists."""
    import faiss

    gpu = faiss.get_num_gpus() > 0 and hasattr(faiss, "GpuParameterSpace")
    space = faiss.GpuParameterSpace() if gpu else faiss.ParameterSpace()
    try:
        space.set_index_parameter(index, "nprobe", int(nprobe))
    except RuntimeError:
        return False
    return True


def per_query_exclusions(exclude_ids, num_queries: int) -> list[set[int]]:
    """``exclude_ids`` as one set per query: ``None``, one collection of ids for every query,
    or ``num_queries`` collections (one per query)."""
    if exclude_ids is None:
        return [set() for _ in range(num_queries)]
    items = list(exclude_ids)
    if items and len(items) == num_queries and all(
            isinstance(e, (set, list, tuple, np.ndarray, frozenset)) for e in items):
        return [set(int(i) for i in e) for e in items]
    shared = set(int(i) for i in items)
    return [shared] * num_queries


# -- embeddings on disk ----------------------------------------------------------------------

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


def train_size_for(base, n: int) -> int:
    """Training vectors for a FAISS index: 64 per IVF list (FAISS warns below 39) and at least
    16384 (PQ's 256 centroids per sub-quantizer), capped at ``n``."""
    import faiss

    try:
        nlist = faiss.extract_index_ivf(base).nlist
    except RuntimeError:
        nlist = 0
    return int(min(n, max(64 * nlist, 16384)))


def build_faiss(source: EmbeddingSource, lo: int, hi: int, factory: str = "Flat", *,
                nprobe: int = 16, train_size: int | None = None, add_batch: int = 65536,
                seed: int = 0, progress: bool = False):
    """A FAISS index of rows ``lo..hi-1`` of ``source``: trained on a seeded sample, filled in
    batches of ``add_batch`` rows (labels ``0..hi-lo-1``)."""
    import faiss
    from tqdm.auto import tqdm

    n = hi - lo
    base = faiss.index_factory(source.dim, factory, faiss.METRIC_INNER_PRODUCT)
    if not base.is_trained:
        size = train_size or train_size_for(base, n)
        rows = np.sort(np.random.default_rng(seed).choice(n, size=min(size, n), replace=False))
        base.train(source.take(rows + lo))
    _set_nprobe(base, nprobe)
    bar = tqdm(total=n, desc=f"adding to {factory}", unit="vector", mininterval=0.5,
               disable=not progress or n <= add_batch)
    flat = faiss.downcast_index(base)
    if type(flat) in (faiss.IndexFlatIP, faiss.IndexFlat) and n > 0:
        # Size the flat storage once and fill it in place: growing it by ``add`` would
        # reallocate and copy (peak up to twice the index); this way it is the index + a batch.
        flat.codes.resize(n * flat.code_size)
        view = faiss.rev_swig_ptr(flat.codes.data(), n * flat.code_size)
        rows_ND = view.view(np.float32).reshape(n, source.dim)
        for a in range(lo, hi, add_batch):
            x = source.rows(a, min(hi, a + add_batch))
            rows_ND[a - lo:a - lo + len(x)] = x
            bar.update(len(x))
        flat.ntotal = n
    else:
        for a in range(lo, hi, add_batch):
            x = source.rows(a, min(hi, a + add_batch))
            base.add(x)
            bar.update(len(x))
    bar.close()
    return base


# -- the index -------------------------------------------------------------------------------

def _gpu_clone(index, mode: str):
    """Move a FAISS index to the GPUs when FAISS sees any: ``replicate`` on every GPU when it
    fits one, ``shard`` across GPUs (FAISS ``IndexShards``) when it does not; ``auto`` picks by
    the index's bytes against the smallest GPU's memory as JAX reports it."""
    import faiss

    if mode == "cpu" or faiss.get_num_gpus() == 0:
        return index
    if mode == "auto":
        try:
            limit = min(d.memory_stats()["bytes_limit"] for d in jax.devices("gpu"))
        except (RuntimeError, KeyError, TypeError):
            limit = None
        size = faiss.serialize_index(index).nbytes if limit is not None else 0
        mode = "shard" if limit is not None and size > 0.6 * limit else "replicate"
    co = faiss.GpuMultipleClonerOptions()
    co.shard = mode == "shard"
    return faiss.index_cpu_to_all_gpus(index, co)


class Index:
    """FAISS shards + the passage store + a manifest describing how they were made.

    ``shards`` is a list of ``(faiss_index, lo)``: shard labels are store rows minus ``lo``.
    """

    def __init__(self, shards: list[tuple[object, int]], store: PassageStore, manifest: dict,
                 gpu: str = "auto"):
        self.shards = shards
        self.store = store
        self.manifest = manifest
        total = sum(int(ix.ntotal) for ix, _ in shards)
        if total != len(store):
            raise IndexLoadError(f"{total} vectors for {len(store)} passages")
        self._search = [(_gpu_clone(ix, gpu), lo) for ix, lo in shards]
        self._vectors: list[NpyRows | None] = [None] * len(shards)

    def __len__(self) -> int:
        return len(self.store)

    @property
    def passages(self) -> PassageStore:
        """The passages, by id (``index.passages[id]``) or in order (iteration)."""
        return self.store

    @classmethod
    def build(cls, embeddings_ND: np.ndarray, passages: Sequence[Passage] | PassageStore, *,
              factory: str = "Flat", encoder: dict | None = None, nprobe: int = 16,
              extra: dict | None = None) -> "Index":
        """An in-memory, one-shard index of ``embeddings_ND`` (row i is the i-th passage)."""
        emb = np.asarray(embeddings_ND)
        if emb.ndim != 2 or emb.shape[0] == 0:
            raise ValueError(f"need a non-empty [N, D] embedding matrix, got {emb.shape}")
        store = passages if isinstance(passages, PassageStore) else \
            PassageStore.from_passages(passages)
        if emb.shape[0] != len(store):
            raise ValueError(f"{emb.shape[0]} embeddings for {len(store)} passages")
        if not np.isfinite(emb).all():
            raise ValueError("embeddings contain NaN or inf; refusing to index them")
        source = EmbeddingSource([emb])
        faiss_index = build_faiss(source, 0, len(store), factory, nprobe=nprobe)
        manifest = {"version": INDEX_VERSION, "factory": factory, "metric": "inner_product",
                    "dim": int(emb.shape[1]), "n": len(store), "nprobe": nprobe,
                    "encoder": encoder or {}, "corpus_checksum": store.checksum,
                    "shards": [{"dir": "shard-00000", "lo": 0, "hi": len(store)}],
                    **(extra or {})}
        return cls([(faiss_index, 0)], store, manifest)

    def search(self, queries_BD: np.ndarray, k: int,
               exclude_ids: Sequence[Iterable[int]] | Iterable[int] | None = None, *,
               nprobe: int | None = None, rerank: int | None = None) -> SearchResult:
        """Top-``k`` passages per query over every shard (exact merge), skipping
        ``exclude_ids`` (the leakage filter): one collection for all queries or one per query.
        When fewer than ``k`` passages are available, the missing slots have id -1 and a
        warning says so.

        ``nprobe`` (IVF lists searched) and ``rerank`` (re-score ``rerank × k`` candidates
        exactly from the stored vectors; 0: the approximate scores as they are) override the
        manifest's defaults for this call; re-ranking needs an index built with stored vectors
        (``--rerank`` or ``--target-recall``)."""
        q = _checked_queries(queries_BD, self.manifest["dim"], k)
        b = q.shape[0]
        excl = per_query_exclusions(exclude_ids, b)
        fetch = k + max((len(e) for e in excl), default=0)
        factor = self.manifest.get("rerank_factor", 0) if rerank is None else int(rerank)
        if factor < 0:
            raise ValueError(f"rerank must be >= 0, got {factor}")
        if factor and any(v is None for v in self._vectors):
            raise ValueError("re-ranking needs the vectors stored with the index; rebuild it "
                             "with --rerank F or --target-recall R")
        if nprobe is not None and nprobe <= 0:
            raise ValueError(f"nprobe must be positive, got {nprobe}")
        default_nprobe = self.manifest.get("nprobe", 16)
        scores, rows = [], []
        for (ix, lo), vectors in zip(self._search, self._vectors):
            if nprobe is not None:
                _set_nprobe(ix, nprobe)
            try:
                s, r = ix.search(q, min(fetch * max(factor, 1), int(ix.ntotal)))
            finally:
                if nprobe is not None:
                    _set_nprobe(ix, default_nprobe)
            if factor and vectors is not None:  # exact inner products of the candidates
                s = _exact_scores(q, vectors, r)
            scores.append(np.where(r >= 0, s, -np.inf).astype(np.float32))
            rows.append(np.where(r >= 0, r + lo, -1))
        scores_all, rows_all = np.concatenate(scores, 1), np.concatenate(rows, 1)
        order = np.lexsort((rows_all, -scores_all), axis=1)  # score desc, then row
        scores_all = np.take_along_axis(scores_all, order, 1)
        rows_all = np.take_along_axis(rows_all, order, 1)
        return _assemble(self.store, scores_all, rows_all, excl, k)

    def set_nprobe(self, nprobe: int) -> None:
        """IVF lists searched per query from now on (recall against speed); no-op for
        indexes without inverted lists."""
        if all([_set_nprobe(ix, nprobe) for ix, _ in self._search]):
            self.manifest["nprobe"] = nprobe

    def reconstruct_all(self) -> np.ndarray:
        """``[N, D]`` stored vectors in passage order (exact for Flat indexes)."""
        return np.concatenate([ix.reconstruct_n(0, int(ix.ntotal)) for ix, _ in self.shards])

    def save(self, directory: str | pathlib.Path) -> pathlib.Path:
        """Atomically write the index directory (temporary folder, then rename)."""
        out = pathlib.Path(directory)
        tmp = out.with_name(out.name + ".saving")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.store.write(tmp / STORE)
        for (ix, lo), spec in zip(self.shards, self.manifest["shards"]):
            _write_shard(tmp / spec["dir"], ix, spec["lo"], spec["hi"], self.manifest)
        for spec, vectors in zip(self.manifest["shards"], self._vectors):
            if vectors is not None:  # the re-ranking vectors travel with the index
                shutil.copyfile(vectors.path, tmp / spec["dir"] / "vectors.npy")
        _finish(tmp, self.manifest)
        replace_dir(tmp, out)
        return out

    @staticmethod
    def _read_manifest(d: pathlib.Path) -> dict:
        manifest_path = d / "manifest.json"
        if not d.is_dir():
            raise IndexLoadError(f"{d}: no such index directory")
        if not manifest_path.exists():
            raise IndexLoadError(f"{d}: no manifest.json, so this is not a complete index "
                                 "(an interrupted build?); rebuild it")
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise IndexLoadError(f"{manifest_path}: corrupt manifest ({err})") from err
        if manifest.get("version") != INDEX_VERSION:
            raise IndexLoadError(f"{d}: index version {manifest.get('version')} is not "
                                 f"{INDEX_VERSION}; rebuild it")
        return manifest

    @staticmethod
    def _check_files(d: pathlib.Path, manifest: dict, full: bool) -> None:
        for name, info in manifest.get("files", {}).items():
            path = d / name
            if not path.exists():
                raise IndexLoadError(f"{path}: missing; the index directory is incomplete")
            st = path.stat()
            if st.st_size != info["size"]:
                raise IndexLoadError(f"{path}: {st.st_size} bytes where the manifest records "
                                     f"{info['size']}: the file is truncated or was replaced")
            if full or st.st_size <= SMALL_FILE_BYTES or st.st_mtime_ns != info["mtime_ns"]:
                if _sha256(path) != info["sha256"]:
                    raise IndexLoadError(f"{path}: checksum mismatch, the file is corrupt")
            elif "sample_offsets" in info and _sample_sha256(
                    path, info["sample_offsets"]) != info["sample_sha256"]:
                raise IndexLoadError(f"{path}: sampled blocks differ from the manifest's "
                                     "hashes, the file is corrupt (replug index verify "
                                     "checks it whole)")

    @classmethod
    def verify(cls, directory: str | pathlib.Path) -> dict:
        """Hash every file of an index directory against its manifest (``replug index
        verify``); raises :class:`IndexLoadError` on the first problem."""
        d = pathlib.Path(directory)
        manifest = cls._read_manifest(d)
        cls._check_files(d, manifest, full=True)
        return {"files": len(manifest.get("files", {})),
                "bytes": sum(f["size"] for f in manifest.get("files", {}).values())}

    @classmethod
    def load(cls, directory: str | pathlib.Path, *, expect_encoder: dict | None = None,
             expect_corpus_checksum: str | None = None, mmap: bool = True,
             gpu: str = "auto") -> "Index":
        """Load and check an index directory; refuse a mismatched encoder or corpus, a
        missing, truncated or corrupt file, or a shard of another index."""
        d = pathlib.Path(directory)
        manifest = cls._read_manifest(d)
        if expect_encoder is not None:
            got = manifest.get("encoder", {})
            for key in ("fingerprint", "pooling", "similarity"):
                if key in expect_encoder and got.get(key) != expect_encoder[key]:
                    raise IndexLoadError(
                        f"{d}: built with encoder {got.get('source')!r} ({key}="
                        f"{got.get(key)!r}) but the current retriever is "
                        f"{expect_encoder.get('source')!r} ({key}={expect_encoder[key]!r}); "
                        "rebuild the index with this retriever")
        if expect_corpus_checksum is not None and \
                manifest.get("corpus_checksum") != expect_corpus_checksum:
            raise IndexLoadError(f"{d}: built from a different corpus (checksum "
                                 f"{manifest.get('corpus_checksum', '?')[:12]} vs "
                                 f"{expect_corpus_checksum[:12]}); rebuild it")
        for spec in manifest["shards"]:  # cheap checks first: a shard missing or stray
            _check_shard(d / spec["dir"], _read_shard_info(d / spec["dir"]), spec, manifest)
        cls._check_files(d, manifest, full=False)
        return cls._open(d, manifest, mmap=mmap, gpu=gpu)

    @classmethod
    def _open(cls, d: pathlib.Path, manifest: dict, *, mmap: bool = True,
              gpu: str = "auto") -> "Index":
        """The index of directory ``d`` described by ``manifest`` (its files already
        checked): the store, the FAISS shards, the re-ranking vectors, the manifest's
        nprobe."""
        try:
            store = PassageStore.open(d / STORE)
        except ValueError as err:
            raise IndexLoadError(str(err)) from err
        shards = []
        for spec in manifest["shards"]:
            sd = d / spec["dir"]
            ix = _read_faiss(sd / "index.faiss", mmap)
            if ix.ntotal != spec["hi"] - spec["lo"]:
                raise IndexLoadError(f"{sd}: {ix.ntotal} vectors for rows {spec['lo']}.."
                                     f"{spec['hi'] - 1}")
            shards.append((ix, spec["lo"]))
        if store.checksum != manifest["corpus_checksum"]:
            raise IndexLoadError(f"{d / STORE}: passages of another corpus than the manifest's")
        index = cls(shards, store, manifest, gpu=gpu)
        index.set_nprobe(manifest.get("nprobe", 16))  # the manifest's, not the file's own
        if manifest.get("rerank_vectors"):
            index._vectors = [NpyRows(d / spec["dir"] / "vectors.npy",
                                      n=spec["hi"] - spec["lo"], dim=manifest["dim"])
                              for spec in manifest["shards"]]
        return index


def _assemble(store: PassageStore, scores_BF: np.ndarray, rows_BF: np.ndarray,
              excl: list[set[int]], k: int) -> SearchResult:
    """The top-``k`` of ranked candidates (rows -1 = none) per query, minus exclusions, with
    their passages fetched in one vectorised read."""
    b = scores_BF.shape[0]
    out_ids = np.full((b, k), -1, np.int64)
    out_scores = np.full((b, k), -np.inf, np.float32)
    out_rows = np.full((b, k), -1, np.int64)
    short = 0
    for i in range(b):
        valid = rows_BF[i] >= 0
        ids = store.ids_of(rows_BF[i][valid])
        keep = [(s, j, r) for s, j, r in zip(scores_BF[i][valid], ids, rows_BF[i][valid])
                if int(j) not in excl[i]][:k]
        short += len(keep) < k
        for slot, (s, j, r) in enumerate(keep):
            out_ids[i, slot], out_scores[i, slot], out_rows[i, slot] = j, s, r
    found = out_rows >= 0
    fetched = iter(store.rows(out_rows[found]))
    passages = [[next(fetched) for _ in range(int(found[i].sum()))] for i in range(b)]
    if short:
        warnings.warn(f"asked for k={k} but only {len(store)} passages exist (after "
                      f"exclusions) for {short} of {b} queries; returning what exists",
                      stacklevel=3)
    return SearchResult(out_ids, out_scores, passages)


def _read_faiss(path: pathlib.Path, mmap: bool):
    """Read a FAISS file, memory-mapped when ``mmap``: flat codes through
    ``IO_FLAG_MMAP_IFC``, inverted lists through ``IO_FLAG_MMAP`` (each refuses the other's
    kind, so the first that applies is used)."""
    import faiss

    attempts = [faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY,
                faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY] if mmap else [0]
    error = None
    for flags in attempts:
        try:
            return faiss.read_index(str(path), flags)
        except RuntimeError as err:
            error = err
    raise IndexLoadError(f"{path}: FAISS cannot read it ({str(error).splitlines()[0]})")


def _read_shard_info(sd: pathlib.Path) -> dict:
    if not (sd / "shard.json").exists():
        raise IndexLoadError(f"{sd}: missing shard; the index is incomplete (rebuild or copy "
                             "the shard)")
    try:
        return json.loads((sd / "shard.json").read_text())
    except json.JSONDecodeError as err:
        raise IndexLoadError(f"{sd / 'shard.json'}: corrupt ({err})") from err


def _shard_key(manifest: dict) -> dict:
    """Every setting that changes a FAISS shard's bytes: a shard whose ``shard.json`` differs
    in any of them belongs to another build. (``nprobe`` is a search setting, applied from the
    manifest at load, so it is not part of the key.)"""
    enc = manifest.get("encoder", {})
    return {"corpus_checksum": manifest["corpus_checksum"], "factory": manifest["factory"],
            "encoder_fingerprint": enc.get("fingerprint"), "similarity": enc.get("similarity"),
            "pooling": enc.get("pooling"), "max_length": enc.get("max_length"),
            "dim": manifest["dim"], "embeddings": manifest.get("embeddings_key"),
            "train_size": manifest.get("train_size"),
            "rerank_vectors": bool(manifest.get("rerank_vectors")),
            "rerank_dtype": manifest.get("rerank_dtype", "float16")}


def _check_shard(sd: pathlib.Path, info: dict, spec: dict, manifest: dict) -> None:
    want = {**_shard_key(manifest), "lo": spec["lo"], "hi": spec["hi"]}
    for key, value in want.items():
        if info.get(key) != value:
            raise IndexLoadError(f"{sd}: a shard of another index ({key} is {info.get(key)!r}, "
                                 f"this index needs {value!r}); rebuild it")


def _embeddings_key(path: str | pathlib.Path) -> dict:
    """What identifies a user's embeddings file without reading it: its resolved path, size,
    modification time and a hash of its header and first and last MiB."""
    path = pathlib.Path(path).resolve()
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "sample_sha256": _sample_sha256(path, _sample_offsets(st.st_size, 2))}


def _exact_scores(q_BD: np.ndarray, vectors: "NpyRows", rows_BF: np.ndarray) -> np.ndarray:
    """Inner products of each query with its candidate rows, read from ``vectors``."""
    flat = np.unique(rows_BF[rows_BF >= 0])
    if not len(flat):
        return np.full(rows_BF.shape, -np.inf, np.float32)
    cand_CD = vectors.take(flat).astype(np.float32)
    pos_BF = np.searchsorted(flat, np.maximum(rows_BF, 0))
    return np.einsum("bd,bfd->bf", q_BD, cand_CD[pos_BF])


def _write_vectors(path: pathlib.Path, source: "EmbeddingSource", lo: int, hi: int,
                   dtype: str = "float16", batch: int = 65536) -> None:
    """Rows ``lo..hi-1`` of ``source`` as a float16 (or float32) ``.npy`` for re-ranking."""
    with atomic_path(path, suffix=".npy") as tmp, open(tmp, "wb") as f:
        # streamed with write(), not a memory map: written pages never count as ours
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(
            np.dtype(dtype)), "fortran_order": False, "shape": (hi - lo, source.dim)})
        for a in range(lo, hi, batch):
            f.write(source.rows(a, min(hi, a + batch)).astype(dtype).tobytes())


def _write_shard(sd: pathlib.Path, faiss_index, lo: int, hi: int, manifest: dict,
                 source: "EmbeddingSource | None" = None) -> None:
    """Write one FAISS shard atomically (temporary folder, then rename), with its float16
    vectors when the index re-ranks."""
    import faiss

    tmp = sd.with_name(sd.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    faiss.write_index(faiss_index, str(tmp / "index.faiss"))
    if manifest.get("rerank_vectors") and source is not None:
        _write_vectors(tmp / "vectors.npy", source, lo, hi,
                       manifest.get("rerank_dtype", "float16"))
    write_json_atomic({**_shard_key(manifest), "lo": lo, "hi": hi,
                       "ntotal": int(faiss_index.ntotal)}, tmp / "shard.json")
    replace_dir(tmp, sd)


def _finish(d: pathlib.Path, manifest: dict) -> None:
    """Write the manifest with the table of every file's size, mtime and SHA-256."""
    per_shard = ("index.faiss", "shard.json") + (("vectors.npy",) if manifest.get(
        "rerank_vectors") else ())
    names = ["passages.arrow", "passages.json"] + [
        f"{s['dir']}/{f}" for s in manifest["shards"] for f in per_shard]
    files = {}
    for name in names:
        st = (d / name).stat()
        files[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "sha256": _sha256(d / name)}
        if st.st_size > SMALL_FILE_BYTES:  # sampled at every load, hashed whole by verify
            offsets = _sample_offsets(st.st_size)
            files[name].update(sample_offsets=offsets,
                               sample_sha256=_sample_sha256(d / name, offsets))
    write_json_atomic({**manifest, "files": files}, d / "manifest.json")


# -- building an index directory, resumably, on one or many processes ------------------------

def barrier(name: str) -> None:
    """Wait for every process (a no-op for one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def embed_store(store: PassageStore, retriever, emb_dir: pathlib.Path, *,
                shard_rows: int = 65536, params=None, progress: bool = True,
                process_index: int = 0, process_count: int = 1,
                on_shard: Callable[[int], None] | None = None) -> list[pathlib.Path]:
    """Embed the store into ``emb_dir/emb-XXXXX.npy``, ``shard_rows`` passages per file.

    Process ``p`` of ``P`` embeds the shards ``p, p+P, ...``; a finished shard is a complete
    file (written to a temporary name, then renamed), so a rerun skips it: an interrupted build
    resumes at shard granularity. ``emb.json`` records the encoder and corpus; a folder made
    with others is cleared first. Returns every shard's path (all processes' shards).
    """
    from replug_jax.retrieval.encoder import encoding_bar

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


def build_index(passages: Sequence[Passage] | PassageStore | str | pathlib.Path,
                retriever, out_dir: str | pathlib.Path, *, factory: str = "Flat",
                nprobe: int = 16, embeddings: str | pathlib.Path | None = None,
                num_shards: int = 1, embed_shard_rows: int = 65536,
                train_size: int | None = None, rerank: int = 0, progress: bool = True,
                extra: dict | None = None, on_shard: Callable[[int], None] | None = None,
                gpu: str = "auto", target_recall: float | None = None,
                recall_queries: np.ndarray | None = None, recall_k: int | None = None,
                recall_sample: int = 256) -> Index:
    """Build an index directory at ``out_dir``, resumably, on one or many processes.

    ``passages`` is a list, a :class:`PassageStore`, or the path of a store already written
    (``passages.arrow``). Work happens in ``<out_dir>.partial/``: the store, the embedding
    shards (:func:`embed_store`; skipped when ``embeddings`` names an ``[N, D]`` ``.npy`` the
    user already has), then ``num_shards`` FAISS shards over contiguous row ranges, shard ``s``
    built by process ``s mod P``. Process 0 then writes the manifest and renames the folder;
    only a finished build appears at ``out_dir``. Multi-host builds need ``out_dir`` on a
    shared filesystem and :func:`jax.distributed.initialize` first.

    ``rerank=F`` keeps every shard's vectors on disk in float16 (N·D·2 bytes; float32 when
    tuning to a ``target_recall``, N·D·4 bytes; read only for
    candidates) and re-ranks the ``F·k`` candidates of an approximate index (IVF-PQ) by their
    exact inner products: the recall of exact search for a few more bytes read per query.

    An approximate index's recall@10 (and @``recall_k``) against exact search is measured at
    the end (:func:`replug_jax.retrieval.quality.recall_report`: ``recall_queries`` or a
    seeded sample of ``recall_sample`` corpus vectors) and stored in the manifest. With
    ``target_recall``, nprobe × re-rank factor is tuned to the fastest setting reaching it
    (vectors are kept for re-ranking when the codes are lossy) and recorded as the default.
    """
    if retriever is None and embeddings is None:
        raise ValueError("need a retriever to embed the passages, or --embeddings")
    t_start = time.perf_counter()
    out = pathlib.Path(out_dir)
    work = out.with_name(out.name + ".partial")
    work.mkdir(parents=True, exist_ok=True)
    pid, pcount = jax.process_index(), jax.process_count()
    if isinstance(passages, (str, pathlib.Path)):
        store = PassageStore.open(passages)
    elif isinstance(passages, PassageStore):
        store = passages
    else:
        if not passages:
            raise ValueError("cannot build an index from an empty corpus")
        store = PassageStore.from_passages(passages)
    store_path = work / STORE
    if pathlib.Path(store.name) != store_path:
        if pid == 0:  # write the store, unless an interrupted build already did
            try:
                same = PassageStore.open(store_path).checksum == store.checksum
            except ValueError:
                same = False
            if not same:
                store.write(store_path)
        barrier("replug_store")
        store = PassageStore.open(store_path)
    before = getattr(retriever, "truncated", 0)
    if embeddings is not None:
        dim = retriever.dim if retriever is not None else None
        source = EmbeddingSource([NpyRows(embeddings, n=len(store), dim=dim)])
    else:
        source = EmbeddingSource.from_files(embed_store(
            store, retriever, work / "embeddings", shard_rows=embed_shard_rows,
            progress=progress, process_index=pid, process_count=pcount))
    encoder = retriever.identity if retriever is not None else {}
    last = factory.split(",")[-1]
    keep_vectors = target_recall is not None and not last.startswith(("Flat", "HNSW"))
    bounds = np.linspace(0, len(store), num_shards + 1).astype(int)
    manifest = {"version": INDEX_VERSION, "factory": factory, "metric": "inner_product",
                "dim": source.dim, "n": len(store), "nprobe": nprobe, "encoder": encoder,
                "corpus_checksum": store.checksum,
                "shards": [{"dir": f"shard-{s:05d}", "lo": int(bounds[s]),
                            "hi": int(bounds[s + 1])} for s in range(num_shards)],
                "truncated_passages": getattr(retriever, "truncated", 0) - before,
                "train_size": train_size,
                "rerank_vectors": bool(rerank) or keep_vectors, "rerank_factor": int(rerank),
                # tuning to a recall target re-ranks in float32: float16 scores (3 digits)
                # cannot order near-equidistant neighbours (measured: recall@10 stops at 0.90
                # on tight clusters however many candidates are re-ranked)
                "rerank_dtype": "float32" if keep_vectors else "float16",
                **({"embeddings": str(embeddings),
                    "embeddings_key": _embeddings_key(embeddings)}
                   if embeddings is not None else {}),
                **(extra or {})}
    for s in range(pid, num_shards, pcount):
        spec = manifest["shards"][s]
        sd = work / spec["dir"]
        if (sd / "shard.json").exists():
            try:
                _check_shard(sd, _read_shard_info(sd), spec, manifest)
                continue  # finished by an earlier run with the same settings
            except IndexLoadError as err:
                if progress:
                    print(f"rebuilding {spec['dir']}: {str(err).split(': ', 1)[-1]}")
        ix = build_faiss(source, spec["lo"], spec["hi"], factory, nprobe=nprobe,
                         train_size=train_size, seed=s, progress=progress)
        _write_shard(sd, ix, spec["lo"], spec["hi"], manifest, source)
        del ix  # one shard in memory at a time
        if on_shard is not None:
            on_shard(s)
    barrier("replug_shards")
    if pid == 0:
        if factory != "Flat":  # an approximate index: how exact is it, on this data?
            from replug_jax.retrieval.quality import recall_report

            index = Index._open(work, manifest, gpu="cpu")
            manifest["recall"] = recall_report(index, source, k=10, user_k=recall_k,
                                               queries_QD=recall_queries,
                                               sample=recall_sample, target=target_recall)
            manifest["nprobe"] = index.manifest["nprobe"]
            manifest["rerank_factor"] = index.manifest.get("rerank_factor", 0)
            del index
        shutil.rmtree(work / "embeddings", ignore_errors=True)
        manifest["build_seconds"] = round(time.perf_counter() - t_start, 2)  # this process's
        _finish(work, manifest)
        replace_dir(work, out)
    barrier("replug_index_done")
    return Index.load(out, gpu=gpu)


def index_in_memory(passages: Sequence[Passage], retriever, *, factory: str = "Flat",
                    nprobe: int = 16, extra: dict | None = None) -> Index:
    """An in-memory index of ``passages`` embedded exactly as :func:`build_index` embeds them
    (:func:`corpus_text`: the title prepended), for experiments and small corpora."""
    if not passages:
        raise ValueError("cannot build an index from an empty corpus")
    emb = retriever.encode_passages([corpus_text(p) for p in passages])
    return Index.build(emb, passages, factory=factory, nprobe=nprobe,
                       encoder=retriever.identity, extra=extra)


def corpus_text(passage: Passage) -> str:
    """The text the retriever embeds for a passage (title prepended, as in DPR/Contriever)."""
    if passage.title and not passage.text.startswith(passage.title):
        return f"{passage.title}. {passage.text}"
    return passage.text
