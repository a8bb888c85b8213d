"""The retrieval index API in one place (each job lives in its own module):

* :mod:`~replug_jax.retrieval.search` — the search contract (:class:`SearchResult`, exclusions);
* :mod:`~replug_jax.retrieval.faiss_index` — FAISS shards over the passage store
  (:class:`Index`: build in memory, save, load, search with nprobe / re-ranking);
* :mod:`~replug_jax.retrieval.build` — resumable, multi-process index directories
  (:func:`build_index`, :func:`index_in_memory`);
* :mod:`~replug_jax.retrieval.embeddings` — embeddings on disk and their resumable computation;
* :mod:`~replug_jax.retrieval.integrity` — file tables, checksums, sampled hashes;
* :mod:`~replug_jax.retrieval.jax_search` — exact top-k in JAX, sharded over a mesh
  (:class:`DeviceIndex`, training-time retrieval);
* :mod:`~replug_jax.retrieval.quality` — recall against exact search, tuning to a target.

Importing the names from here keeps working.
"""

from replug_jax.retrieval.build import build_index, index_in_memory
from replug_jax.retrieval.corpus import corpus_text
from replug_jax.retrieval.embeddings import EmbeddingSource, NpyRows, embed_store
from replug_jax.retrieval.faiss_index import INDEX_VERSION, STORE, Index, build_faiss
from replug_jax.retrieval.integrity import IndexLoadError
from replug_jax.retrieval.jax_search import (
    DeviceIndex,
    corpus_rows,
    exact_topk,
    shard_corpus,
    sharded_topk,
    storage_dtype,
    two_stage_topk,
)
from replug_jax.retrieval.search import SearchResult, per_query_exclusions

__all__ = ["build_index", "index_in_memory", "corpus_text", "EmbeddingSource", "NpyRows",
           "embed_store", "INDEX_VERSION", "STORE", "Index", "build_faiss", "IndexLoadError",
           "DeviceIndex", "corpus_rows", "exact_topk", "shard_corpus", "sharded_topk",
           "storage_dtype", "two_stage_topk", "SearchResult", "per_query_exclusions"]
