"""LM scoring throughput on REPLUG-shaped workloads, as ratios measured in one run.

Two workloads of (passage, input, continuation) triples, scored as REPLUG's branches
``d ∘ x`` (``FlaxLM.score_continuations``, the entry of the pool builder, ``Replug.score`` and
the evaluators):

* ``squad``: SQuAD questions of a few articles, each with its top-``k`` paragraphs of those
  articles by the retriever (the shape of an LSR pool or a QA evaluation: a paragraph recurs
  across many questions of its article); continuation = the first gold answer;
* ``nq``: NQ questions with their top-``k`` of the NQ gold passages and 4 demonstrations, in the
  paper's layout ``d ∘ demonstrations ∘ question`` and in the demonstrations-first one
  (``demonstrations ∘ d ∘ question``, whose demonstrations every branch shares).

Contenders, timed in alternation: the previous release's path (``FlaxLM`` before document KV
reuse: batches of 8 rows, buckets 32/64/128/192/256/384/512, no reuse), the current default
(token-budget batches, a fine bucket grid, document KV reuse), the current batching without
reuse, and PyTorch ``transformers`` scoring the same token ids in length-sorted, right-padded
batches of 8. Reported: pairs/s, the first call's seconds (a fresh process compiling every
shape: what one scoring call of a new workload costs), ratios, the largest log-prob
difference to the previous path (and to PyTorch), padding, the share of tokens reuse saved,
and the fraction of the measured matmul peak (FLOPs of the tokens each contender really
processes / time / peak).

Usage: ``python -m benches.bench_scoring [--quick] [--workloads squad nq] [--data DIR]
[--dtype bfloat16]``; reads the SQuAD and NQ files of ``../shared/data`` (or ``--data``;
``$REPLUG_SHARED_DATA``). Where they are absent (an accelerator machine), ``--synthetic``
builds the same shape from random tokens: passages of 100–200 tokens each retrieved by
several of the questions (labelled synthetic).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

import numpy as np

from benches.common import best_times, matmul_peak_flops, write

PREVIOUS_BUCKETS = (32, 64, 128, 192, 256, 384, 512, 768, 1024)
MAX_CONTEXT = 1024  # 4-shot NQ prompts with a passage reach ~650 tokens


def squad_pairs(data: pathlib.Path, retriever, articles: int, questions: int, k: int):
    """``(prompts, continuations)``: ``questions`` questions from each of the first
    ``articles`` SQuAD dev articles, each with its top-``k`` paragraphs of those articles."""
    from replug_jax.prompts import qa_prompt

    squad = json.loads((data / "squad_v1.1" / "dev-v1.1.half_a.json").read_text())["data"]
    paras, qs = [], []
    for art in squad[:articles]:
        paras += [f"{art['title']}: {p['context']}" for p in art["paragraphs"]]
        per = [(qa["question"], qa["answers"][0]["text"]) for p in art["paragraphs"]
               for qa in p["qas"]]
        qs += per[:: max(1, len(per) // questions)][:questions]
    p_emb = retriever.encode_passages(paras)
    q_emb = retriever.encode_queries([q for q, _ in qs])
    top = np.argsort(-(q_emb @ p_emb.T), axis=1)[:, :k]
    prompts, conts = [], []
    for (q, a), row in zip(qs, top):
        for j in row:
            prompts.append(paras[j] + "\n\n" + qa_prompt(q, chat=False))
            conts.append(" " + a)
    return prompts, conts


def nq_pairs(data: pathlib.Path, retriever, lm, questions: int, k: int, shots: int = 4):
    """NQ questions with their top-``k`` gold passages of the first 200 rows and ``shots``
    demonstrations, in both layouts: ``{layout: (prompts, continuations)}``; each passage cut
    from its end to fit ``lm``'s context, as REPLUG's branches are."""
    from replug_jax.prompts import demonstrations_text, document_prompt, qa_prompt

    rows = [json.loads(line) for line in
            (data / "nq_gold_passages" / "nq_openbook.jsonl").read_text().splitlines()[:200]]
    passages = [r["query"].split("\n\nQuestion:")[0].removeprefix("Context: ") for r in rows]
    qs = [(r["query"].split("\n\nQuestion: ")[1].split("\nAnswer:")[0], r["answer"])
          for r in rows]
    demos = qs[-shots:]
    qs = qs[:questions]
    top = np.argsort(-(retriever.encode_queries([q for q, _ in qs])
                       @ retriever.encode_passages(passages).T), axis=1)[:, :k]
    shots_text = demonstrations_text(demos)
    out = {"document_first": ([], []), "demonstrations_first": ([], [])}
    for (q, a), row in zip(qs, top):
        for j in row:
            reserve = lm.count_tokens(" " + a)
            out["document_first"][0].append(document_prompt(
                lm, passages[j], qa_prompt(q, demonstrations=demos, chat=False),
                reserve=reserve)[0])
            out["demonstrations_first"][0].append(document_prompt(
                lm, passages[j], qa_prompt(q, chat=False), reserve=reserve,
                prefix=shots_text)[0])
            for layout in out:
                out[layout][1].append(" " + a)
    return out


def synthetic_pairs(lm, questions: int, k: int, passages: int = 16, seed: int = 0):
    """SQuAD's shape without its text: ``questions`` random questions, each with ``k`` of
    ``passages`` random-token passages (so a passage recurs in about questions·k/passages
    branches), as token-id text decoded by the LM's tokenizer."""
    rng = np.random.default_rng(seed)
    vocab = min(lm.lm.config.vocab_size, 40000)
    words = lambda n: lm.tokenizer.decode(rng.integers(100, vocab, n).tolist())  # noqa: E731
    docs = [words(int(rng.integers(100, 200))) for _ in range(passages)]
    prompts, conts = [], []
    for _ in range(questions):
        q, a = words(int(rng.integers(8, 20))), words(int(rng.integers(2, 6)))
        for j in rng.choice(passages, size=k, replace=False):
            prompts.append(docs[j] + "\n\nQuestion: " + q + "\nAnswer:")
            conts.append(" " + a)
    return prompts, conts


def torch_scorer(source: str, lm, dtype: str):
    """Scores token-id pairs with PyTorch ``transformers`` on the same weights."""
    import torch

    from benches.common import torch_causal_lm, torch_device

    device = torch_device()
    model = torch_causal_lm(source, dtype, device)

    def score(prefixes, conts, rows=8):
        seqs = [list(p) + list(c) for p, c in zip(prefixes, conts)]
        order = np.argsort([len(s) for s in seqs], kind="stable")
        out = [None] * len(seqs)
        with torch.inference_mode():
            for lo in range(0, len(order), rows):
                idx = order[lo:lo + rows]
                length = max(len(seqs[i]) for i in idx)
                ids = torch.full((len(idx), length), lm.pad_id, dtype=torch.long)
                mask = torch.zeros((len(idx), length), dtype=torch.long)
                for j, i in enumerate(idx):
                    ids[j, :len(seqs[i])] = torch.tensor(seqs[i])
                    mask[j, :len(seqs[i])] = 1
                logp = torch.log_softmax(model(input_ids=ids.to(device),
                                               attention_mask=mask.to(device)).logits.float(),
                                         -1).cpu()
                for j, i in enumerate(idx):
                    p, c = len(prefixes[i]), len(conts[i])
                    tgt = torch.tensor(seqs[i][p:p + c])
                    out[i] = logp[j, p - 1:p - 1 + c].gather(-1, tgt[:, None])[:, 0].numpy()
        return out

    return score


def _reset(lm) -> None:
    """No counts and no prefix kept from an earlier call: each call starts alike."""
    lm.stats = type(lm.stats)()
    if lm.prefix_cache is not None:
        lm.prefix_cache.clear()


def measure(name, prompts, conts, contenders, torch_score, cfg, peak, repeats, rows, out):
    first = next(iter(contenders.values()))
    pairs = [first.split_continuation(p, c) for p, c in zip(prompts, conts)]
    prefixes, cont_ids = [a for a, _ in pairs], [b for _, b in pairs]
    results, stats, cold = {}, {}, {}
    for label, lm in contenders.items():  # the warm-up call compiles every shape: timed too
        _reset(lm)
        t0 = time.perf_counter()
        results[label] = lm.score_token_ids(prefixes, cont_ids)
        cold[label] = time.perf_counter() - t0

    def fresh(label, lm):  # each timed call starts with no prefix kept from the previous one
        def run():
            _reset(lm)
            lm.score_token_ids(prefixes, cont_ids)
            stats[label] = lm.stats.summary()
        return run

    fns = {label: fresh(label, lm) for label, lm in contenders.items()}
    if torch_score is not None:  # nothing to compile: its timed call gives its results

        def torch_run():
            results["pytorch"] = torch_score(prefixes, cont_ids)
        fns["pytorch"] = torch_run
    times = best_times(fns, repeats=repeats, warmup=0)
    ref = np.concatenate(results["previous"])
    mean_len = float(np.mean([len(a) + len(b) for a, b in pairs]))
    flops_tok = cfg.flops_per_token(int(mean_len))
    row = {"pairs": len(pairs), "mean_tokens_per_pair": round(mean_len, 1)}
    for label, t in times.items():
        processed = stats[label]["real_tokens"] if label in stats else sum(
            len(a) + len(b) for a, b in pairs)
        row[label] = {"seconds": t, "pairs_per_s": len(pairs) / t,
                      # the first call on a fresh process: every shape compiled (JAX)
                      "first_call_seconds": cold.get(label, t),
                      "max_abs_logprob_diff_vs_previous": float(
                          np.max(np.abs(np.concatenate(results[label]) - ref))),
                      "peak_fraction": processed * flops_tok / t / peak,
                      **stats.get(label, {})}
    base = times["previous"]
    for label, t in times.items():
        row[label]["speedup_vs_previous"] = base / t
        if "pytorch" in times:
            row[label]["speedup_vs_pytorch"] = times["pytorch"] / t
    out[name] = row
    for label, r in row.items():
        if not isinstance(r, dict):
            continue
        rows.append((name, label, f"{r['pairs_per_s']:.2f}", f"{r['first_call_seconds']:.0f}",
                     f"{r['speedup_vs_previous']:.2f}x",
                     f"{r.get('speedup_vs_pytorch', float('nan')):.2f}x",
                     f"{r.get('padding_fraction', float('nan')):.3f}",
                     f"{r.get('reuse_saving', 0.0):.3f}", f"{100 * r['peak_fraction']:.0f} %",
                     f"{r['max_abs_logprob_diff_vs_previous']:.1e}"))


def workload_parser(doc: str) -> argparse.ArgumentParser:
    """The options every scoring benchmark shares: size, data folder, synthetic data, LM, k."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller workloads (smoke run)")
    ap.add_argument("--data", default=os.environ.get("REPLUG_SHARED_DATA", str(
        pathlib.Path(__file__).resolve().parents[2] / "shared" / "data")),
                    help="folder with squad_v1.1/ and nq_gold_passages/ (default ../shared/data)")
    ap.add_argument("--synthetic", action="store_true",
                    help="random-token passages in SQuAD's reuse shape instead of the data "
                         "files (for machines without ../shared/data)")
    ap.add_argument("--lm", default="smollm2", help="LM source (default the packaged SmolLM2)")
    ap.add_argument("--k", type=int, default=8, help="passages per question (default 8)")
    return ap


def main(argv=None):
    ap = workload_parser(__doc__)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="LM parameter dtype (default float32)")
    ap.add_argument("--repeats", type=int, default=1, help="timed rounds (default 1)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    ap.add_argument("--name", default="scoring", help="results file stem (default scoring)")
    ap.add_argument("--questions-per-article", type=int, default=48,
                    help="SQuAD questions from each of 2 articles (default 48; the LSR QA "
                         "study's test pools hold about 80 per article)")
    ap.add_argument("--nq-questions", type=int, default=24,
                    help="NQ questions, each with its top-4 passages, per layout (default 24)")
    ap.add_argument("--workloads", nargs="+", default=["squad", "nq"], choices=("squad", "nq"),
                    help="which workloads to run (default both; each writes its rows as it "
                         "ends)")
    args = ap.parse_args(argv)
    data = pathlib.Path(args.data)
    if not args.synthetic and (not (data / "squad_v1.1").is_dir()
                               or not (data / "nq_gold_passages").is_dir()):
        ap.error(f"--data {data}: needs squad_v1.1/ and nq_gold_passages/ (see "
                 "../shared/data/DATA_SOURCES.md)")
    import jax.numpy as jnp

    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.retrieval.encoder import Retriever

    peak = matmul_peak_flops(dtype=getattr(jnp, args.dtype))
    current = FlaxLM.load(args.lm, dtype=args.dtype, max_context=MAX_CONTEXT)
    previous = FlaxLM(current.lm, max_context=MAX_CONTEXT, batch_size=8, tokens_per_batch=1 << 30,
                      kv_reuse=False)
    previous.buckets = PREVIOUS_BUCKETS
    no_reuse = FlaxLM(current.lm, max_context=MAX_CONTEXT, kv_reuse=False)
    contenders = {"previous": previous, "current": current, "current_no_reuse": no_reuse}
    from importlib.util import find_spec

    with_torch = not args.no_torch and find_spec("torch") is not None  # else: no column
    torch_score = torch_scorer(args.lm, current, args.dtype) if with_torch else None
    rows, out = [], {"lm": args.lm, "dtype": args.dtype, "k": args.k, "matmul_peak_flops": peak,
                     "synthetic": args.synthetic}
    n_q = 6 if args.quick else args.questions_per_article
    header = ("workload", "path", "pairs/s", "first call s (compiling)", "vs previous",
              "vs PyTorch", "padding",
              "tokens saved by reuse", "of matmul peak", "max |Δ log p| vs previous")
    if args.synthetic:
        workloads = {"synthetic_squad_shape": synthetic_pairs(current, 2 * n_q, args.k)}
    else:
        retriever = Retriever.load("minilm", max_length=256)
        workloads = {}
        if "squad" in args.workloads:
            workloads["squad"] = squad_pairs(data, retriever, 2, n_q, args.k)
        if "nq" in args.workloads:
            n_nq = 3 if args.quick else args.nq_questions
            workloads.update({f"nq_4shot_{layout}": pairs for layout, pairs in
                              nq_pairs(data, retriever, current, n_nq, 4).items()})
    for name, (prompts, conts) in workloads.items():  # written after each: a kill keeps some
        measure(name, prompts, conts, contenders, torch_score, current.lm.config, peak,
                args.repeats, rows, out)
        write(args.name, out, rows, header)


if __name__ == "__main__":
    main()
