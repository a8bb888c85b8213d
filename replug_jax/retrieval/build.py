"""Building an index directory, resumably, on one or many processes (:func:`build_index`),
and small in-memory indexes for experiments (:func:`index_in_memory`)."""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import time
from typing import Callable, Sequence

import jax
import numpy as np

from replug_jax.fileio import replace_dir
from replug_jax.retrieval.corpus import Passage, corpus_text
from replug_jax.retrieval.embeddings import (
    EMBED_SHARD_ROWS,
    EmbeddingSource,
    NpyRows,
    embed_store,
    embeddings_key,
)
from replug_jax.retrieval.faiss_index import (
    INDEX_VERSION,
    STORE,
    Index,
    build_faiss,
    check_factory,
)
from replug_jax.retrieval.integrity import IndexLoadError
from replug_jax.retrieval.shards import check_shard, finish_index, read_shard_info, write_shard
from replug_jax.retrieval.quality import recall_report, sample_digest
from replug_jax.retrieval.store import PassageStore
from replug_jax.sharding import barrier


def tokenizer_digest(tokenizer) -> str | None:
    """SHA-256 of a tokenizer's vocabulary (what token chunking depends on)."""
    if tokenizer is None:
        return None
    import hashlib
    import json

    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def corpus_store(corpus: str | pathlib.Path, out_dir: str | pathlib.Path, *,
                 chunk_unit: str = "words", chunk_size: int = 100, overlap: int = 0,
                 tokenizer=None, progress: bool = True):
    """The passages of a corpus for :func:`build_index`: ``"demo"`` (the packaged corpus, in
    memory), a passage store already made (``.arrow``: its path), or a corpus file chunked into
    a store in ``<out_dir>.partial/`` (streamed one document at a time; reused when an
    interrupted build already wrote it from the same file and options). With many processes,
    process 0 chunks and the others wait for it."""
    import json

    from replug_jax.fileio import write_json_atomic
    from replug_jax.retrieval.corpus import demo_corpus, iter_chunks, iter_documents
    from replug_jax.retrieval.store import write_store

    if str(corpus) == "demo":
        return demo_corpus(size=chunk_size, overlap=overlap)
    corpus = pathlib.Path(corpus)
    if corpus.suffix == ".arrow":
        return corpus
    out_dir = pathlib.Path(out_dir)
    work = out_dir.with_name(out_dir.name + ".partial")
    work.mkdir(parents=True, exist_ok=True)
    st = corpus.stat()
    spec = {"corpus": str(corpus.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "chunk_unit": chunk_unit, "chunk_size": chunk_size, "overlap": overlap,
            # token chunks depend on the tokenizer: another retriever's build re-chunks
            "tokenizer": tokenizer_digest(tokenizer) if chunk_unit == "tokens" else None}
    spec_path, store_path = work / "corpus_spec.json", work / STORE

    def reusable() -> bool:
        if not spec_path.exists() or json.loads(spec_path.read_text()) != spec:
            return False
        try:
            PassageStore.open(store_path)
            return True
        except ValueError:
            return False

    if jax.process_index() == 0 and not reusable():
        write_store(iter_chunks(iter_documents(corpus), size=chunk_size, overlap=overlap,
                                unit=chunk_unit, tokenizer=tokenizer),
                    store_path, progress=progress)
        write_json_atomic(spec, spec_path)
    barrier("replug_passages")
    return store_path


def build_index(passages: Sequence[Passage] | PassageStore | str | pathlib.Path,
                retriever, out_dir: str | pathlib.Path, *, factory: str = "Flat",
                nprobe: int = 16, embeddings: str | pathlib.Path | None = None,
                num_shards: int = 1, embed_shard_rows: int = EMBED_SHARD_ROWS,
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
        check_factory(factory, source.dim, len(store) // num_shards)
    else:
        check_factory(factory, retriever.dim, len(store) // num_shards)  # before embedding
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
                "embeddings_digest": sample_digest(source),
                **({"embeddings": str(embeddings),
                    "embeddings_key": embeddings_key(embeddings)}
                   if embeddings is not None else {}),
                **(extra or {})}
    for s in range(pid, num_shards, pcount):
        spec = manifest["shards"][s]
        sd = work / spec["dir"]
        if (sd / "shard.json").exists():
            try:
                check_shard(sd, read_shard_info(sd), spec, manifest)
                continue  # finished by an earlier run with the same settings
            except IndexLoadError as err:
                if progress:
                    print(f"rebuilding {spec['dir']}: {str(err).split(': ', 1)[-1]}")
        ix = build_faiss(source, spec["lo"], spec["hi"], factory, nprobe=nprobe,
                         train_size=train_size, seed=s, progress=progress)
        write_shard(sd, ix, spec["lo"], spec["hi"], manifest, source)
        del ix  # one shard in memory at a time
        if on_shard is not None:
            on_shard(s)
    barrier("replug_shards")
    if pid == 0:
        if factory != "Flat":  # an approximate index: how exact is it, on this data?
            index = Index._open(work, manifest, gpu="cpu")
            manifest["recall"] = recall_report(index, source, k=10, user_k=recall_k,
                                               queries_QD=recall_queries,
                                               sample=recall_sample, target=target_recall)
            manifest["nprobe"] = index.manifest["nprobe"]
            manifest["rerank_factor"] = index.manifest.get("rerank_factor", 0)
            del index
        shutil.rmtree(work / "embeddings", ignore_errors=True)
        manifest["build_seconds"] = round(time.perf_counter() - t_start, 2)  # this process's
        finish_index(work, manifest)
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


def merge_indexes(dirs: Sequence[str | pathlib.Path], out_dir: str | pathlib.Path,
                  offsets: Sequence[int] | None = None) -> Index:
    """One exact index of the passages of several exact indexes built by one encoder (a
    task's own paragraphs and a distractor corpus, say), searched as one by every command.
    No passage is encoded again: each part's vectors are read back (exact for ``Flat``
    shards). Passage ``id`` of the i-th part becomes ``id + offsets[i]`` (default 0 for
    all); refused in one line when two passages then share an id, when the parts' encoders
    differ, or when a part is approximate."""
    if len(dirs) < 2:
        raise ValueError("merge needs two or more index folders")
    offsets = [0] * len(dirs) if offsets is None else [int(o) for o in offsets]
    if len(offsets) != len(dirs):
        raise ValueError(f"{len(offsets)} offsets for {len(dirs)} indexes")
    parts = [Index.load(d) for d in dirs]
    encoder = parts[0].manifest.get("encoder")
    for d, ix in zip(dirs, parts):
        if ix.manifest.get("encoder") != encoder:
            raise ValueError(f"{d}: built by another encoder than {dirs[0]} (its vectors "
                             "would not be comparable)")
        if ix.manifest.get("factory") != "Flat":
            raise ValueError(f"{d}: a {ix.manifest.get('factory')} index approximates its "
                             "vectors; only exact (Flat) indexes merge without re-encoding")
    passages = [dataclasses.replace(p, id=p.id + off) if off else p
                for ix, off in zip(parts, offsets) for p in ix.passages]
    ids = np.array([p.id for p in passages], np.int64)
    if len(np.unique(ids)) != len(ids):
        raise ValueError("two passages of the parts share an id: give each part an offset "
                         "(--offsets 0 1000000 …) larger than the ids before it")
    merged = Index.build([ix.reconstruct_all() for ix in parts], passages, encoder=encoder,
                         extra={"merged_from": [{"index": str(d), "offset": off,
                                                 "corpus_checksum": ix.manifest.get(
                                                     "corpus_checksum")}
                                                for d, ix, off in zip(dirs, parts, offsets)]})
    merged.save(out_dir)
    return Index.load(out_dir)
