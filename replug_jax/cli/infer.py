"""``replug score | generate | ask | demo``: REPLUG inference from the command line."""

from __future__ import annotations

import pathlib

from replug_jax.cli.common import (
    add_api_args,
    add_flax_lm_args,
    command,
    emit,
    existing_file,
    format_generation,
    index_dir,
    load_flax_lm,
    mesh_shape,
    non_negative_float,
    non_negative_int,
    positive_float,
    retired,
    positive_int,
    unit_interval,
)
from replug_jax.cli.index import add_search_args, search_options
from replug_jax.models import DEFAULT_LM, DEFAULT_RETRIEVER

MODES = ("replug", "none", "concat", "top1", "random")


def make_lm(args):
    """The black-box LM: a served one (``--api-base``, probed first) or a Flax one, read
    through the score store ``--lm-scores`` when one is given."""
    lm = _black_box(args)
    if getattr(args, "lm_scores", None) is None:
        return lm
    from replug_jax.lm.score_store import ScoreStore, StoredLM, scorer_identity

    return StoredLM(lm, ScoreStore(args.lm_scores, scorer_identity(lm)))


def _black_box(args):
    if args.api_base:
        from replug_jax.lm.api_scorer import APIScorer

        return APIScorer.connect(args.api_base, model=args.api_model,
                                 tokenizer=args.api_tokenizer, timeout=args.api_timeout,
                                 endpoint=args.api_endpoint, max_retries=args.api_retries,
                                 concurrency=args.api_concurrency,
                                 batch_size=args.api_batch_size)
    return load_flax_lm(args)


def make_pipeline(args, lm=None, index=None, retriever=None, retrieve: bool | None = None):
    """The pipeline the arguments describe; ``lm``, ``index``, ``retriever`` replace
    ``--lm``/``--api-base``, ``--index`` and ``--retriever`` (``replug eval``'s second system
    shares the first one's LM)."""
    from replug_jax.replug import Replug
    from replug_jax.retrieval.encoder import Retriever

    mode = getattr(args, "mode", "replug")
    index = index if index is not None else args.index
    retrieving = (mode != "none") if retrieve is None else retrieve
    if retrieving and index is None:  # refused before the LM loads
        raise ValueError(f"mode {mode!r} needs --index (build one with `replug index build`)")
    lm = lm if lm is not None else make_lm(args)
    pipe_retriever = pipe_index = None
    if retrieving:
        pipe_retriever, pipe_index = Retriever.for_index(index, retriever or args.retriever)
    else:  # the LM alone (`eval --modes none`)
        mode = "none"
    return Replug(lm, pipe_retriever, pipe_index, k=args.k,
                  retrieval_temperature=args.retrieval_temperature,
                  separator=args.separator.encode().decode("unicode_escape"), mode=mode,
                  seed=args.seed, **search_options(args))


def cmd_score(args) -> int:
    from tqdm.auto import tqdm

    from replug_jax.fileio import read_jsonl
    from replug_jax.lm.scorer import SCORE, require
    from replug_jax.replug import summarize

    rows = read_jsonl(args.input)
    for i, r in enumerate(rows):
        if "context" not in r or "continuation" not in r:
            raise ValueError(f"{args.input}: line {i + 1} needs 'context' and 'continuation'")
    pipe = make_pipeline(args)
    require(pipe.lm, SCORE, "scoring")  # a server that cannot score says so in one line
    results = []
    for start in tqdm(range(0, len(rows), args.batch), desc="scoring", disable=args.json):
        chunk = rows[start:start + args.batch]
        results += pipe.score([r["context"] for r in chunk], [r["continuation"] for r in chunk],
                              [r.get("query", r["context"]) for r in chunk])
    summary = summarize(results)
    for i, r in enumerate(results):
        emit(args, {k: v for k, v in r.to_json().items()
                    if k in ("loglik", "num_tokens", "num_bytes", "doc_ids", "weights",
                             "retrieval_reliance", "cost")},
             f"{i}: loglik {r.loglik:.3f} over {r.num_tokens} tokens, docs "
             f"{list(zip(r.doc_ids, [round(w, 3) for w in r.weights]))}")
    emit(args, {"summary": summary, "settings": results[0].settings},
         f"perplexity {summary['perplexity']:.3f}, bits per byte {summary['bits_per_byte']:.4f} "
         f"({summary['num_tokens']} tokens, mode {args.mode}, k={args.k})")
    return 0


def cmd_generate(args) -> int:
    pipe = make_pipeline(args)
    r = pipe.generate([args.prompt], args.max_new_tokens,
                      sampling_temperature=args.sampling_temperature, top_p=args.top_p,
                      stop=args.stop, queries=[args.query or args.prompt])[0]
    emit(args, r.to_json(), format_generation(r, "generation"))
    return 0


def cmd_ask(args) -> int:
    from replug_jax.prompts import qa_branch_input

    pipe = make_pipeline(args)
    tokenizer = getattr(pipe.lm, "tokenizer", None)
    context, prefix = qa_branch_input(args.question, tokenizer, args.chat_layout)
    r = pipe.generate([context], args.max_new_tokens, stop=["\n"], queries=[args.question],
                      prefixes=None if prefix is None else [prefix])[0]
    layout = args.chat_layout if getattr(tokenizer, "chat_template", None) else "plain"
    emit(args, {"question": args.question, "answer": r.text.strip(), "chat_layout": layout,
                **r.to_json()}, format_generation(r, "answer"))
    return 0


def cmd_demo(args) -> int:
    from replug_jax.demo import run_demo

    def show(question, closed, rep):
        print(f"\nQ: {question}\nLM alone: {closed.text.strip()!r}\n"
              + format_generation(rep, f"REPLUG (k={args.k})"))

    out = run_demo(args.index_dir, retriever=args.retriever, lm=args.lm, k=args.k,
                   max_new_tokens=args.max_new_tokens, questions=args.question,
                   progress=not args.json, log=(lambda text: None) if args.json else print,
                   on_answer=None if args.json else show)
    rows = sum(r["cost"]["lm_calls"] + r["cost_without_retrieval"]["lm_calls"]
               for r in out["results"])
    emit(args, {k: out[k] for k in ("results", "settings", "index", "seconds")},
         f"\ndone: {len(out['results'])} question(s), k={args.k}, {out['passages']} passages "
         f"indexed in {args.index_dir}, {rows} LM rows, {out['seconds']:.0f} s in all")
    return 0


def add_pipeline_args(p, mode: bool = True) -> None:
    """The options of a REPLUG pipeline (``mode=False``: all but ``--mode``)."""
    p.add_argument("--index", type=index_dir, default=None,
                   help="index directory from `replug index build` (not needed with "
                   "--mode none)")
    p.add_argument("--retriever", default=None,
                   help="query encoder (default: the one recorded in the index manifest)")
    p.add_argument("--lm", default=DEFAULT_LM,
                   help=f"LM: packaged name, HF folder, hub id or .gguf (default: {DEFAULT_LM})")
    p.add_argument("-k", type=positive_int, default=10, help="documents per query (paper: 10)")
    add_search_args(p)
    p.add_argument("--retrieval-temperature", type=positive_float, default=None, metavar="TAU",
                   help="τ of λ = softmax(s/τ) (default: the τ fitted for the retriever, "
                   "recorded in its replug.json, else the paper's 1)")
    retired(p, "--temperature", "--retrieval-temperature")
    p.add_argument("--separator", default="\\n\\n",
                   help="text between a document and the input (default: a blank line)")
    if mode:
        p.add_argument("--mode", choices=MODES, default="replug",
                       help="replug (ensemble, default), none (LM alone), concat (all k "
                       "documents in one prompt), top1, random (k random documents)")
        retired(p, "--baseline", "--mode")
    p.add_argument("--seed", type=int, default=0, help="seed for sampling and random documents")
    add_flax_lm_args(p)
    p.add_argument("--api-base", default=None,
                   help="use an OpenAI-compatible server at this URL instead of --lm (API key "
                   "from $REPLUG_API_KEY or $OPENAI_API_KEY)")
    add_api_args(p, timeout=60.0, retries=4)
    p.add_argument("--api-tokenizer", default=None,
                   help="local tokenizer source for the API's model (for document truncation)")
    p.add_argument("--lm-scores", type=pathlib.Path, default=None, metavar="DIR",
                   help="a store of the LM's continuation scores (replug_jax.lm.score_store): "
                   "pairs found there cost no LM call, new ones are added. The key is the "
                   "branch prompt and continuation, as LSR training and pool builds key "
                   "them: point runs of the same LM at one folder and each pair is scored "
                   "once")


def add_parsers(sub) -> None:
    sc = command(sub, "score", cmd_score,
                 help="REPLUG log-likelihood of continuations (perplexity, BPB)",
                 description="Score each JSONL line {context, continuation, query?} with "
                             "the REPLUG ensemble; the query defaults to the context.")
    sc.add_argument("--input", type=existing_file, required=True, help="JSONL input file")
    sc.add_argument("--batch", type=positive_int, default=8, help="lines per pipeline call")
    add_pipeline_args(sc)

    gen = command(sub, "generate", cmd_generate, help="coordinated REPLUG decoding of a prompt",
                  description="Generate from the mixture over document branches; "
                              "every branch receives the chosen token.")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--query", default=None, help="retrieval query (default: the prompt)")
    gen.add_argument("--max-new-tokens", type=non_negative_int, default=32,
                     help="tokens to generate")
    gen.add_argument("--sampling-temperature", type=non_negative_float, default=0.0,
                     help="sampling temperature (0 = greedy, default)")
    retired(gen, "--temperature-sample", "--sampling-temperature")
    gen.add_argument("--top-p", type=unit_interval, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--stop", action="append", default=[],
                     help="stop string (repeatable)")
    add_pipeline_args(gen)

    ask = command(sub, "ask", cmd_ask, help="answer a question with its sources and their weights",
                  description="Question -> answer with REPLUG, printing the retrieved "
                              "passages and λ.")
    ask.add_argument("question", help="the question")
    ask.add_argument("--max-new-tokens", type=non_negative_int, default=32,
                     help="answer length limit")
    ask.add_argument("--chat-layout", choices=("inside", "before"), default="inside",
                     help="with an LM that has a chat template: each passage inside the user's "
                          "turn, before the question (inside, the default: the paper's d ∘ x "
                          "with x the user's text), or in front of the whole chat prompt "
                          "(before); the exact prompt of every branch is in --json")
    add_pipeline_args(ask)

    demo = command(sub, "demo", cmd_demo,
                   help="REPLUG on the packaged models and Python-docs corpus",
                   description="Build (or reuse) an index of the Python standard "
                               "library's documentation with the packaged MiniLM retriever, then "
                               "answer Python questions with the packaged SmolLM2, with and "
                               "without retrieval, showing the sources, λ and the cost.")
    demo.add_argument("--index-dir", type=pathlib.Path,
                      default=pathlib.Path.home() / ".cache" / "replug_jax" / "demo_index",
                      help="where the demo index is kept")
    demo.add_argument("--retriever", default=DEFAULT_RETRIEVER,
                      help=f"retriever (default: {DEFAULT_RETRIEVER})")
    demo.add_argument("--lm", default=DEFAULT_LM, help=f"LM (default: {DEFAULT_LM})")
    demo.add_argument("-k", type=positive_int, default=5, help="documents per question "
                      "(default 5)")
    demo.add_argument("--max-new-tokens", type=non_negative_int, default=24,
                      help="answer length limit")
    demo.add_argument("--question", action="append", default=None,
                      help="ask this instead of the built-in questions (repeatable)")

    mem = command(sub, "lm-memory", cmd_lm_memory,
                  help="device memory of an LM on a mesh, from its config alone",
                  description="Bytes per device of an LM sharded over a mesh: parameters "
                              "(exact, from the shapes and the sharding rules), the KV cache "
                              "of --batch sequences of --context tokens (exact), the head's "
                              "logits and an activation estimate. Reads only config.json.")
    mem.add_argument("--config", required=True, type=pathlib.Path,
                     help="an HF config.json (or a folder holding one) of a Llama-family, "
                          "GPT-2 or OPT LM")
    mem.add_argument("--mesh", type=mesh_shape, default={"model": 1}, metavar="AXIS=SIZE,...",
                     help="e.g. model=8 or data=2,model=4 (default: one device)")
    mem.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                     help="parameter and activation dtype (default bfloat16)")
    mem.add_argument("--batch", type=positive_int, default=32,
                     help="sequences decoded or prefilled together: queries x k documents "
                          "(default 32)")
    mem.add_argument("--context", type=positive_int, default=2048,
                     help="tokens per sequence, prompt and generation (default 2048)")


def cmd_lm_memory(args) -> int:
    from replug_jax.lm.memory import lm_memory, read_lm_config

    plan = lm_memory(read_lm_config(args.config), args.mesh, args.dtype, batch=args.batch,
                     context=args.context)
    emit(args, plan, "\n".join(f"{k}: {v}" for k, v in plan.items()))
    return 0
