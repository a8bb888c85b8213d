"""REPLUG LSR training-step speed: our jitted step against the same step in PyTorch (eager),
measured in one run on the same machine, plus the fraction of the matmul peak.

The step: encode B queries and their B·K documents with the retriever (default: the packaged
MiniLM), cosine
scores, the LSR loss KL(P_R ‖ Q) against fixed LM scores (γ = β = 0.1), backward, Adam update.
The PyTorch step is ``transformers.BertModel`` + mean pooling + the same loss in ``torch``, on
the GPU when JAX runs on one.

Before anything runs, the step is compiled and its memory (XLA's buffer assignment: arguments,
outputs and temporaries) compared with the memory the device has free: a shape that does not
fit is run with gradient checkpointing, then with the largest batch that fits (named in the
output), or refused in one line; ``--no-fit`` runs the asked shape as it is.

The retrieval stage of an LSR step with ``index_backend=jax`` is timed too: the B query
embeddings' exact top-k over a synthetic corpus of ``--corpus-size`` × D vectors in the
backend's storage dtype, reported as a fraction of retrieval + step.

With ``--loop-data DIR`` (train/dev/corpus JSONL as written by ``experiments/prepare/nq.py``)
it also runs the training loop for three epochs over the first ``--loop-examples`` questions
with the background index refresh, and reports the fraction of step time spent waiting on the
refresh and the LM-score cache hit rate per epoch.
Usage: ``python -m benches.bench_lsr [--quick] [--batch 64 --k 20] [--retriever SOURCE]
[--loop-data DIR]``.
"""

from __future__ import annotations

import argparse
import functools
import types

import numpy as np

from benches.common import (
    available_memory,
    best_time,
    best_times,
    matmul_peak_flops,
    torch_device,
    torch_synced,
    write,
)
from replug_jax.train.config import LSRConfig
from replug_jax.models.params import split_params
from replug_jax.train.lsr import init_state, make_train_step


def bert_train_flops(cfg, tokens: int) -> float:
    """≈ 6 × parameters-in-matmuls × tokens + attention, forward and backward."""
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    per_token = layers * (4 * h * h + 2 * h * inter)
    return 6.0 * per_token * tokens


def synthetic_batch(b: int, k: int, lq: int, ld: int, vocab: int, seed: int = 0) -> dict:
    """A full LSR batch of random token ids (no padding) and LM scores, fixed by ``seed``."""
    rng = np.random.default_rng(seed)
    return {"query_ids": rng.integers(1000, vocab, (b, lq)).astype(np.int32),
            "query_mask": np.ones((b, lq), np.int32),
            "doc_ids": rng.integers(1000, vocab, (b, k, ld)).astype(np.int32),
            "doc_mask": np.ones((b, k, ld), np.int32),
            "doc_valid": np.ones((b, k), bool),
            "lm_scores": rng.normal(-2.0, 0.5, (b, k)).astype(np.float32)}


@functools.lru_cache(maxsize=4)
def load_retriever(source: str):
    """The retriever, loaded once per source (the memory fit builds several step shapes)."""
    from replug_jax.retrieval.encoder import Retriever

    return Retriever.load(source)


def lsr_setup(b: int = 8, k: int = 4, lq: int = 32, ld: int = 128, retriever: str = "minilm",
              remat: bool = False) -> types.SimpleNamespace:
    """Our LSR step on a synthetic batch: ``retriever, cfg, tx, step, scores_fn``, ``grad``
    (the loss gradient, jitted, compiled on first use), ``params`` and ``batch``."""
    import jax

    from replug_jax.core.losses import lsr_loss

    model = load_retriever(retriever)
    cfg = LSRConfig.from_tree({"retriever.name": retriever, "k": k, "batch_size": b,
                               "total_steps": 1000, "remat": remat})
    graphdef, template, params = split_params(model.model.encoder)
    tx = cfg.optim.build(cfg.total_steps)
    step, scores_fn = make_train_step(graphdef, template, cfg.objective, tx,
                                      model.model.pooling, model.normalize,
                                      schedule=cfg.optim.schedule(cfg.total_steps),
                                      remat=cfg.remat)
    o = cfg.objective
    grad = jax.jit(jax.value_and_grad(lambda p, bt: lsr_loss(
        scores_fn(p, bt), bt["lm_scores"], o.gamma, o.beta, bt["doc_valid"])))
    return types.SimpleNamespace(
        retriever=model, cfg=cfg, tx=tx, step=step, scores_fn=scores_fn, grad=grad,
        params=params, batch=synthetic_batch(b, k, lq, ld, model.model.config.vocab_size))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64, help="questions per step (paper: 64)")
    ap.add_argument("--k", type=int, default=20, help="documents per question (paper: 20)")
    ap.add_argument("--query-len", type=int, default=32, help="query tokens")
    ap.add_argument("--doc-len", type=int, default=128, help="document tokens (paper: 128)")
    ap.add_argument("--retriever", default="minilm",
                    help="BERT retriever source: packaged name, HF folder or hub id")
    ap.add_argument("--remat", action="store_true",
                    help="gradient checkpointing in our step and in PyTorch's (batch 64 x k 20 "
                         "x 128 tokens needs ~65 GB of activations without it)")
    ap.add_argument("--quick", action="store_true", help="batch 8, k 4: a smoke run")
    ap.add_argument("--no-fit", dest="fit", action="store_false",
                    help="run the asked shape even if its compiled memory exceeds what is free")
    ap.add_argument("--name", default="lsr_step",
                    help="results file name under benches/results (default lsr_step)")
    ap.add_argument("--corpus-size", type=int, default=1_000_000,
                    help="corpus rows N for the retrieval stage (0: skip it; default 1M)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch reference")
    ap.add_argument("--loop-data", default=None, help="NQ folder for the 3-epoch loop run")
    ap.add_argument("--loop-examples", type=int, default=32, help="questions per epoch")
    args = ap.parse_args(argv)
    if args.quick:
        args.batch, args.k = 8, 4
    peak = matmul_peak_flops()  # first, on an idle runtime, as the other benchmarks do
    b, k, lq, ld = args.batch, args.k, args.query_len, args.doc_len
    # the PyTorch reference runs the same step beside ours: half the memory each
    fit = fit_to_memory(b, k, lq, ld, args.retriever, args.remat,
                        share=1 if args.no_torch else 2) if args.fit else None
    if fit and (fit["batch"], fit["remat"]) != (b, args.remat):
        print(f"bench_lsr: batch {b} x k {k} needs {fit['asked_gib']:.1f} GiB, "
              f"{fit['free_gib']:.1f} GiB free for it: running batch {fit['batch']}"
              f"{' with gradient checkpointing' if fit['remat'] else ''}", flush=True)
        b, args.remat = fit["batch"], fit["remat"]
    setup = lsr_setup(b, k, lq, ld, args.retriever, args.remat)
    retriever, cfg, step, batch = setup.retriever, setup.cfg, setup.step, setup.batch
    state = {"s": init_state(setup.params, setup.tx)}

    def ours():
        state["s"], metrics = step(state["s"], batch)
        metrics["loss"].block_until_ready()

    contenders = {"ours": ours}
    if not args.no_torch:
        device = torch_device()
        contenders["torch"] = torch_synced(torch_step(args.retriever, batch, cfg, device),
                                           device)
    t = best_times(contenders, repeats=5)
    t_ours = t["ours"]
    tokens = b * lq + b * k * ld
    flops = bert_train_flops(retriever.model.config, tokens)
    out = {"batch": b, "k": k, "query_len": lq, "doc_len": ld, "remat": args.remat,
           "ours_step_s": t_ours,
           "ours_steps_per_s": 1 / t_ours, "model_flops_per_step": flops,
           "fraction_of_matmul_peak": flops / t_ours / peak, "matmul_peak_flops": peak}
    if fit:
        out["memory_fit"] = fit
    rows = [("ours (JAX, jitted)", f"{1 / t_ours:.3f}", f"{t_ours:.2f}",
             f"{100 * flops / t_ours / peak:.0f} %")]
    if args.corpus_size:
        t_ret = retrieval_seconds(setup, args.corpus_size, k)
        out.update(retrieval_s=t_ret, corpus_size=args.corpus_size,
                   retrieval_fraction=t_ret / (t_ret + t_ours))
        rows.append((f"retrieval: exact top-{k} of {b} queries over {args.corpus_size:,} "
                     f"rows ({out['retrieval_fraction']:.0%} of retrieval + step)",
                     f"{1 / t_ret:.3f}", f"{t_ret:.3f}", ""))
    if not args.no_torch:
        t_ref = t["torch"]
        out.update(torch_step_s=t_ref, speedup_vs_torch=t_ref / t_ours, torch_device=device)
        rows.append(("PyTorch eager (same step)", f"{1 / t_ref:.3f}", f"{t_ref:.2f}",
                     f"{100 * flops / t_ref / peak:.0f} %"))
        rows.append(("ratio ours / PyTorch (steps/s)", f"{t_ref / t_ours:.2f}x", "", ""))
    if args.loop_data:
        loop = loop_run(args.loop_data, args.loop_examples)
        out["loop"] = loop
        rows.append(("loop: refresh wait / step time (background refresh)",
                     f"{100 * loop['refresh_wait_fraction']:.1f} %", "", ""))
        for e, rate in enumerate(loop["cache_hit_rate_by_epoch"], 1):
            rows.append((f"loop: LM-score cache hit rate, epoch {e}", f"{100 * rate:.0f} %",
                         "", ""))
    write(args.name, out, rows, ("LSR train step", "steps/s", "s/step", "of matmul peak"))


def step_memory(b: int, k: int, lq: int, ld: int, retriever: str, remat: bool) -> int:
    """Bytes the compiled LSR step needs: XLA's arguments + outputs + temporaries."""
    setup = lsr_setup(b, k, lq, ld, retriever, remat)
    state = init_state(setup.params, setup.tx)
    stats = setup.step.lower(state, setup.batch).compile().memory_analysis()
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
               + stats.temp_size_in_bytes - stats.alias_size_in_bytes)


def fit_to_memory(b: int, k: int, lq: int, ld: int, retriever: str, remat: bool,
                  headroom: float = 0.9, share: int = 1) -> dict:
    """The asked shape if its step fits in ``headroom`` of the free memory (divided among
    ``share`` runs of the step held at once); else the same with gradient checkpointing; else
    the largest power-of-two fraction of the batch that fits. Raises ``SystemExit`` (one line)
    when batch 1 does not fit."""
    free = available_memory() / share
    asked = None
    shapes = [(b, remat)] + ([] if remat else [(b, True)])
    for batch, checkpointing in shapes + [(b >> i, True) for i in range(1, b.bit_length())]:
        need = step_memory(batch, k, lq, ld, retriever, checkpointing)
        asked = need if asked is None else asked
        if need <= headroom * free:
            return {"batch": batch, "remat": checkpointing, "bytes": need, "asked_bytes": asked,
                    "asked_gib": asked / 2**30, "free_gib": free / 2**30}
    raise SystemExit(f"bench_lsr: error: the LSR step needs {asked / 2**30:.1f} GiB at batch "
                     f"{b} x k {k} and more than {headroom * free / 2**30:.1f} GiB even at "
                     "batch 1 with gradient checkpointing; use a smaller --k or --doc-len")


def retrieval_seconds(setup, n: int, k: int) -> float:
    """Seconds of the exact top-``k`` of the batch's query embeddings over ``n`` synthetic
    corpus rows (the retriever's dimension, the backend's storage dtype)."""
    import jax
    import jax.numpy as jnp

    from replug_jax.retrieval import exact_topk, storage_dtype

    b, d = setup.batch["query_ids"].shape[0], setup.retriever.dim
    q_BD = np.random.default_rng(1).normal(size=(b, d)).astype(np.float32)
    corpus = jax.random.normal(jax.random.key(0), (n, d), jnp.dtype(storage_dtype()))
    return best_time(lambda: jax.block_until_ready(exact_topk(q_BD, corpus, k)), repeats=3)


def loop_run(folder: str, n: int) -> dict:
    """Three epochs of the real loop (k=4, batch 8, refresh every epoch, in the background)."""
    import json
    import pathlib
    import tempfile

    from replug_jax.fileio import read_jsonl
    from replug_jax.train.assemble import build_trainer

    folder = pathlib.Path(folder)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="bench_lsr_"))
    rows = read_jsonl(folder / "train.jsonl")[:n]
    (tmp / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    batch, k = 8, 4
    steps_per_epoch = max(n // batch, 1)
    cfg = LSRConfig.from_tree({
        "retriever": {"name": "minilm", "query_max_length": 32, "doc_max_length": 192},
        "lm.name": "smollm2", "data": {"task": "qa", "train": str(tmp / "train.jsonl"),
                                       "corpus": str(folder / "corpus.jsonl"), "chunk_size": 0},
        "k": k, "batch_size": batch, "total_steps": 3 * steps_per_epoch,
        "retrieval.refresh_every": steps_per_epoch, "checkpoint_every": 3 * steps_per_epoch,
        "num_devices": 1})
    trainer = build_trainer(cfg, tmp / "work", progress=False)
    trainer.run()
    log = [json.loads(x) for x in (tmp / "work" / "metrics.jsonl").read_text().splitlines()]
    wait = sum(r["refresh_wait_seconds"] for r in log)
    total = sum(r["step_seconds"] for r in log)
    hit = []
    for e in range(3):
        epoch = log[e * steps_per_epoch:(e + 1) * steps_per_epoch]
        new = sum(r["lm_new_pairs"] for r in epoch)
        hit.append(1 - new / (len(epoch) * batch * k))
    return {"examples": n, "batch": batch, "k": k, "steps": len(log),
            "refresh_every": steps_per_epoch, "refresh_wait_seconds": wait,
            "step_seconds_total": total, "refresh_wait_fraction": wait / total,
            "cache_hit_rate_by_epoch": hit}


def torch_step(source: str, batch, cfg, device: str):
    """The same step in PyTorch eager (``transformers.BertModel``, dropout off): a callable."""
    import torch
    from transformers import BertModel

    from replug_jax.models.weights import resolve

    torch.manual_seed(0)
    model = BertModel.from_pretrained(str(resolve(source).path)).to(device).train()
    if cfg.remat:
        model.gradient_checkpointing_enable()
    model.config.hidden_dropout_prob = 0.0
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    opt = torch.optim.Adam(model.parameters(), lr=cfg.optim.learning_rate)
    t = {key: torch.from_numpy(np.asarray(v)).to(device) for key, v in batch.items()}
    b, k, ld = t["doc_ids"].shape

    def encode(ids, mask):
        hidden = model(input_ids=ids.long(), attention_mask=mask.long()).last_hidden_state
        m = mask.unsqueeze(-1).float()
        pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, dim=-1)

    def step():
        q = encode(t["query_ids"], t["query_mask"])
        d = encode(t["doc_ids"].reshape(b * k, ld), t["doc_mask"].reshape(b * k, ld))
        s = torch.einsum("bd,bkd->bk", q, d.reshape(b, k, -1))
        log_p = torch.log_softmax(s / cfg.objective.gamma, -1)
        log_q = torch.log_softmax(t["lm_scores"] / cfg.objective.beta, -1)
        loss = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()

    return step


if __name__ == "__main__":
    main()
