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
    per_query_exclusions,
)
from replug_jax.retrieval.store import PassageStore
from replug_jax.sharding import host_copy, replicate


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
        q = checked_queries(queries_BD, self.manifest["dim"], k)
        excl = per_query_exclusions(exclude_ids, q.shape[0])
        fetch = min(self.n, k + max((len(e) for e in excl), default=0))
        scores, rows = host_copy(sharded_topk(q, self.array, fetch, self.n, self.mesh,
                                              axis=self.axis))
        return assemble(self.store, scores.astype(np.float32), rows.astype(np.int64), excl, k)

    def reconstruct_all(self) -> np.ndarray:
        """The stored vectors (this process's single-process view: tests and small runs)."""
        return np.asarray(self.array, np.float32)[:self.n]
