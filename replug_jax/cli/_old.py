"""The `replug` command: parses arguments and calls library functions.

Every sub-command takes ``--json`` for machine-readable output and ``--help`` for its options.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys


def _setup_jax() -> None:
    """Persistent compilation cache, so repeated runs skip XLA compilation."""
    import jax

    if jax.config.jax_compilation_cache_dir:  # already chosen by the caller (e.g. tests)
        return
    cache = os.environ.get("REPLUG_JAX_CACHE_DIR",
                           str(pathlib.Path.home() / ".cache" / "replug_jax" / "jax"))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


def _emit(args, obj, text: str) -> None:
    print(json.dumps(obj, ensure_ascii=False) if args.json else text)


# -- index ---------------------------------------------------------------------------------

def _passage_store(args, retriever):
    """The corpus as a passage store in ``<out>.partial/`` (streamed: chunked one document at a
    time), reused when an interrupted build already wrote it from the same corpus and options.
    ``--corpus X.arrow`` is a store already made."""
    from replug_jax.retrieval.corpus import demo_corpus, iter_chunks, iter_documents
    from replug_jax.fileio import write_json_atomic
    from replug_jax.retrieval.store import PassageStore, write_store

    if args.corpus == "demo":
        return demo_corpus(size=args.chunk_size, overlap=args.overlap)
    corpus = pathlib.Path(args.corpus)
    if corpus.suffix == ".arrow":
        return corpus
    work = args.out.with_name(args.out.name + ".partial")
    work.mkdir(parents=True, exist_ok=True)
    st = corpus.stat()
    spec = {"corpus": str(corpus.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "chunk_unit": args.chunk_unit, "chunk_size": args.chunk_size,
            "overlap": args.overlap}
    spec_path, store_path = work / "corpus_spec.json", work / "passages.arrow"
    import jax

    from replug_jax.sharding import barrier

    def reusable() -> bool:
        if not spec_path.exists() or json.loads(spec_path.read_text()) != spec:
            return False
        try:
            PassageStore.open(store_path)
            return True
        except ValueError:
            return False

    # one process chunks (or finds the store of an interrupted build); the others wait for it
    if jax.process_index() == 0 and not reusable():
        tokenizer = retriever.model.tokenizer if args.chunk_unit == "tokens" else None
        write_store(iter_chunks(iter_documents(corpus), size=args.chunk_size,
                                overlap=args.overlap, unit=args.chunk_unit,
                                tokenizer=tokenizer),
                    store_path, progress=not args.json)
        write_json_atomic(spec, spec_path)
    barrier("replug_passages")
    return store_path


def _cmd_index_build(args) -> int:
    import time

    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.retrieval.index import build_index
    from replug_jax.sharding import initialize_distributed

    initialize_distributed()  # a multi-host build: each process embeds its own shards
    t0 = time.perf_counter()
    retriever = Retriever.load(args.retriever, similarity=args.similarity,
                               max_length=args.max_length, batch_size=args.batch_size)
    passages = _passage_store(args, retriever)
    index = build_index(passages, retriever, args.out, factory=args.factory, nprobe=args.nprobe,
                        embeddings=args.embeddings, num_shards=args.shards,
                        embed_shard_rows=args.embed_shard_rows, train_size=args.train_size,
                        rerank=args.rerank, target_recall=args.target_recall,
                        recall_queries=_recall_queries(args, retriever),
                        recall_k=args.recall_k, progress=not args.json,
                        extra={"corpus": str(args.corpus), "chunk_unit": args.chunk_unit,
                               "chunk_size": args.chunk_size, "overlap": args.overlap})
    m = index.manifest
    seconds = time.perf_counter() - t0
    size = sum(f["size"] for f in m["files"].values())
    _emit(args, {"out": str(args.out), "seconds": round(seconds, 2), "bytes": size, **m},
          f"indexed {m['n']} passages (dim {m['dim']}, {m['factory']}, {len(m['shards'])} "
          f"shard(s), {m['truncated_passages']} truncated) -> {args.out}: "
          f"{size / 2**20:.1f} MiB in {seconds:.1f} s" + _recall_lines(m))
    return 0


def _recall_queries(args, retriever):
    """``--recall-queries``: a .npy of query vectors, or text lines embedded as queries."""
    import numpy as np

    path = args.recall_queries
    if path is None:
        return None
    if path.suffix == ".npy":
        return np.load(path, allow_pickle=False).astype(np.float32)
    lines = [t for t in path.read_text(encoding="utf-8").splitlines() if t.strip()]
    if not lines:
        raise ValueError(f"{path}: no queries")
    return retriever.encode_queries(lines)


def _recall_lines(m: dict) -> str:
    """The recall an index build measured, and its tuning, as lines of text."""
    r = m.get("recall")
    if not r:
        return "\nrecall: exact search (Flat)" if m.get("factory") == "Flat" else ""
    out = [f"\nrecall against exact search ({r['n']} queries: {r['queries']}; 95 % "
           f"bootstrap interval), nprobe {m.get('nprobe')}, re-rank "
           f"×{m.get('rerank_factor', 0)}:"]
    for k, v in r["at"].items():
        out.append(f"  recall@{k} {v['recall']:.3f} [{v['low']:.3f}, {v['high']:.3f}], "
                   f"{v['qps']:.0f} queries/s")
    t = r.get("tuning")
    if t:
        out.append(f"  tuned for recall@{r.get('tuned_k', 10)} ≥ {t['target']} (interval's "
                   "lower bound): "
                   + ("reached" if t["reached"] else "NOT reached (the best setting is kept; "
                      "raise --rerank candidates, use finer PQ codes or Flat)"))
        out.append("  frontier (nprobe, re-rank: recall@10 lower bound, ms/query): " + "; ".join(
            f"{f['nprobe']}, ×{f['rerank']}: {f['recall_low']:.3f}, "
            f"{1e3 * f['seconds_per_query']:.2f}" for f in t["frontier"]))
    return "\n".join(out)


def _cmd_index_info(args) -> int:
    from replug_jax.retrieval.index import Index

    m = Index._read_manifest(args.index)
    size = sum(f["size"] for f in m.get("files", {}).values())
    enc = m.get("encoder", {})
    facts = {"index": str(args.index), "n": m["n"], "dim": m["dim"], "factory": m["factory"],
             "shards": len(m["shards"]), "bytes": size, "nprobe": m.get("nprobe"),
             "rerank_factor": m.get("rerank_factor", 0),
             "rerank_vectors": m.get("rerank_vectors", False), "encoder": enc,
             "recall": m.get("recall"), "build_seconds": m.get("build_seconds"),
             "corpus": m.get("corpus"), "corpus_checksum": m.get("corpus_checksum")}
    _emit(args, facts,
          f"{args.index}: {m['n']} passages × {m['dim']} ({m['factory']}, "
          f"{len(m['shards'])} shard(s), {size / 2**20:.1f} MiB)\n"
          f"encoder: {enc.get('source', '?')} ({enc.get('pooling', '?')} pooling, "
          f"{enc.get('similarity', '?')}, max {enc.get('max_length', '?')} tokens)\n"
          f"corpus: {m.get('corpus', '?')} (checksum {str(m.get('corpus_checksum'))[:12]})\n"
          f"search defaults: nprobe {m.get('nprobe')}, re-rank ×{m.get('rerank_factor', 0)}"
          + ("" if m.get("build_seconds") is None else
             f"\nbuilt in {m['build_seconds']:.1f} s") + _recall_lines(m))
    return 0


def _cmd_index_tune(args) -> int:
    from replug_jax.retrieval.index import EmbeddingSource, Index
    from replug_jax.retrieval.quality import recall_report

    retriever, index = _load_index(args.index, args.retriever) if args.recall_queries \
        else (None, Index.load(args.index))
    if args.embeddings is None:
        raise ValueError("tuning needs the exact vectors: pass --embeddings FILE.npy (the "
                         "[N, D] embeddings the index was built from)")
    source = EmbeddingSource.from_files([args.embeddings], n=len(index), dim=index.manifest["dim"])
    report = recall_report(index, source, k=10, user_k=args.recall_k,
                           queries_QD=_recall_queries(args, retriever),
                           sample=args.sample, target=args.target_recall)
    index.manifest["recall"] = report
    _write_manifest(args.index, index.manifest)
    _emit(args, {"index": str(args.index), "nprobe": index.manifest["nprobe"],
                 "rerank_factor": index.manifest["rerank_factor"], "recall": report},
          f"{args.index}: defaults now nprobe {index.manifest['nprobe']}, re-rank "
          f"×{index.manifest['rerank_factor']}" + _recall_lines(index.manifest))
    return 0


def _write_manifest(directory: pathlib.Path, manifest: dict) -> None:
    from replug_jax.fileio import write_json_atomic

    write_json_atomic(manifest, directory / "manifest.json")


def _cmd_index_verify(args) -> int:
    from replug_jax.retrieval.index import Index

    report = Index.verify(args.index)
    _emit(args, {"index": str(args.index), "ok": True, **report},
          f"{args.index}: {report['files']} files, {report['bytes'] / 2**20:.1f} MiB, every "
          "checksum matches")
    return 0


def _cmd_index_search(args) -> int:
    from replug_jax.replug import source_of

    retriever, index = _load_index(args.index, args.retriever)
    res = index.search(retriever.encode_queries(args.query), args.k, **_search_options(args))
    for qi, query in enumerate(args.query):
        hits = [{**source_of(p), "score": float(s), "text": p.text}
                for p, s in zip(res.passages[qi], res.scores[qi])]
        if args.json:
            print(json.dumps({"query": query, "ids": [h["id"] for h in hits],
                              "scores": [h["score"] for h in hits],
                              "texts": [h["text"] for h in hits],
                              "titles": [h["title"] for h in hits],
                              "sources": [{k: h[k] for k in ("source_id", "start", "end")}
                                          for h in hits]}, ensure_ascii=False))
        else:
            print(f"query: {query}")
            for rank, h in enumerate(hits, 1):
                text = h["text"] if len(h["text"]) < 200 else h["text"][:197] + "..."
                print(f"  {rank:2d}. [{h['score']:.4f}] #{h['id']} (source {h['source_id']!r} "
                      f"[{h['start']}:{h['end']}]) {h['title']}: {text}")
    return 0


# -- inference -----------------------------------------------------------------------------

def _make_lm(args):
    if args.api_base:
        from replug_jax.lm.api_scorer import APIScorer

        return APIScorer.connect(args.api_base, model=args.api_model,
                                 tokenizer=args.api_tokenizer, timeout=args.api_timeout,
                                 endpoint=args.api_endpoint, max_retries=args.api_retries)
    from replug_jax.lm.flax_scorer import FlaxLM

    return FlaxLM.load(args.lm, dtype=args.dtype, max_context=args.max_context)


def _load_index(directory: pathlib.Path, retriever_source: str | None):
    """The query encoder recorded in the index manifest (or ``retriever_source``), then the
    index checked against it: the manifest is read once, the files checked once."""
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.retrieval.index import Index, IndexLoadError

    try:
        enc = json.loads((directory / "manifest.json").read_text()).get("encoder", {})
    except (OSError, json.JSONDecodeError) as err:
        raise IndexLoadError(f"{directory}: unreadable manifest.json ({err})") from err
    retriever = Retriever.load(retriever_source or enc.get("source", "minilm"),
                               similarity=enc.get("similarity", "cosine"),
                               max_length=enc.get("max_length", 512))
    return retriever, Index.load(directory, expect_encoder=retriever.identity)


def _make_pipeline(args, mode: str):
    from replug_jax.replug import Replug

    lm = _make_lm(args)
    retriever = index = None
    if mode != "none":
        if args.index is None:
            raise ValueError(f"mode {mode!r} needs --index (build one with `replug index build`)")
        retriever, index = _load_index(args.index, args.retriever)
    return Replug(lm, retriever, index, k=args.k, temperature=args.temperature,
                  separator=args.separator.encode().decode("unicode_escape"), mode=mode,
                  seed=args.seed, **_search_options(args))


def _search_options(args) -> dict:
    """``--nprobe`` / ``--rerank`` given on the command line (else the manifest's)."""
    return {k: v for k, v in (("nprobe", args.nprobe), ("rerank", args.rerank))
            if v is not None}


def _add_search_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nprobe", type=int, default=None,
                   help="IVF lists searched per query (default: the index manifest's, set at "
                   "build or by `replug index tune`): recall against speed")
    p.add_argument("--rerank", type=int, default=None, metavar="F",
                   help="re-score F x k candidates exactly from the vectors stored with the "
                   "index (default: the manifest's; 0: off; needs an index built with "
                   "--rerank or --target-recall)")


def _cmd_score(args) -> int:
    from replug_jax.fileio import read_jsonl
    from replug_jax.lm.scorer import SCORE, require
    from replug_jax.replug import summarize

    rows = read_jsonl(args.input)
    for i, r in enumerate(rows):
        if "context" not in r or "continuation" not in r:
            raise ValueError(f"{args.input}: line {i + 1} needs 'context' and 'continuation'")
    pipe = _make_pipeline(args, args.baseline)
    require(pipe.lm, SCORE, "scoring")  # a server that cannot score says so in one line
    results = []
    from tqdm.auto import tqdm

    for start in tqdm(range(0, len(rows), args.batch), desc="scoring", disable=args.json):
        chunk = rows[start:start + args.batch]
        results += pipe.score([r["context"] for r in chunk], [r["continuation"] for r in chunk],
                              [r.get("query", r["context"]) for r in chunk])
    summary = summarize(results)
    if args.json:
        for r in results:
            print(json.dumps({k: v for k, v in r.to_json().items()
                              if k in ("loglik", "num_tokens", "num_bytes", "doc_ids",
                                       "weights", "retrieval_reliance", "cost")}))
        print(json.dumps({"summary": summary, "settings": results[0].settings}))
    else:
        for i, r in enumerate(results):
            print(f"{i}: loglik {r.loglik:.3f} over {r.num_tokens} tokens, docs "
                  f"{list(zip(r.doc_ids, [round(w, 3) for w in r.weights]))}")
        print(f"perplexity {summary['perplexity']:.3f}, bits per byte "
              f"{summary['bits_per_byte']:.4f} ({summary['num_tokens']} tokens, mode "
              f"{args.baseline}, k={args.k})")
    return 0


def _print_generation(r, title: str) -> None:
    print(f"{title}: {r.text.strip()!r}")
    if r.approximation:
        print(f"  note: {r.approximation}")
    for src, w, text in zip(r.sources, r.weights, r.doc_texts):
        snippet = text if len(text) < 110 else text[:107] + "..."
        where = f" ({src['source_id']})" if src["source_id"] else ""
        print(f"  λ={w:.3f}  #{src['id']}{where} {src['title']}: {snippet}")
    c = r.cost
    print(f"  cost: {c['lm_calls']} LM rows, {c['input_tokens']} input + {c['output_tokens']} "
          f"output tokens, LM {c['lm_seconds']:.2f}s, retrieval {c['retrieval_seconds']:.2f}s, "
          f"wall {c['wall_seconds']:.2f}s"
          + (f"; the server reused {c['cached_input_tokens']} cached prompt tokens"
             if c.get("cached_input_tokens") else ""))


def _cmd_generate(args) -> int:
    pipe = _make_pipeline(args, args.baseline)
    r = pipe.generate([args.prompt], args.max_new_tokens, temperature=args.temperature_sample,
                      top_p=args.top_p, stop=args.stop, queries=[args.query or args.prompt])[0]
    if args.json:
        print(json.dumps(r.to_json(), ensure_ascii=False))
    else:
        _print_generation(r, "generation")
    return 0


def _cmd_ask(args) -> int:
    from replug_jax.prompts import qa_prompt

    pipe = _make_pipeline(args, args.baseline)
    prompt = qa_prompt(args.question, getattr(pipe.lm, "tokenizer", None))
    r = pipe.generate([prompt], args.max_new_tokens, stop=["\n"], queries=[args.question])[0]
    if args.json:
        print(json.dumps({"question": args.question, "answer": r.text.strip(),
                          **r.to_json()}, ensure_ascii=False))
    else:
        _print_generation(r, "answer")
    return 0


# Docstring snippets are short: 64-word passages and a 256-token encoder limit (5 of 1251
# passages are cut) encode the demo corpus in about half a minute on 2 CPU cores.
DEMO_PASSAGE_WORDS = 64
DEMO_MAX_LENGTH = 256
DEMO_QUESTIONS = (
    "Which function in the json module parses a JSON string into a Python object?",
    "Which function from the statistics module returns the middle value of numeric data?",
    "What does shutil.rmtree do?",
)


def _cmd_demo(args) -> int:
    import time

    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.prompts import qa_prompt
    from replug_jax.replug import Replug
    from replug_jax.retrieval.corpus import corpus_checksum, demo_corpus
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.retrieval.index import Index, IndexLoadError, build_index

    t0 = time.perf_counter()
    log = (lambda *a: None) if args.json else print  # noqa: E731
    passages = demo_corpus(size=DEMO_PASSAGE_WORDS)
    log(f"corpus: {len(passages)} passages of Python standard-library documentation")
    retriever = Retriever.load(args.retriever, max_length=DEMO_MAX_LENGTH)
    try:
        index = Index.load(args.index_dir, expect_encoder=retriever.identity,
                           expect_corpus_checksum=corpus_checksum(passages))
        log(f"index: reusing {args.index_dir}")
    except IndexLoadError:
        log(f"index: building {args.index_dir} (once; reused afterwards)")
        index = build_index(passages, retriever, args.index_dir, progress=not args.json,
                            extra={"corpus": "demo"})
    lm = FlaxLM.load(args.lm)
    pipe = Replug(lm, retriever, index, k=args.k)
    out = []
    for q in (args.question or DEMO_QUESTIONS):
        prompt = qa_prompt(q, lm.tokenizer)
        closed = pipe.generate([prompt], args.max_new_tokens, stop=["\n"], mode="none")[0]
        rep = pipe.generate([prompt], args.max_new_tokens, stop=["\n"], queries=[q])[0]
        out.append({"question": q, "answer_without_retrieval": closed.text.strip(),
                    "answer_replug": rep.text.strip(), "sources": [
                        {"id": i, "title": t, "weight": round(w, 4)}
                        for i, t, w in zip(rep.doc_ids, rep.doc_titles, rep.weights)],
                    "cost": rep.cost, "cost_without_retrieval": closed.cost})
        if not args.json:
            print(f"\nQ: {q}")
            print(f"LM alone: {closed.text.strip()!r}")
            _print_generation(rep, f"REPLUG (k={args.k})")
    seconds = time.perf_counter() - t0
    if args.json:
        print(json.dumps({"results": out, "settings": pipe.settings("replug", args.k),
                          "index": str(args.index_dir), "seconds": round(seconds, 2)}))
    else:
        rows = sum(r["cost"]["lm_calls"] + r["cost_without_retrieval"]["lm_calls"] for r in out)
        print(f"\ndone: {len(out)} question(s), k={args.k}, {len(index)} passages indexed in "
              f"{args.index_dir}, {rows} LM rows, {seconds:.0f} s in all")
    return 0


def _serve_settings(args):
    """Limits and the API key of `replug serve`, checked before the model loads."""
    from replug_jax.lm.server import API_KEY_ENV, ServeLimits, is_loopback

    limits = ServeLimits(**{f.name: getattr(args, f.name)
                            for f in dataclasses.fields(ServeLimits)})
    for f in dataclasses.fields(ServeLimits):
        if getattr(limits, f.name) <= 0:
            raise ValueError(f"--{f.name.replace('_', '-')} must be positive")
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not is_loopback(args.host) and api_key is None and not args.insecure:
        raise ValueError(f"refusing to serve on {args.host} without an API key: pass --api-key "
                         f"(or set ${API_KEY_ENV}), or --insecure")
    return limits, api_key


def _cmd_serve(args) -> int:
    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.lm.server import serve

    limits, api_key = _serve_settings(args)
    serve(FlaxLM.load(args.lm, dtype=args.dtype, max_context=args.max_context), args.host,
          args.port, args.model_name, limits=limits, api_key=api_key, insecure=args.insecure)
    return 0


def _cmd_train_lsr(args) -> int:
    from replug_jax.sharding import initialize_distributed
    from replug_jax.train.config import load_config
    from replug_jax.train.setup import build_trainer

    initialize_distributed()
    cfg, variant = load_config(args.config, args.set)
    trainer = build_trainer(cfg, args.workdir, progress=not args.json)
    result = trainer.run(stop_after=args.max_steps)
    result["variant"] = variant
    if args.json:
        print(json.dumps(result))
    else:
        last = result["last"]
        print(f"step {result['step']}/{cfg.total_steps}: loss {last.get('loss', float('nan')):.4f}"
              f", P_R/Q argmax agreement {last.get('argmax_agreement', float('nan')):.2f}, "
              f"LM cache {result['lm_cache_hits']} hits / {result['lm_cache_misses']} misses")
        if "dev" in result:
            print(f"dev: {result['dev']}")
    return 0


def _cmd_export_retriever(args) -> int:
    from replug_jax.train.export import export_run

    out, step = export_run(args.workdir, args.out, args.step)
    _emit(args, {"out": str(out), "step": step}, f"exported step {step} -> {out}")
    return 0


def _add_pipeline_args(p: argparse.ArgumentParser, index_required: bool = False) -> None:
    p.add_argument("--index", type=pathlib.Path, required=index_required,
                   help="index directory from `replug index build` (not needed with "
                   "--baseline none)")
    p.add_argument("--retriever", default=None,
                   help="query encoder (default: the one recorded in the index manifest)")
    p.add_argument("--lm", default="smollm2",
                   help="LM: packaged name, HF folder, hub id or .gguf (default: smollm2)")
    p.add_argument("-k", type=int, default=10, help="documents per query (paper: 10)")
    _add_search_args(p)
    p.add_argument("--temperature", type=float, default=None,
                   help="temperature τ of λ = softmax(s/τ) (default: the τ fitted for the "
                        "retriever, recorded in its replug.json, else the paper's 1)")
    p.add_argument("--separator", default="\\n\\n",
                   help="text between a document and the input (default: a blank line)")
    p.add_argument("--baseline", choices=("replug", "none", "concat", "top1", "random"),
                   default="replug", help="replug (ensemble, default), none (LM alone), concat "
                   "(all k documents in one prompt), top1, random (k random documents)")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling and random documents")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="LM parameter dtype (bfloat16 for GPU/TPU)")
    p.add_argument("--max-context", type=int, default=2048,
                   help="LM context budget in tokens; documents are cut to fit")
    p.add_argument("--api-base", default=None,
                   help="use an OpenAI-compatible server at this URL instead of --lm (API key "
                   "from $REPLUG_API_KEY or $OPENAI_API_KEY)")
    p.add_argument("--api-model", default=None, help="model name sent to the API")
    p.add_argument("--api-endpoint", choices=("completions", "chat"), default="completions",
                   help="completions (default): /v1/completions with the raw prompt; chat: "
                   "/v1/chat/completions with the prompt as one user turn (the server applies "
                   "its chat template) and the text generated so far as a final assistant "
                   "message to continue. Chat endpoints give no prompt log-probs, so scoring "
                   "needs completions. The server is probed first (`replug api check`)")
    p.add_argument("--api-tokenizer", default=None,
                   help="local tokenizer source for the API's model (for document truncation)")
    p.add_argument("--api-timeout", type=float, default=60.0, help="API timeout in seconds")
    p.add_argument("--api-retries", type=int, default=4,
                   help="retries of an API request after a 429, a 5xx, a timeout or a failed "
                   "connection (exponential backoff from 0.5 s)")


def _cmd_api_check(args) -> int:
    from replug_jax.lm.api_scorer import APIScorer

    api = APIScorer(args.api_base, model=args.api_model, timeout=args.api_timeout,
                    endpoint=args.api_endpoint, scoring="auto", max_retries=args.api_retries)
    caps = api.probe(top_n=args.top_n)
    if args.json:
        print(json.dumps(caps.to_json(), ensure_ascii=False))
        return 0
    rows = caps.table()
    width = max(len(r[0]) for r in rows)
    print(f"server: {caps.base_url}")
    for what, answer, detail in rows:
        print(f"  {what:<{width}}  {answer:<20} {detail}")
    if not caps.scoring:
        print(f"note: {caps.refusal('scoring')}")
    return 0


def _add_json(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print machine-readable JSON instead of text")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="replug", description="REPLUG in JAX: retrieval-augmented black-box LMs (Shi et al. "
        "2024). Retrievers and LMs default to the packaged offline models "
        "(minilm, smollm2); any HF folder, hub id or .gguf file works too.")
    sub = parser.add_subparsers(dest="command", required=True)

    index = sub.add_parser("index", help="build or search a passage index")
    isub = index.add_subparsers(dest="index_command", required=True)
    b = isub.add_parser("build", help="chunk a corpus, embed it and write a FAISS index",
                        description="Chunk a corpus into passages, embed them with the "
                        "retriever (resumable) and write a FAISS index directory.")
    b.add_argument("--corpus", required=True,
                   help="corpus file (.jsonl with id/text/title, .txt one document per line, "
                   ".parquet, DPR .tsv with an id/text/title header), a passage store "
                   "(.arrow) from an earlier build, or 'demo' for the built-in Python-docs "
                   "corpus; read as a stream")
    b.add_argument("--retriever", default="minilm",
                   help="retriever: packaged name, HF folder or hub id (default: minilm)")
    b.add_argument("--out", required=True, type=pathlib.Path, help="index directory to write")
    b.add_argument("--factory", default="Flat",
                   help="faiss.index_factory string: Flat (exact, default), IVF4096,Flat, "
                   "IVF4096,PQ48, OPQ48,IVF4096,PQ48, HNSW32, ...")
    b.add_argument("--nprobe", type=int, default=16,
                   help="IVF lists searched per query (default 16): recall against speed")
    b.add_argument("--shards", type=int, default=1,
                   help="FAISS shards over contiguous passage ranges, built independently "
                   "(by process s mod P in a multi-process run) and merged exactly at search")
    b.add_argument("--embeddings", type=pathlib.Path, default=None,
                   help="index these [N, D] float32/float16 .npy embeddings (row i = passage "
                   "i) instead of embedding the corpus")
    b.add_argument("--embed-shard-rows", type=int, default=65536,
                   help="passages per embedding shard: the unit of resumption and of work "
                   "split between processes (default 65536)")
    b.add_argument("--rerank", type=int, default=0, metavar="F",
                   help="keep the vectors on disk (float16) and re-rank F x k candidates of an "
                   "approximate index (IVF-PQ) by exact inner product (default 0: off)")
    b.add_argument("--target-recall", type=float, default=None, metavar="R",
                   help="tune nprobe x re-rank factor on a sample for the fastest setting whose "
                   "recall@10 against exact search reaches R (the lower bound of its 95 %% "
                   "interval), and record it as the default; keeps float32 vectors for "
                   "re-ranking when the codes are lossy (PQ)")
    b.add_argument("--recall-queries", type=pathlib.Path, default=None,
                   help="measure recall on these queries (text, one per line, embedded with "
                   "the index's encoder; or an [Q, D] .npy) instead of a seeded sample of 256 "
                   "corpus vectors")
    b.add_argument("--recall-k", type=int, default=None,
                   help="also report recall@K, the k you will retrieve (recall@10 always)")
    b.add_argument("--train-size", type=int, default=None,
                   help="vectors sampled to train IVF/PQ (default: 64 per IVF list, at least "
                   "16384)")
    b.add_argument("--chunk-unit", choices=("words", "tokens", "none"), default="words",
                   help="chunk passages by words (DPR, default), retriever tokens (REPLUG), or "
                   "none (each record is already a passage, e.g. DPR's psgs_w100.tsv)")
    b.add_argument("--chunk-size", type=int, default=100,
                   help="passage length in chunk units (default 100; the paper uses 128 tokens)")
    b.add_argument("--overlap", type=int, default=0, help="units shared by adjacent passages")
    b.add_argument("--similarity", choices=("cosine", "dot"), default="cosine",
                   help="cosine (paper Eq. 1, default) or raw dot product (official code)")
    b.add_argument("--max-length", type=int, default=512,
                   help="encoder token limit; longer passages are truncated and counted")
    b.add_argument("--batch-size", type=int, default=None,
                   help="encoding batch size (default: 8 on CPU, 64 on GPU/TPU)")
    _add_json(b)
    b.set_defaults(func=_cmd_index_build)
    s = isub.add_parser("search", help="print the top-k passages for queries",
                        description="Search an index directory with one or more queries.")
    s.add_argument("index", type=pathlib.Path, help="index directory")
    s.add_argument("query", nargs="+", help="query text(s)")
    s.add_argument("-k", type=int, default=10, help="passages per query (default 10)")
    s.add_argument("--retriever", default=None,
                   help="query encoder (default: the one recorded in the index manifest)")
    _add_search_args(s)
    _add_json(s)
    s.set_defaults(func=_cmd_index_search)
    info = isub.add_parser("info", help="print an index's facts: size, encoder, recall",
                           description="What the manifest records: N, dim, factory, shards, "
                           "bytes, encoder, corpus, search defaults, the recall measured at "
                           "build (or by `replug index tune`).")
    info.add_argument("index", type=pathlib.Path, help="index directory")
    _add_json(info)
    info.set_defaults(func=_cmd_index_info)
    tune = isub.add_parser("tune", help="tune nprobe x re-rank factor to a target recall",
                           description="Measure recall@10 against exact search (the vectors "
                           "of --embeddings, streamed) over nprobe x re-rank factor, keep the "
                           "fastest setting whose interval's lower bound reaches the target "
                           "and record it as the index's default; prints the frontier.")
    tune.add_argument("index", type=pathlib.Path, help="index directory")
    tune.add_argument("--embeddings", type=pathlib.Path, default=None,
                      help="the [N, D] .npy the index was built from (exact search)")
    tune.add_argument("--target-recall", type=float, default=0.95, metavar="R",
                      help="recall@10 to reach (default 0.95)")
    tune.add_argument("--recall-queries", type=pathlib.Path, default=None,
                      help="queries (text lines or [Q, D] .npy) instead of a corpus sample")
    tune.add_argument("--recall-k", type=int, default=None, help="also report recall@K")
    tune.add_argument("--sample", type=int, default=256, help="corpus vectors used as queries")
    tune.add_argument("--retriever", default=None,
                      help="query encoder for text --recall-queries (default: the manifest's)")
    _add_json(tune)
    tune.set_defaults(func=_cmd_index_tune)
    v = isub.add_parser("verify", help="hash every file of an index against its manifest",
                        description="Full integrity check: every file's size and SHA-256 "
                        "against the manifest (loading checks sizes and hashes only small or "
                        "modified files).")
    v.add_argument("index", type=pathlib.Path, help="index directory")
    _add_json(v)
    v.set_defaults(func=_cmd_index_verify)

    sc = sub.add_parser("score", help="REPLUG log-likelihood of continuations (perplexity, BPB)",
                        description="Score each JSONL line {context, continuation, query?} with "
                        "the REPLUG ensemble; the query defaults to the context.")
    sc.add_argument("--input", type=pathlib.Path, required=True, help="JSONL input file")
    sc.add_argument("--batch", type=int, default=8, help="lines per pipeline call")
    _add_pipeline_args(sc)
    _add_json(sc)
    sc.set_defaults(func=_cmd_score)

    gen = sub.add_parser("generate", help="coordinated REPLUG decoding of a prompt",
                         description="Generate from the mixture over document branches; "
                         "every branch receives the chosen token.")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--query", default=None, help="retrieval query (default: the prompt)")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    gen.add_argument("--temperature-sample", type=float, default=0.0,
                     help="sampling temperature (0 = greedy, default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--stop", action="append", default=[],
                     help="stop string (repeatable)")
    _add_pipeline_args(gen)
    _add_json(gen)
    gen.set_defaults(func=_cmd_generate)

    ask = sub.add_parser("ask", help="answer a question with its sources and their weights",
                         description="Question -> answer with REPLUG, printing the retrieved "
                         "passages and λ.")
    ask.add_argument("question", help="the question")
    ask.add_argument("--max-new-tokens", type=int, default=32, help="answer length limit")
    _add_pipeline_args(ask, index_required=False)
    _add_json(ask)
    ask.set_defaults(func=_cmd_ask)

    demo = sub.add_parser("demo", help="REPLUG on the packaged models and Python-docs corpus",
                          description="Build (or reuse) an index of the Python standard "
                          "library's documentation with the packaged MiniLM retriever, then "
                          "answer Python questions with the packaged SmolLM2, with and "
                          "without retrieval, showing the sources, λ and the cost.")
    demo.add_argument("--index-dir", type=pathlib.Path,
                      default=pathlib.Path.home() / ".cache" / "replug_jax" / "demo_index",
                      help="where the demo index is kept")
    demo.add_argument("--retriever", default="minilm", help="retriever (default: minilm)")
    demo.add_argument("--lm", default="smollm2", help="LM (default: smollm2)")
    demo.add_argument("-k", type=int, default=5, help="documents per question (default 5)")
    demo.add_argument("--max-new-tokens", type=int, default=24, help="answer length limit")
    demo.add_argument("--question", action="append", default=None,
                      help="ask this instead of the built-in questions (repeatable)")
    _add_json(demo)
    demo.set_defaults(func=_cmd_demo)

    srv = sub.add_parser("serve", help="serve a Flax LM over an OpenAI-compatible API",
                         description="Serve --lm at /v1/completions (echo, logprobs, "
                         "prompt_logprobs), /v1/models and /health.")
    srv.add_argument("--lm", default="smollm2", help="LM source (default: smollm2)")
    srv.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    srv.add_argument("--model-name", default=None, help="model id reported by the API")
    srv.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                     help="parameter dtype")
    srv.add_argument("--max-context", type=int, default=2048, help="context limit in tokens")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1 routes (default: "
                     "$REPLUG_SERVE_API_KEY; never logged)")
    srv.add_argument("--insecure", action="store_true",
                     help="allow a non-loopback --host without an API key")
    from replug_jax.lm.server import ServeLimits

    helps = {"max_prompts": "prompts per request", "max_tokens": "new tokens per prompt",
             "max_logprobs": "top-n logprobs per token",
             "max_prompt_logprobs": "top-n prompt_logprobs per token",
             "max_body_bytes": "request body size in bytes",
             "queue_size": "requests waiting before the server answers 429",
             "max_batch": "prompts of concurrent requests run as one batch",
             "batch_window_s": "seconds the worker waits to fill a batch",
             "request_timeout_s": "seconds a request may wait and run before 504"}
    for f in dataclasses.fields(ServeLimits):
        srv.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default),
                         default=f.default, help=f"{helps[f.name]} (default {f.default})")
    _add_json(srv)
    srv.set_defaults(func=_cmd_serve)

    api = sub.add_parser("api", help="check what an OpenAI-compatible LM server can do")
    asub = api.add_subparsers(dest="api_command", required=True)
    chk = asub.add_parser("check", help="probe a server: echo / prompt_logprobs scoring, "
                          "top-n log-probs (largest n), conformance of its scores",
                          description="Probe an OpenAI-compatible server the way score, ask, "
                          "generate and train-lsr do before any work, and print what it can "
                          "do: scoring supplied text (echo or vLLM's prompt_logprobs, checked "
                          "on a counting sequence), top-n log-probs of generated tokens (the "
                          "largest n it honours; REPLUG's ensemble is then approximate), and "
                          "whether it reports a prompt cache.")
    chk.add_argument("--api-base", required=True, help="server URL, e.g. http://127.0.0.1:8081")
    chk.add_argument("--api-model", default=None, help="model name sent to the API")
    chk.add_argument("--api-endpoint", choices=("completions", "chat"), default="completions",
                     help="which endpoint to probe (chat: /v1/chat/completions)")
    chk.add_argument("--api-timeout", type=float, default=30.0, help="timeout per request (s)")
    chk.add_argument("--api-retries", type=int, default=2,
                     help="retries of 429/5xx answers and failed connections")
    chk.add_argument("--top-n", type=int, default=20,
                     help="the largest n of top log-probs to try (OpenAI allows 20)")
    _add_json(chk)
    chk.set_defaults(func=_cmd_api_check)

    tr = sub.add_parser("train-lsr", help="REPLUG LSR: train the retriever from LM likelihoods",
                        description="Train the retriever so that its distribution over the "
                        "top-k documents matches the frozen LM's (paper §4). Resumes "
                        "automatically from the latest checkpoint in --workdir.")
    tr.add_argument("--config", required=True,
                    help="config file and variant, e.g. experiments/configs/lsr_nq.py:tiny")
    tr.add_argument("--workdir", required=True, type=pathlib.Path,
                    help="run directory: checkpoints, index versions, metrics, LM-score cache")
    tr.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="override config fields, e.g. --set k=10 gamma=0.5 (repeatable)")
    tr.add_argument("--max-steps", type=int, default=None,
                    help="stop after this many steps of this invocation (resume later)")
    _add_json(tr)
    tr.set_defaults(func=_cmd_train_lsr)

    ex = sub.add_parser("export-retriever", help="write a trained retriever in HF layout",
                        description="Export the latest checkpoint of an LSR run (or the "
                        "one of --step) as a transformers-loadable BERT folder with a model "
                        "card.")
    ex.add_argument("--workdir", required=True, type=pathlib.Path, help="the LSR run directory")
    ex.add_argument("--step", type=int, default=None,
                    help="export the checkpoint saved at this step (default: the newest; "
                         "keep_checkpoints decides which are kept)")
    ex.add_argument("--out", required=True, type=pathlib.Path,
                    help="output folder, e.g. checkpoints/minilm-lsr-nq")
    _add_json(ex)
    ex.set_defaults(func=_cmd_export_retriever)
    return parser


def check_args(args) -> None:
    """Reject bad arguments before any model loads: one clear line per problem."""
    def positive(name: str, flag: str, strict: bool = True) -> None:
        value = getattr(args, name, None)
        if value is not None and (value <= 0 if strict else value < 0):
            raise ValueError(f"{flag} must be {'positive' if strict else '>= 0'}, got {value}")

    positive("k", "-k")
    positive("temperature", "--temperature")
    positive("batch", "--batch")
    positive("batch_size", "--batch-size")
    positive("max_length", "--max-length")
    positive("max_context", "--max-context")
    positive("chunk_size", "--chunk-size")
    positive("nprobe", "--nprobe")
    positive("rerank", "--rerank", strict=False)
    positive("recall_k", "--recall-k")
    positive("sample", "--sample")
    target = getattr(args, "target_recall", None)
    if target is not None and not 0 < target <= 1:
        raise ValueError(f"--target-recall must be in (0, 1], got {target}")
    positive("top_n", "--top-n")
    positive("api_retries", "--api-retries", strict=False)
    positive("shards", "--shards")
    positive("embed_shard_rows", "--embed-shard-rows")
    positive("train_size", "--train-size")
    positive("rerank", "--rerank", strict=False)
    positive("max_steps", "--max-steps")
    positive("max_new_tokens", "--max-new-tokens", strict=False)
    positive("temperature_sample", "--temperature-sample", strict=False)
    positive("overlap", "--overlap", strict=False)
    if getattr(args, "top_p", None) is not None and not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if getattr(args, "chunk_size", None) and args.overlap >= args.chunk_size:
        raise ValueError(f"--overlap ({args.overlap}) must be smaller than --chunk-size "
                         f"({args.chunk_size})")
    if getattr(args, "port", None) is not None and not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    files = {"input": "--input", "embeddings": "--embeddings"}
    if getattr(args, "corpus", "demo") != "demo":
        files["corpus"] = "--corpus"
    for name, flag in files.items():
        path = getattr(args, name, None)
        if path is not None and not pathlib.Path(path).is_file():
            raise FileNotFoundError(f"{flag} {path}: no such file")
    index = getattr(args, "index", None)
    if index is not None and not pathlib.Path(index).is_dir():
        raise FileNotFoundError(f"{index}: no such index directory")
    config = getattr(args, "config", None)
    if config is not None and not pathlib.Path(config.split(":")[0]).is_file():
        raise FileNotFoundError(f"--config {config.split(':')[0]}: no such file")
    workdir = getattr(args, "workdir", None)
    if args.command == "export-retriever" and not pathlib.Path(workdir).is_dir():
        raise FileNotFoundError(f"--workdir {workdir}: no such run directory")
    if args.command == "serve":
        from replug_jax.extras import require

        require("fastapi", "serve", "replug serve")
        require("uvicorn", "serve", "replug serve")
        _serve_settings(args)


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"replug: {category.__name__.replace('UserWarning', 'note')}: {message}\n"


def main(argv: list[str] | None = None) -> int:
    import warnings

    from replug_jax.extras import MissingExtraError
    from replug_jax.lm.scorer import CapabilityError

    warnings.formatwarning = _one_line_warning  # warnings stay visible, without source lines
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        _setup_jax()
        return args.func(args)
    except (ValueError, FileNotFoundError, MissingExtraError, CapabilityError) as err:
        print(f"replug: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:  # the API client's errors, without importing httpx here
        from replug_jax.lm.api_scorer import APIError

        if not isinstance(err, APIError):
            raise
        print(f"replug: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
