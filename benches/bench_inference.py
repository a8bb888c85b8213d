"""REPLUG inference speed (default: the packaged SmolLM2), as ratios measured in one run.

* scoring: the batched ``[B·K, L]`` ensemble vs the same K branches scored one call at a time
  (the official REPLUG loop), at K ∈ {1, 5, 10, 20}; and our batched forward vs PyTorch's;
* coordinated decoding: K=10 branches decoded as one batch vs one after another; KV-cache
  decoding vs recomputing the full forward each step (32 new tokens); batch-1 tokens/s vs
  PyTorch ``generate`` with its cache.

Usage: ``python -m benches.bench_inference [--quick] [--lm SOURCE] [--dtype bfloat16]
[--parts scoring,forward,decode]``. On a GPU the PyTorch reference runs on the GPU too.
"""

from __future__ import annotations

import argparse

import numpy as np

from benches.common import (best_times, matmul_peak_flops, torch_causal_lm, torch_device,
                            torch_synced, write)
from replug_jax.lm.flax_scorer import FlaxLM


PARTS = ("scoring", "forward", "decode")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer settings (smoke run)")
    ap.add_argument("--lm", default="smollm2",
                    help="LM source: packaged name, HF folder, .gguf or hub id (default smollm2)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="parameter and activation dtype, ours and PyTorch's (default float32)")
    ap.add_argument("--parts", default=",".join(PARTS),
                    help="comma-separated subset of: " + ", ".join(PARTS))
    ap.add_argument("--name", default="inference", help="results file stem (default inference)")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        ap.error(f"--parts: unknown {sorted(parts - set(PARTS))}; choose from {PARTS}")
    import jax.numpy as jnp

    peak = matmul_peak_flops(dtype=getattr(jnp, args.dtype))
    lm = FlaxLM.load(args.lm, dtype=args.dtype, max_context=512, batch_size=10)
    one = FlaxLM(lm.lm, max_context=512, batch_size=1)
    device = torch_device()
    ref = torch_causal_lm(args.lm, args.dtype, device)
    rng = np.random.default_rng(0)
    vocab = min(lm.lm.config.vocab_size, 40000)
    doc_len, ctx_len, cont_len = 96, 24, 8  # each branch: ~128 tokens
    rows, out = [], {"lm": args.lm, "dtype": args.dtype, "torch_device": device,
                     "matmul_peak_flops": peak}
    ks = (1, 5) if args.quick else (1, 5, 10, 20)
    for k in ks if "scoring" in parts else ():
        prefixes = [list(rng.integers(100, vocab, doc_len + ctx_len)) for _ in range(k)]
        conts = [list(rng.integers(100, vocab, cont_len))] * k
        lm.score_token_ids(prefixes, conts)
        one.score_token_ids(prefixes[:1], conts[:1])
        t = best_times({"batch": lambda: lm.score_token_ids(prefixes, conts),
                        "seq": lambda: [one.score_token_ids([p], [c])
                                        for p, c in zip(prefixes, conts)]}, repeats=3)
        t_batch, t_seq = t["batch"], t["seq"]
        out[f"score_K{k}"] = {"batched_s": t_batch, "sequential_s": t_seq,
                              "speedup": t_seq / t_batch}
        rows.append((f"ensemble scoring K={k} (batched vs one call per document)",
                     f"{t_batch:.3f}s", f"{t_seq:.3f}s", f"{t_seq / t_batch:.2f}x"))
    if "forward" in parts:
        forward(lm, ref, device, rng, vocab, peak, out, rows)
    if "decode" in parts:
        decode(lm, ref, device, out, rows)
    write(args.name, out, rows, ("what", "ours", "reference", "ratio"))


def forward(lm, ref, device, rng, vocab, peak, out, rows):
    """Batched forward, ours vs PyTorch: 10 sequences of 256 tokens."""
    import torch

    b, L = 10, 256
    ids = rng.integers(100, vocab, (b, L)).astype(np.int32)
    pos = np.broadcast_to(np.arange(L), (b, L)).astype(np.int32)
    fwd = lambda: lm._score_fn(lm.state, ids, pos, ids).block_until_ready()  # noqa: E731
    with torch.no_grad():
        ti = torch.tensor(ids, dtype=torch.long, device=device)
        t = best_times({"ours": fwd, "torch": torch_synced(lambda: ref(ti), device)}, repeats=3)
    ours, theirs = t["ours"], t["torch"]
    flops = lm.lm.config.flops_per_token(L) * b * L
    out["forward_L256_B10"] = {"ours_tokens_per_s": b * L / ours,
                               "torch_tokens_per_s": b * L / theirs, "ratio": theirs / ours,
                               "fraction_of_peak": flops / ours / peak}
    rows.append(("forward 10x256 tokens/s (ours vs PyTorch)", f"{b * L / ours:.0f}",
                 f"{b * L / theirs:.0f}", f"{theirs / ours:.2f}x, {flops / ours / peak:.0%} "
                 "of matmul peak"))


def decode(lm, ref, device, out, rows):
    """Coordinated K=10 decoding, KV cache vs recomputation, batch-1 generation vs PyTorch."""
    import torch

    # Coordinated decoding: K=10 together vs one after another.
    new = 32
    prompts = ["Retrieved document number %d about rivers and mountains. " % i * 6
               + "\n\nQuestion: what is the longest river?\nAnswer:" for i in range(10)]
    log_w = np.full((1, 10), -np.log(10), np.float32)
    lm.generate_ensemble([prompts], log_w, max_new_tokens=new)
    lm.generate_ensemble([prompts[:1]], np.zeros((1, 1)), max_new_tokens=new)
    t = best_times({"k10": lambda: lm.generate_ensemble([prompts], log_w, max_new_tokens=new),
                    "seq": lambda: [lm.generate_ensemble([[p]], np.zeros((1, 1)),
                                                         max_new_tokens=new) for p in prompts]},
                   repeats=2, warmup=0)
    t_k10, t_seq = t["k10"], t["seq"]
    out["decode_K10"] = {"batched_s": t_k10, "sequential_s": t_seq, "speedup": t_seq / t_k10}
    rows.append(("coordinated decoding K=10, 32 tokens (batch vs sequential)",
                 f"{t_k10:.3f}s", f"{t_seq:.3f}s", f"{t_seq / t_k10:.2f}x"))

    # KV cache vs recomputation, batch 1, 32 new tokens (greedy; an early EOS would shorten
    # our run, so rates are per generated token).
    prompt_ids = lm.bos + lm.encode(prompts[0])
    made = len(lm.generate_ensemble([prompts[:1]], np.zeros((1, 1)),
                                    max_new_tokens=new).token_ids[0])

    def recompute():
        seq = list(prompt_ids)
        for _ in range(new):
            lp = lm.next_token_logprobs_ids([seq])
            seq.append(int(np.argmax(lp[0])))

    recompute()
    ti = torch.tensor([prompt_ids], dtype=torch.long, device=device)

    @torch.no_grad()
    def torch_generate():
        ref.generate(ti, max_new_tokens=new, min_new_tokens=new, do_sample=False)

    torch_generate()
    t = best_times({"cache": lambda: lm.generate_ensemble([prompts[:1]], np.zeros((1, 1)),
                                                          max_new_tokens=new),
                    "recompute": recompute, "torch": torch_synced(torch_generate, device)},
                   repeats=2, warmup=0)
    t_cache = t["cache"] * new / max(made, 1)  # seconds for `new` tokens at the measured rate
    t_re, t_torch = t["recompute"], t["torch"]
    out["kv_cache"] = {"cache_s": t_cache, "recompute_s": t_re, "speedup": t_re / t_cache,
                       "ours_tokens_per_s": new / t_cache, "tokens_generated": made}
    rows.append(("KV cache vs recomputation, 32 tokens", f"{t_cache:.3f}s", f"{t_re:.3f}s",
                 f"{t_re / t_cache:.2f}x"))
    out["batch1_generate"] = {"ours_tokens_per_s": new / t_cache,
                              "torch_tokens_per_s": new / t_torch, "ratio": t_torch / t_cache}
    rows.append(("batch-1 generation tokens/s (ours vs PyTorch generate)",
                 f"{new / t_cache:.1f}", f"{new / t_torch:.1f}", f"{t_torch / t_cache:.2f}x"))


if __name__ == "__main__":
    main()
