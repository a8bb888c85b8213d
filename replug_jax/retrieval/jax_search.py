"""Exact top-k in JAX over a device-sharded embedding matrix: training-time retrieval on the
mesh (:class:`DeviceIndex`) and the oracle FAISS is tested against (:func:`exact_topk`)."""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from replug_jax.retrieval.corpus import Passage
from replug_jax.retrieval.search import (
    SearchResult,
    assemble,
    checked_queries,
    checked_vectors,
    per_query_exclusions,
)
from replug_jax.retrieval.store import PassageStore
from replug_jax.sharding import host_copy, platform, replicate


# the memory one block of the exact search may hold (its float32 scores and its copy of the
# rows): 512 MiB on a CPU, 4 GiB on an accelerator (not yet measured there)
CPU_BLOCK_BYTES = 1 << 29
ACCELERATOR_BLOCK_BYTES = 1 << 32
BIN_ROWS = 128  # rows per bin of the two-stage top-k


def storage_dtype(backend: str | None = None) -> str:
    """The corpus dtype the exact search is fastest with on ``backend`` (default: JAX's):
    float32 on CPU, where XLA's bfloat16 matmul converts and runs at about half the float32
    speed (``benches/results/sharded_topk.md``); bfloat16 on accelerators, which read half the
    bytes and multiply bfloat16 natively."""
    return "float32" if (backend or platform()) == "cpu" else "bfloat16"


def block_rows(num_queries: int, n: int, row_bytes: int = 0,
               scores_bytes: int | None = None) -> int:
    """Corpus rows per block of the exact search: all ``n`` when their ``[n, B]`` float32
    scores fit in ``scores_bytes`` (default by JAX's backend: :data:`CPU_BLOCK_BYTES` or
    :data:`ACCELERATOR_BLOCK_BYTES`), one matmul over the corpus as it lies, nothing copied;
    else as many as fit with their scores and the window's copy of the rows (``row_bytes``
    each; XLA copies a window out of the corpus), a whole number of bins."""
    if scores_bytes is None:
        scores_bytes = (CPU_BLOCK_BYTES if platform() == "cpu"
                        else ACCELERATOR_BLOCK_BYTES)
    if 4 * num_queries * n <= scores_bytes:
        return n
    rows = scores_bytes // (4 * max(num_queries, 1) + row_bytes) // BIN_ROWS * BIN_ROWS
    return max(BIN_ROWS, min(rows, n))


def two_stage_topk(s_NB, k: int, bin_rows: int = BIN_ROWS):
    """Exact top-``k`` of each column of ``s_NB`` (scores of N corpus rows for B queries, the
    layout the corpus-major matmul ``c_ND @ q_BD.T`` writes, measured faster on CPU than
    ``q @ c.T``) in two stages: the maxima of bins of ``bin_rows`` rows (the last bin may be
    shorter), the top-``k`` bins by their maximum, then the top-``k`` of those bins' rows,
    gathered from ``s_NB`` itself (nothing is padded or copied). Exact: a member of the true
    top-k has a score ≥ the k-th score, so its bin's maximum is ≥ it, and fewer than k bins
    hold a larger maximum (each holds a distinct larger member). Cheaper than one
    ``lax.top_k`` over N, which sorts whole rows on GPU when k > 16. Returns
    ``(values [B, k], rows [B, k])``."""
    n, b = s_NB.shape
    if -(-n // bin_rows) <= k:  # the candidates would be every row
        return jax.lax.top_k(s_NB.T, k)
    full = n // bin_rows * bin_rows
    max_GB = s_NB[:full].reshape(-1, bin_rows, b).max(axis=1)
    if full < n:
        max_GB = jnp.concatenate([max_GB, s_NB[full:].max(axis=0, keepdims=True)])
    _, bins_Bk = jax.lax.top_k(max_GB.T, k)
    # In bin order, the short last bin's rows past N come last, and top_k breaks ties by
    # position: a real row scoring -inf (an overflowed product) still beats them.
    bins_Bk = jnp.sort(bins_Bk, axis=1)
    rows_BkR = bins_Bk[:, :, None] * bin_rows + jnp.arange(bin_rows)
    cand_BkR = s_NB.at[rows_BkR, jnp.arange(b)[:, None, None]].get(
        mode="fill", fill_value=-jnp.inf)  # rows past N (a short last bin) never win
    vals, pos = jax.lax.top_k(cand_BkR.reshape(b, -1), k)
    return vals, jnp.take_along_axis(rows_BkR.reshape(b, -1), pos, axis=1)


def _blocked_topk(q_BD, c_ND, k: int, block: int | None, n_valid, offset,
                  bin_rows: int = BIN_ROWS):
    """Top-k of ``q_BD @ c_ND.T`` scanning ``c_ND`` in blocks of ``block`` rows (default
    :func:`block_rows`: memory ``O(B·block)``), each block's top-k by
    :func:`two_stage_topk`; rows at or past ``n_valid`` (the corpus's padding rows; traced in
    the sharded search) are ignored and ``offset`` is added to the returned row numbers.

    A corpus whose scores fit the budget is multiplied whole; a larger one is scanned in windows
    of ``block`` rows (a loop: one window's copy and scores live at a time) and one last window
    of the rest. Nothing is padded."""
    n = c_ND.shape[0]
    block = min(block or block_rows(q_BD.shape[0], n, c_ND.shape[1] * c_ND.dtype.itemsize), n)
    n_full, rest = divmod(n, block)
    q_BD = q_BD.astype(c_ND.dtype)
    static_limit = isinstance(n_valid, int) and n_valid >= n

    def window(start, size: int):
        rows_RD = c_ND if size == n else jax.lax.dynamic_slice_in_dim(c_ND, start, size)
        s_RB = jnp.dot(rows_RD, q_BD.T, preferred_element_type=jnp.float32)
        if not static_limit:
            rows = start + jnp.arange(size)[:, None]
            s_RB = jnp.where(rows < jnp.minimum(n_valid, n), s_RB, -jnp.inf)
        vals, idx = two_stage_topk(s_RB, min(k, size), bin_rows)
        return vals, idx + start + offset

    if n_full == 1 and not rest:
        return window(0, n)  # sorted top-k already
    parts = []
    if n_full == 1:
        parts.append(window(0, block))
    else:  # [n_full, B, kb] -> [B, n_full·kb]
        vals, idx = jax.lax.map(lambda i: window(i * block, block), jnp.arange(n_full))
        parts.append((jnp.moveaxis(vals, 0, 1).reshape(q_BD.shape[0], -1),
                      jnp.moveaxis(idx, 0, 1).reshape(q_BD.shape[0], -1)))
    if rest:
        parts.append(window(n_full * block, rest))
    return _merge(jnp.concatenate([v for v, _ in parts], axis=1),
                  jnp.concatenate([i for _, i in parts], axis=1), k)


def _merge(vals_BC, idx_BC, k: int):
    """The top-k of candidate scores and their row numbers."""
    top, pos = jax.lax.top_k(vals_BC, min(k, vals_BC.shape[1]))
    return top, jnp.take_along_axis(idx_BC, pos, axis=1)


def exact_topk(queries_BD, corpus_ND, k: int, block: int | None = None,
               bin_rows: int = BIN_ROWS):
    """Exact maximum-inner-product top-k in JAX on one device: the oracle FAISS is tested
    against. Returns ``(scores [B, k], rows [B, k])``."""
    q = jnp.asarray(queries_BD, jnp.float32)
    c = jnp.asarray(corpus_ND)
    return _exact_topk_fn(min(k, c.shape[0]), block, bin_rows)(q, c)


@functools.lru_cache(maxsize=64)
def _exact_topk_fn(k: int, block: int | None, bin_rows: int):
    return jax.jit(lambda q, c: _blocked_topk(q, c, k, block, c.shape[0], 0, bin_rows))


def corpus_rows(n: int, mesh: jax.sharding.Mesh, axis: str = "data") -> slice:
    """The rows of an ``n``-row corpus that this process holds when it is sharded along N on
    ``mesh`` (all of them for one process): the process's devices hold a contiguous block of
    the corpus padded to a multiple of the device count."""
    per_process = -(-n // mesh.shape[axis]) * mesh.shape[axis] // jax.process_count()
    lo = jax.process_index() * per_process
    return slice(min(lo, n), min(lo + per_process, n))


def shard_corpus(corpus_ND, mesh: jax.sharding.Mesh, *, axis: str = "data",
                 dtype=None, n: int | None = None):
    """Place a corpus on ``mesh`` split along N (padded to a multiple of the device count with
    rows that never win), in ``dtype`` (default :func:`storage_dtype` of the mesh's
    platform). ``corpus_ND`` is the whole corpus (each process takes
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
    dtype = dtype or storage_dtype(mesh.devices.flat[0].platform)
    array = jax.make_array_from_process_local_data(sharding, np.asarray(local, dtype),
                                                   (n_pad, local.shape[1]))
    return array, n


def sharded_topk(queries_BD, corpus_ND: jax.Array, k: int, n_valid: int,
                 mesh: jax.sharding.Mesh, *, axis: str = "data", block: int | None = None,
                 bin_rows: int = BIN_ROWS):
    """Exact top-k over a corpus sharded along N on ``mesh`` (from :func:`shard_corpus`).

    Each device takes the top-k of its own rows (:func:`two_stage_topk` over blocks of
    ``block`` rows, default :func:`block_rows`; bins of ``bin_rows``), the per-device
    candidates are gathered (``all_gather``, k·d per query) and merged: the same top-k as one
    device over the whole corpus (what Atlas does with PyTorch, here one jitted function).
    Returns ``(scores [B, k] f32, rows [B, k] int32)``, replicated.
    """
    fn = _sharded_topk_fn(mesh, axis, min(k, n_valid), n_valid,
                          corpus_ND.shape[0] // mesh.shape[axis], block, bin_rows)
    return fn(replicate(np.asarray(queries_BD, np.float32), mesh), corpus_ND)


@functools.lru_cache(maxsize=64)
def _sharded_topk_fn(mesh, axis: str, k: int, n_valid: int, rows_per_device: int,
                     block: int | None, bin_rows: int):
    """The jitted shard_map of :func:`sharded_topk` (cached: one compilation per shape)."""
    P = jax.sharding.PartitionSpec

    def local(q, c):
        offset = jax.lax.axis_index(axis) * rows_per_device
        vals, idx = _blocked_topk(q, c, min(k, rows_per_device), block, n_valid - offset,
                                  offset, bin_rows)
        vals = jax.lax.all_gather(vals, axis, axis=1, tiled=True)
        idx = jax.lax.all_gather(idx, axis, axis=1, tiled=True)
        return _merge(vals, idx, k)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P(), P(axis)),
                                 out_specs=(P(), P()), check_vma=False))


class DeviceIndex:
    """Training-time retrieval in JAX: the corpus embeddings as one array sharded along N over
    a mesh (in :func:`storage_dtype` by default: float32 on CPU, bfloat16 on accelerators;
    recorded as the manifest's ``factory``), searched exactly with :func:`sharded_topk`. The same
    ``search`` contract as :class:`Index`, and no FAISS rebuild: a refresh re-embeds and
    swaps the array in. Scores are exact inner products of the stored (possibly bfloat16)
    vectors, accumulated in float32."""

    def __init__(self, embeddings_ND, passages: Sequence[Passage] | PassageStore,
                 mesh: jax.sharding.Mesh, *, dtype=None, axis: str = "data",
                 encoder: dict | None = None, local: bool = False):
        emb = checked_vectors(np.asarray(embeddings_ND))
        self.store = passages if isinstance(passages, PassageStore) else \
            PassageStore.from_passages(passages)
        if emb.ndim != 2 or (not local and emb.shape[0] != len(self.store)):
            raise ValueError(f"{emb.shape} embeddings for {len(self.store)} passages")
        self.mesh, self.axis = mesh, axis
        self.array, self.n = shard_corpus(emb, mesh, axis=axis, dtype=dtype,
                                          n=len(self.store) if local else None)
        self.manifest = {"factory": f"jax-exact-{jnp.dtype(self.array.dtype).name}",
                         "dim": emb.shape[1],
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
        q = checked_queries(queries_BD, self.manifest["dim"], k)
        excl = per_query_exclusions(exclude_ids, q.shape[0])
        fetch = min(self.n, k + max((len(e) for e in excl), default=0))
        scores, rows = host_copy(sharded_topk(q, self.array, fetch, self.n, self.mesh,
                                              axis=self.axis))
        rows = np.where(rows < self.n, rows, -1)  # never a padding row, even in a tie
        return assemble(self.store, scores.astype(np.float32), rows.astype(np.int64), excl, k)

    def reconstruct_all(self) -> np.ndarray:
        """The stored vectors (this process's single-process view: tests and small runs)."""
        return np.asarray(self.array, np.float32)[:self.n]
