"""REPLUG inference speed on the packaged SmolLM2, as ratios measured in one run.

* scoring: the batched ``[B·K, L]`` ensemble vs the same K branches scored one call at a time
  (the official REPLUG loop), at K ∈ {1, 5, 10, 20}; and our batched forward vs PyTorch's;
* coordinated decoding: K=10 branches decoded as one batch vs one after another; KV-cache
  decoding vs recomputing the full forward each step (32 new tokens); batch-1 tokens/s vs
  PyTorch ``generate`` with its cache.

Usage: ``python -m benches.bench_inference [--quick]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benches.common import best_time, matmul_peak_flops, write
from replug_jax.lm.flax_scorer import FlaxLM


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer settings (smoke run)")
    args = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from replug_jax.models.weights import packaged_path

    peak = matmul_peak_flops()
    lm = FlaxLM.load("smollm2", max_context=512, batch_size=10)
    one = FlaxLM(lm.lm, max_context=512, batch_size=1)
    rng = np.random.default_rng(0)
    doc_len, ctx_len, cont_len = 96, 24, 8  # each branch: ~128 tokens
    rows, out = [], {"matmul_peak_flops": peak}
    ks = (1, 5) if args.quick else (1, 5, 10, 20)
    for k in ks:
        prefixes = [list(rng.integers(100, 40000, doc_len + ctx_len)) for _ in range(k)]
        conts = [list(rng.integers(100, 40000, cont_len))] * k
        lm.score_token_ids(prefixes, conts)
        one.score_token_ids(prefixes[:1], conts[:1])
        t_batch = best_time(lambda: lm.score_token_ids(prefixes, conts), repeats=2)
        t_seq = best_time(lambda: [one.score_token_ids([p], [c]) for p, c in
                                   zip(prefixes, conts)], repeats=1)
        out[f"score_K{k}"] = {"batched_s": t_batch, "sequential_s": t_seq,
                              "speedup": t_seq / t_batch}
        rows.append((f"ensemble scoring K={k} (batched vs one call per document)",
                     f"{t_batch:.2f}s", f"{t_seq:.2f}s", f"{t_seq / t_batch:.2f}x"))

    # Batched forward vs PyTorch: 10 sequences of 256 tokens.
    b, L = 10, 256
    ids = rng.integers(100, 40000, (b, L)).astype(np.int32)
    pos = np.broadcast_to(np.arange(L), (b, L)).astype(np.int32)
    fwd = lambda: lm._score_fn(lm.state, ids, pos, ids).block_until_ready()  # noqa: E731
    ours = best_time(fwd, repeats=2)
    gguf = packaged_path("smollm2")
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                               dtype=torch.float32).eval()
    with torch.no_grad():
        ti = torch.tensor(ids, dtype=torch.long)
        theirs = best_time(lambda: ref(ti), repeats=2)
    flops = lm.lm.config.flops_per_token(L) * b * L
    out["forward_L256_B10"] = {"ours_tokens_per_s": b * L / ours,
                               "torch_tokens_per_s": b * L / theirs, "ratio": theirs / ours,
                               "fraction_of_peak": flops / ours / peak}
    rows.append(("forward 10x256 tokens/s (ours vs PyTorch)", f"{b * L / ours:.0f}",
                 f"{b * L / theirs:.0f}", f"{theirs / ours:.2f}x, {flops / ours / peak:.0%} "
                 "of matmul peak"))

    # Coordinated decoding: K=10 together vs one after another.
    new = 32
    prompts = ["Retrieved document number %d about rivers and mountains. " % i * 6
               + "\n\nQuestion: what is the longest river?\nAnswer:" for i in range(10)]
    log_w = np.full((1, 10), -np.log(10), np.float32)
    lm.generate_ensemble([prompts], log_w, max_new_tokens=new)
    lm.generate_ensemble([prompts[:1]], np.zeros((1, 1)), max_new_tokens=new)
    t_k10 = best_time(lambda: lm.generate_ensemble([prompts], log_w, max_new_tokens=new),
                      repeats=1, warmup=0)
    t_seq = best_time(lambda: [lm.generate_ensemble([[p]], np.zeros((1, 1)),
                                                    max_new_tokens=new) for p in prompts],
                      repeats=1, warmup=0)
    out["decode_K10"] = {"batched_s": t_k10, "sequential_s": t_seq, "speedup": t_seq / t_k10}
    rows.append(("coordinated decoding K=10, 32 tokens (batch vs sequential)",
                 f"{t_k10:.2f}s", f"{t_seq:.2f}s", f"{t_seq / t_k10:.2f}x"))

    # KV cache vs recomputation, batch 1, 32 new tokens (greedy; an early EOS would shorten
    # our run, so rates are per generated token).
    prompt_ids = lm.bos + lm.encode(prompts[0])
    made = len(lm.generate_ensemble([prompts[:1]], np.zeros((1, 1)),
                                    max_new_tokens=new).token_ids[0])
    t_cache = best_time(lambda: lm.generate_ensemble([prompts[:1]], np.zeros((1, 1)),
                                                     max_new_tokens=new), repeats=2, warmup=0)
    t_cache *= new / max(made, 1)  # seconds for `new` tokens at the measured rate

    def recompute():
        seq = list(prompt_ids)
        for _ in range(new):
            lp = lm.next_token_logprobs_ids([seq])
            seq.append(int(np.argmax(lp[0])))

    recompute()
    t_re = best_time(recompute, repeats=1, warmup=0)
    out["kv_cache"] = {"cache_s": t_cache, "recompute_s": t_re, "speedup": t_re / t_cache,
                       "ours_tokens_per_s": new / t_cache, "tokens_generated": made}
    rows.append(("KV cache vs recomputation, 32 tokens", f"{t_cache:.2f}s", f"{t_re:.2f}s",
                 f"{t_re / t_cache:.2f}x"))
    with torch.no_grad():
        ti = torch.tensor([prompt_ids], dtype=torch.long)
        ref.generate(ti, max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        ref.generate(ti, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        t_torch = time.perf_counter() - t0
    out["batch1_generate"] = {"ours_tokens_per_s": new / t_cache,
                              "torch_tokens_per_s": new / t_torch, "ratio": t_torch / t_cache}
    rows.append(("batch-1 generation tokens/s (ours vs PyTorch generate)",
                 f"{new / t_cache:.1f}", f"{new / t_torch:.1f}", f"{t_torch / t_cache:.2f}x"))
    write("inference", out, rows, ("what", "ours", "reference", "ratio"))


if __name__ == "__main__":
    main()
