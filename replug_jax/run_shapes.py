"""The sizes of a paper-scale run that ``replug compile-check`` compiles for (no JAX here:
the command line reads the defaults before anything heavy loads)."""

from __future__ import annotations

import dataclasses

# what each size is, for --help
HELP = {
    "lm_batch": "LM sequences per program: queries x k documents",
    "context": "tokens per LM sequence (prefill: context - new-tokens of prompt)",
    "new_tokens": "tokens decoded after the prefill",
    "prefix_len": "KV reuse: tokens of a document prefix",
    "suffix_len": "KV reuse: tokens after the prefix (query and continuation)",
    "lsr_batch": "LSR: queries per step",
    "lsr_docs": "LSR: documents per query (the paper's k = 20)",
    "query_len": "LSR: query tokens",
    "doc_len": "LSR and refresh: passage tokens",
    "corpus": "passages in the datastore, split along N over the devices",
    "topk_queries": "queries per exact top-k search",
    "k": "documents the top-k returns",
    "encode_batch": "passages per refresh encode step (rounded up to the devices)",
}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The sizes of a run: the LM's batch of sequences, its context, the tokens decoded, the
    KV-reuse prefix (document) and suffix (query and continuation) lengths; the LSR batch,
    documents per query and lengths; the corpus rows and the exact top-k's queries and k."""

    lm_batch: int = 32
    context: int = 2048
    new_tokens: int = 128
    prefix_len: int = 128
    suffix_len: int = 256
    lsr_batch: int = 64
    lsr_docs: int = 20
    query_len: int = 128
    doc_len: int = 128
    corpus: int = 21_000_000
    topk_queries: int = 64
    k: int = 20
    encode_batch: int = 512
