"""Encode throughput of our BERT vs PyTorch BertModel, LM forward of our Llama vs PyTorch.

Both measured in one run on the same machine; reported as ratios and as model FLOPs over
the measured matmul peak. Usage: ``python -m benches.bench_models [--quick]``.
"""

from __future__ import annotations

import argparse

import numpy as np

from benches.common import best_times, matmul_peak_flops, write
from replug_jax.models import functional, load_lm, load_retriever, pool


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer repeats (CI smoke run)")
    args = ap.parse_args(argv)
    repeats = 1 if args.quick else 5
    import torch
    from transformers import AutoModelForCausalLM, BertModel

    torch.set_num_threads(__import__("os").cpu_count())
    peak = matmul_peak_flops()
    rows, out = [], {"matmul_peak_flops": peak}

    # Encoder: batch 64, L=128.
    ret = load_retriever("minilm")
    b, L = 64, 128
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 30000, (b, L)).astype(np.int32)
    mask = np.ones((b, L), np.int32)
    apply, state = functional(ret.encoder)
    from replug_jax.models.weights import packaged_path

    ref = BertModel.from_pretrained(str(packaged_path("minilm"))).eval()
    with torch.no_grad():
        ti, tm = torch.tensor(ids, dtype=torch.long), torch.tensor(mask)
        t = best_times({"ours": lambda: pool(apply(state, ids, mask), mask).block_until_ready(),
                        "torch": lambda: ref(input_ids=ti, attention_mask=tm)}, repeats)
    ours, theirs = t["ours"], t["torch"]
    flops = ret.config.flops_per_token(L) * b * L
    enc = {"ours_passages_per_s": b / ours, "torch_passages_per_s": b / theirs,
           "ratio": theirs / ours, "fraction_of_peak": flops / ours / peak}
    out["bert_encode_L128_B64"] = enc
    rows.append(("MiniLM encode (passages/s)", f"{enc['ours_passages_per_s']:.1f}",
                 f"{enc['torch_passages_per_s']:.1f}", f"{enc['ratio']:.2f}x",
                 f"{enc['fraction_of_peak']:.0%}"))

    # LM forward: 10 sequences of L=256.
    lm = load_lm("smollm2")
    b, L = 10, 256
    ids = rng.integers(100, 40000, (b, L)).astype(np.int32)
    pos = np.broadcast_to(np.arange(L), (b, L)).astype(np.int32)
    apply, state = functional(lm.model)
    gguf = packaged_path("smollm2")
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                               dtype=torch.float32).eval()
    with torch.no_grad():
        ti = torch.tensor(ids, dtype=torch.long)
        t = best_times({"ours": lambda: apply(state, ids, pos)[0].block_until_ready(),
                        "torch": lambda: ref(ti)}, repeats)
    ours, theirs = t["ours"], t["torch"]
    flops = lm.config.flops_per_token(L) * b * L
    fw = {"ours_tokens_per_s": b * L / ours, "torch_tokens_per_s": b * L / theirs,
          "ratio": theirs / ours, "fraction_of_peak": flops / ours / peak}
    out["llama_forward_L256_B10"] = fw
    rows.append(("SmolLM2 forward (tokens/s)", f"{fw['ours_tokens_per_s']:.0f}",
                 f"{fw['torch_tokens_per_s']:.0f}", f"{fw['ratio']:.2f}x",
                 f"{fw['fraction_of_peak']:.0%}"))
    write("models", out, rows, ("what", "ours", "PyTorch", "ours/PyTorch", "of matmul peak"))


if __name__ == "__main__":
    main()
