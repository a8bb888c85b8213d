"""Retrieval (paper §3.1): corpora and chunking, batched encoding, FAISS indexes, exact top-k
in JAX. The package face, each name imported from its module on first use:

* :mod:`~replug_jax.retrieval.search` — the search contract (:class:`SearchResult`, exclusions);
* :mod:`~replug_jax.retrieval.faiss_index` — FAISS shards over the passage store
  (:class:`Index`: build in memory, save, load, search with nprobe / re-ranking);
* :mod:`~replug_jax.retrieval.build` — resumable, multi-process index directories
  (:func:`build_index`, :func:`index_in_memory`);
* :mod:`~replug_jax.retrieval.embeddings` — embeddings on disk and their resumable computation;
* :mod:`~replug_jax.retrieval.integrity` — file tables, checksums, sampled hashes;
* :mod:`~replug_jax.retrieval.jax_search` — exact top-k in JAX, sharded over a mesh
  (:class:`DeviceIndex`, training-time retrieval);
* :mod:`~replug_jax.retrieval.encoder` — the dense retriever (:class:`Retriever`);
* :mod:`~replug_jax.retrieval.quality` — recall against exact search, tuning to a target.
"""

from replug_jax.imports import exports

__getattr__, __dir__, __all__ = exports(__name__, {
    "build_index": "build", "index_in_memory": "build", "corpus_text": "corpus",
    "EmbeddingSource": "embeddings", "NpyRows": "embeddings", "embed_store": "embeddings",
    "INDEX_VERSION": "faiss_index", "STORE": "faiss_index", "Index": "faiss_index",
    "build_faiss": "faiss_index", "IndexLoadError": "integrity", "DeviceIndex": "jax_search",
    "corpus_rows": "jax_search", "exact_topk": "jax_search", "shard_corpus": "jax_search",
    "sharded_topk": "jax_search", "storage_dtype": "jax_search", "two_stage_topk": "jax_search",
    "SearchResult": "search", "per_query_exclusions": "search", "Retriever": "encoder",
    "Passage": "corpus",
})
