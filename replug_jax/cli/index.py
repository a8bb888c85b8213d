"""``replug index build | search | info | tune | verify``."""

from __future__ import annotations

import pathlib
import shutil
import warnings

from replug_jax.cli.common import (
    command,
    emit,
    existing_file,
    index_dir,
    non_negative_int,
    positive_int,
    unit_interval,
)
from replug_jax.models import DEFAULT_RETRIEVER
from replug_jax.retrieval.embeddings import EMBED_SHARD_ROWS


def _recall_queries(args, retriever):
    from replug_jax.retrieval.quality import read_queries

    return None if args.recall_queries is None else read_queries(args.recall_queries, retriever)


def cmd_build(args) -> int:
    import time

    from replug_jax.retrieval.build import build_index, corpus_store
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.retrieval.faiss_index import check_factory
    from replug_jax.retrieval.quality import describe
    from replug_jax.sharding import initialize_distributed

    initialize_distributed()  # a multi-host build: each process embeds its own shards
    t0 = time.perf_counter()
    # an export's replug.json (its trained similarity and lengths) wins unless set here
    given = {k: v for k, v in (("similarity", args.similarity),
                               ("max_length", args.max_length)) if v is not None}
    retriever = Retriever.load(args.retriever, batch_size=args.batch_size, **given)
    check_factory(args.factory, retriever.dim)  # before reading the corpus
    partial = pathlib.Path(args.out).with_name(pathlib.Path(args.out).name + ".partial")
    fresh = not partial.exists()
    try:
        with warnings.catch_warnings(record=True) as caught:  # repeated in the summary
            warnings.simplefilter("always")
            passages = corpus_store(args.corpus, args.out, chunk_unit=args.chunk_unit,
                                    chunk_size=args.chunk_size, overlap=args.overlap,
                                    tokenizer=retriever.model.tokenizer,
                                    progress=not args.json)
        notes = [str(w.message) for w in caught]
        for note in notes:
            warnings.warn(note, stacklevel=1)
        index = build_index(
            passages, retriever, args.out, factory=args.factory, nprobe=args.nprobe,
            embeddings=args.embeddings, num_shards=args.shards,
            embed_shard_rows=args.embed_shard_rows, train_size=args.train_size,
            rerank=args.rerank, target_recall=args.target_recall,
            recall_queries=_recall_queries(args, retriever), recall_k=args.recall_k,
            progress=not args.json,
            extra={"corpus": str(args.corpus), "chunk_unit": args.chunk_unit,
                   "chunk_size": args.chunk_size, "overlap": args.overlap})
    except ValueError:
        # A build refused before any embedding was paid for leaves nothing behind; one that
        # embedded keeps its work for the same command to resume.
        if fresh and partial.exists() and not any(partial.glob("embeddings/*.npy")):
            shutil.rmtree(partial, ignore_errors=True)
        raise
    m = index.manifest
    seconds = time.perf_counter() - t0
    size = sum(f["size"] for f in m["files"].values())
    emit(args, {"out": str(args.out), "seconds": round(seconds, 2), "bytes": size,
                "notes": notes, **m},
         f"indexed {m['n']} passages (dim {m['dim']}, {m['factory']}, {len(m['shards'])} "
         f"shard(s), {m['truncated_passages']} truncated) -> {args.out}: "
         f"{size / 2**20:.1f} MiB in {seconds:.1f} s" + describe(m)
         + "".join(f"\nnote: {n}" for n in notes))
    return 0


def cmd_info(args) -> int:
    from replug_jax.retrieval import Index
    from replug_jax.retrieval.quality import describe

    facts = Index.info(args.index)
    enc = facts["encoder"]
    emit(args, facts,
         f"{args.index}: {facts['n']} passages × {facts['dim']} ({facts['factory']}, "
         f"{facts['shards']} shard(s), {facts['bytes'] / 2**20:.1f} MiB)\n"
         f"encoder: {enc.get('source', '?')} ({enc.get('pooling', '?')} pooling, "
         f"{enc.get('similarity', '?')}, max {enc.get('max_length', '?')} tokens)\n"
         f"corpus: {facts['corpus'] or '?'} (checksum {str(facts['corpus_checksum'])[:12]})\n"
         f"search defaults: nprobe {facts['nprobe']}, re-rank ×{facts['rerank_factor']}"
         + ("" if facts["build_seconds"] is None else
            f"\nbuilt in {facts['build_seconds']:.1f} s") + describe(facts))
    return 0


def cmd_tune(args) -> int:
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.retrieval.quality import describe, tune_index

    if args.embeddings is None:
        raise ValueError("tuning needs the exact vectors: pass --embeddings FILE.npy (the "
                         "[N, D] embeddings the index was built from)")
    retriever = Retriever.for_index(args.index, args.retriever)[0] \
        if args.recall_queries and args.recall_queries.suffix != ".npy" else None
    m = tune_index(args.index, args.embeddings, target=args.target_recall,
                   queries_QD=_recall_queries(args, retriever), recall_k=args.recall_k,
                   sample=args.sample)
    emit(args, {"index": str(args.index), "nprobe": m["nprobe"],
                "rerank_factor": m["rerank_factor"], "recall": m["recall"]},
         f"{args.index}: defaults now nprobe {m['nprobe']}, re-rank ×{m['rerank_factor']}"
         + describe(m))
    return 0


def cmd_verify(args) -> int:
    from replug_jax.retrieval import Index

    report = Index.verify(args.index)
    emit(args, {"index": str(args.index), "ok": True, **report},
         f"{args.index}: {report['files']} files, {report['bytes'] / 2**20:.1f} MiB, every "
         "checksum matches")
    return 0


def cmd_merge(args) -> int:
    from replug_jax.retrieval.build import merge_indexes

    if args.out.exists():
        raise ValueError(f"--out {args.out} exists; name a new folder")
    index = merge_indexes(args.index, args.out, args.offsets)
    m = index.manifest
    emit(args, {"out": str(args.out), "n": m["n"], "merged_from": m["merged_from"]},
         f"merged {len(args.index)} indexes into {m['n']} passages -> {args.out}")
    return 0


def cmd_search(args) -> int:
    from replug_jax.replug import source_of
    from replug_jax.retrieval.encoder import Retriever

    retriever, index = Retriever.for_index(args.index, args.retriever)
    res = index.search(retriever.encode_queries(args.query), args.k, **search_options(args))
    for qi, query in enumerate(args.query):
        hits = [{**source_of(p), "score": float(s), "text": p.text}
                for p, s in zip(res.passages[qi], res.scores[qi])]
        lines = [f"query: {query}"]
        for rank, h in enumerate(hits, 1):
            text = h["text"] if len(h["text"]) < 200 else h["text"][:197] + "..."
            lines.append(f"  {rank:2d}. [{h['score']:.4f}] #{h['id']} (source "
                         f"{h['source_id']!r} [{h['start']}:{h['end']}]) {h['title']}: {text}")
        emit(args, {"query": query, "ids": [h["id"] for h in hits],
                    "scores": [h["score"] for h in hits], "texts": [h["text"] for h in hits],
                    "titles": [h["title"] for h in hits],
                    "sources": [{k: h[k] for k in ("source_id", "start", "end")}
                                for h in hits]}, "\n".join(lines))
    return 0


def search_options(args) -> dict:
    """``--nprobe`` / ``--rerank`` given on the command line (else the manifest's)."""
    return {k: v for k, v in (("nprobe", args.nprobe), ("rerank", args.rerank))
            if v is not None}


def add_search_args(p) -> None:
    p.add_argument("--nprobe", type=positive_int, default=None,
                   help="IVF lists searched per query (default: the index manifest's, set at "
                   "build or by `replug index tune`): recall against speed")
    p.add_argument("--rerank", type=non_negative_int, default=None, metavar="F",
                   help="re-score F x k candidates exactly from the vectors stored with the "
                   "index (default: the manifest's; 0: off; needs an index built with "
                   "--rerank or --target-recall)")


def check_build(args) -> None:
    """What one argument's type cannot check."""
    if args.corpus != "demo" and not pathlib.Path(args.corpus).is_file():
        raise FileNotFoundError(f"--corpus {args.corpus}: no such file")
    if args.overlap >= args.chunk_size:
        raise ValueError(f"--overlap ({args.overlap}) must be smaller than --chunk-size "
                         f"({args.chunk_size})")


def add_parsers(sub) -> None:
    index = sub.add_parser("index", help="build or search a passage index")
    isub = index.add_subparsers(dest="index_command", required=True)
    b = command(isub, "build", cmd_build, check=check_build,
                help="chunk a corpus, embed it and write a FAISS index",
                description="Chunk a corpus into passages, embed them with the "
                            "retriever (resumable) and write a FAISS index directory.")
    b.add_argument("--corpus", required=True,
                   help="corpus file (.jsonl with id/text/title, .txt one document per line, "
                   ".parquet, DPR .tsv with an id/text/title header), a passage store "
                   "(.arrow) from an earlier build, or 'demo' for the built-in Python-docs "
                   "corpus; read as a stream")
    b.add_argument("--retriever", default=DEFAULT_RETRIEVER,
                   help=f"retriever: packaged name, HF folder or hub id (default: "
                   f"{DEFAULT_RETRIEVER})")
    b.add_argument("--out", required=True, type=pathlib.Path, help="index directory to write")
    b.add_argument("--factory", default="Flat",
                   help="faiss.index_factory string: Flat (exact, default), IVF4096,Flat, "
                   "IVF4096,PQ48, OPQ48,IVF4096,PQ48, HNSW32, ...")
    b.add_argument("--nprobe", type=positive_int, default=16,
                   help="IVF lists searched per query (default 16): recall against speed")
    b.add_argument("--shards", type=positive_int, default=1,
                   help="FAISS shards over contiguous passage ranges, built independently "
                   "(by process s mod P in a multi-process run) and merged exactly at search")
    b.add_argument("--embeddings", type=existing_file, default=None,
                   help="index these [N, D] float32/float16 .npy embeddings (row i = passage "
                   "i) instead of embedding the corpus")
    b.add_argument("--embed-shard-rows", type=positive_int, default=EMBED_SHARD_ROWS,
                   help="passages per embedding shard: the unit of resumption and of work "
                   f"split between processes (default {EMBED_SHARD_ROWS})")
    b.add_argument("--rerank", type=non_negative_int, default=0, metavar="F",
                   help="keep the vectors on disk (float16) and re-rank F x k candidates of an "
                   "approximate index (IVF-PQ) by exact inner product (default 0: off)")
    b.add_argument("--target-recall", type=unit_interval, default=None, metavar="R",
                   help="tune nprobe x re-rank factor on a sample for the fastest setting whose "
                   "recall@10 against exact search reaches R (the lower bound of its 95 %% "
                   "interval), and record it as the default; keeps float32 vectors for "
                   "re-ranking when the codes are lossy (PQ)")
    b.add_argument("--recall-queries", type=existing_file, default=None,
                   help="measure recall on these queries (text, one per line, embedded with "
                   "the index's encoder; or an [Q, D] .npy) instead of a seeded sample of 256 "
                   "corpus vectors")
    b.add_argument("--recall-k", type=positive_int, default=None,
                   help="also report recall@K, the k you will retrieve (recall@10 always)")
    b.add_argument("--train-size", type=positive_int, default=None,
                   help="vectors sampled to train IVF/PQ (default: 64 per IVF list, at least "
                   "16384)")
    b.add_argument("--chunk-unit", choices=("words", "tokens", "none"), default="words",
                   help="chunk passages by words (DPR, default), retriever tokens (REPLUG), or "
                   "none (each record is already a passage, e.g. DPR's psgs_w100.tsv)")
    b.add_argument("--chunk-size", type=positive_int, default=100,
                   help="passage length in chunk units (default 100; the paper uses 128 tokens)")
    b.add_argument("--overlap", type=non_negative_int, default=0,
                   help="units shared by adjacent passages")
    b.add_argument("--similarity", choices=("cosine", "dot"), default=None,
                   help="cosine (paper Eq. 1, the default) or raw dot product (official "
                        "code); default: the retriever's (an export's replug.json), else "
                        "cosine")
    b.add_argument("--max-length", type=positive_int, default=None,
                   help="encoder token limit; longer passages are truncated and counted "
                        "(default: an export's trained doc_max_length, else 512)")
    b.add_argument("--batch-size", type=positive_int, default=None,
                   help="encoding batch size (default: 8 on CPU, 64 on GPU/TPU)")
    s = command(isub, "search", cmd_search, help="print the top-k passages for queries",
                description="Search an index directory with one or more queries.")
    s.add_argument("index", type=index_dir, help="index directory")
    s.add_argument("query", nargs="+", help="query text(s)")
    s.add_argument("-k", type=positive_int, default=10, help="passages per query (default 10)")
    s.add_argument("--retriever", default=None,
                   help="query encoder (default: the one recorded in the index manifest)")
    add_search_args(s)
    info = command(isub, "info", cmd_info, help="print an index's facts: size, encoder, recall",
                   description="What the manifest records: N, dim, factory, shards, "
                               "bytes, encoder, corpus, search defaults, the recall measured at "
                               "build (or by `replug index tune`).")
    info.add_argument("index", type=index_dir, help="index directory")
    tune = command(isub, "tune", cmd_tune, help="tune nprobe x re-rank factor to a target recall",
                   description="Measure recall@10 against exact search (the vectors "
                               "of --embeddings, streamed) over nprobe x re-rank factor, keep the "
                               "fastest setting whose interval's lower bound reaches the target "
                               "and record it as the index's default; prints the frontier.")
    tune.add_argument("index", type=index_dir, help="index directory")
    tune.add_argument("--embeddings", type=existing_file, default=None,
                      help="the [N, D] .npy the index was built from (exact search)")
    tune.add_argument("--target-recall", type=unit_interval, default=0.95, metavar="R",
                      help="recall@10 to reach (default 0.95)")
    tune.add_argument("--recall-queries", type=existing_file, default=None,
                      help="queries (text lines or [Q, D] .npy) instead of a corpus sample")
    tune.add_argument("--recall-k", type=positive_int, default=None,
                      help="also report recall@K")
    tune.add_argument("--sample", type=positive_int, default=256,
                      help="corpus vectors used as queries")
    tune.add_argument("--retriever", default=None,
                      help="query encoder for text --recall-queries (default: the manifest's)")
    mg = command(isub, "merge", cmd_merge, help="one exact index of several, with no re-encoding",
                 description="Merge exact (Flat) indexes built by one encoder (a task's own "
                             "passages and a distractor corpus, say) into one folder that every "
                             "command searches as one datastore; no passage is encoded again.")
    mg.add_argument("index", type=index_dir, nargs="+", help="index directories, in order")
    mg.add_argument("--out", type=pathlib.Path, required=True, help="the merged index folder")
    mg.add_argument("--offsets", type=int, nargs="+", default=None, metavar="N",
                    help="added to the passage ids of each index, in order (default 0 for "
                         "all; two passages may not share an id), e.g. 0 100000000")
    v = command(isub, "verify", cmd_verify, help="hash every file of an index against its manifest",
                description="Full integrity check: every file's size and SHA-256 "
                            "against the manifest (loading checks sizes and hashes only small or "
                            "modified files).")
    v.add_argument("index", type=index_dir, help="index directory")
