"""A paper-scale REPLUG LSR run, costed end to end: seconds per step and hours for 25k steps on
one 8-GPU host (8 × H100) and a TPU v5e-8, and which part dominates.

The run (paper §4–5): 64 queries per step, the retriever's top 20 passages of each from 21M
(100-word passages, 128 tokens), the frozen LM (Llama-2-7B here) scoring every passage ∘ x ∘ y
(x and y 128 tokens each: 1,280 sequences of 384 tokens), the LSR update of both towers
(BERT-base, Contriever's shape), and the datastore re-embedded every 3,000 steps.

Per step and device, from the programs' flops (:func:`replug_jax.compile_check.program_flops`,
held within 15 % of XLA's own counts where XLA gives them) and the bytes they must move at
least (the weights once per call, the corpus share once per search):

* **device seconds** are roofline bounds, max(flops / peak, bytes / bandwidth) at the chip's
  specification (bf16 dense peak; :data:`replug_jax.compile_check.CHIPS`), with the work split
  evenly over the devices, and an estimate at an assumed model-flops utilisation (``--mfu``,
  default 0.4: what large decoder forwards typically reach; not measured here);
* **host seconds** are measured on this machine, one core: building the 1,280 prompts (each
  passage cut to fit), tokenizing them and their continuations with the packaged SmolLM2
  tokenizer (Llama's BPE family), and the retriever's inputs with MiniLM's WordPiece. The loop
  prefetches the next step's host work on one thread (``bench_lsr_prefetch``), so a step
  takes the larger of the device time and the host time: "hours for 25k steps" is today's
  loop, "device-bound hours" what it becomes once the host work is spread over enough cores;
* **refresh**: the passage tower over 21M × 128 tokens, amortised over its 3,000 steps.

Whether each program fits its chip is ``replug compile-check``'s answer (the same shapes,
``docs/scale.md``). Usage: ``python -m benches.lsr_cost [--mfu 0.4]``.
"""

from __future__ import annotations

import argparse
import pathlib
import time

from benches.common import write

SHAPES = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "configs" / "lm_shapes"
# (name, device_kind in the chip table, devices)
TARGETS = [("8 × H100", "NVIDIA H100 80GB HBM3", 8), ("TPU v5e-8", "TPU v5e", 8)]
PAPER = dict(queries=64, docs=20, doc_len=128, x_len=128, y_len=128, corpus=21_000_000,
             refresh_every=3000, steps=25_000)


def host_seconds(queries: int, docs: int, repeats: int = 3) -> float:
    """One step's host work, best of ``repeats``: prompts, LM and retriever tokenization."""
    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.retrieval.corpus import Passage
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.train.data import Example
    from replug_jax.train.supervision import branch_prompts

    lm, retriever = FlaxLM.load("smollm2", max_context=2048), Retriever.load("minilm")
    words = [f"w{i % 997}" for i in range(4000)]
    text = lambda i, n: " ".join(words[(i * 31 + j) % len(words)] for j in range(n))  # noqa
    examples = [Example(str(q), text(q, 90), text(q + 1, 90), " " + text(q + 2, 90))
                for q in range(queries)]
    passages = [Passage(i, text(i + 7, 100), f"doc {i}") for i in range(queries * docs)]
    pairs = [(examples[i // docs], passages[i]) for i in range(queries * docs)]
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        prompts = branch_prompts([e for e, _ in pairs], [p for _, p in pairs], lm)
        for prompt, (e, _) in zip(prompts, pairs):
            lm.split_continuation(prompt, e.continuation)
        retriever.tokenize_fixed([e.query for e in examples], PAPER["x_len"])
        retriever.tokenize_fixed([p.text for p in passages], PAPER["doc_len"])
        best = min(best, time.perf_counter() - t0)
    return best


def device_seconds(lm_cfg, bert_cfg, chip: tuple, devices: int, lm_calls: int) -> dict:
    """Roofline seconds per step of each part on ``devices`` chips of ``chip``."""
    from replug_jax.compile_check import program_flops
    from replug_jax.compile_targets import Shapes

    _, tflops, gbps = chip
    p = PAPER
    length = p["doc_len"] + p["x_len"] + p["y_len"]
    step = Shapes(lm_batch=p["queries"] * p["docs"], context=length, lsr_batch=p["queries"],
                  lsr_docs=p["docs"], query_len=p["x_len"], doc_len=p["doc_len"],
                  corpus=p["corpus"], topk_queries=p["queries"], k=p["docs"],
                  encode_batch=p["corpus"])
    flops = program_flops(lm_cfg, bert_cfg, step, devices)
    # bf16 weights: 2 bytes each, and a forward pass is 2 flops per weight per token
    lm_weights, bert_weights = lm_cfg.flops_per_token(0), bert_cfg.flops_per_token(0)
    bytes_ = {"lm_score": lm_calls * lm_weights / devices,
              "lsr_step": 3 * bert_weights,  # replicated: read forward, backward, update
              "topk": p["corpus"] * bert_cfg.hidden_size * 2 / devices,
              "refresh_encode": bert_weights * p["corpus"] / 512}  # a read per 512 passages
    roof = {name: max(flops[name] / (tflops * 1e12), bytes_[name] / (gbps * 1e9))
            for name in bytes_}
    roof["refresh_encode"] /= p["refresh_every"]  # once per refresh_every steps
    return {"flops": {n: flops[n] for n in bytes_}, "bytes": bytes_, "roofline": roof}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lm-config", type=pathlib.Path, default=SHAPES / "llama-2-7b.json",
                    help="the LM's HF config.json (default Llama-2-7B)")
    ap.add_argument("--mfu", type=float, default=0.4,
                    help="assumed model-flops utilisation for the estimate (default 0.4)")
    ap.add_argument("--lm-batch", type=int, default=64,
                    help="LM sequences per scoring call (weights read once per call)")
    args = ap.parse_args(argv)
    from replug_jax.compile_check import CHIPS
    from replug_jax.lm.memory import read_lm_config
    from replug_jax.models.bert import BertConfig

    lm_cfg, bert_cfg = read_lm_config(args.lm_config), BertConfig()
    pairs = PAPER["queries"] * PAPER["docs"]
    host = host_seconds(PAPER["queries"], PAPER["docs"])
    out, rows = {"paper": PAPER, "lm": args.lm_config.name, "mfu": args.mfu,
                 "host_seconds_one_thread": host, "targets": {}}, []
    for name, kind, devices in TARGETS:
        d = device_seconds(lm_cfg, bert_cfg, CHIPS[kind], devices, -(-pairs // args.lm_batch))
        device = sum(d["roofline"].values())
        estimate = device / args.mfu
        step = max(estimate, host)
        share = {n: s / device for n, s in d["roofline"].items()}
        top = max(share, key=share.get)
        hours = {"today": step * PAPER["steps"] / 3600,
                 "device_bound": estimate * PAPER["steps"] / 3600,
                 "roofline": device * PAPER["steps"] / 3600}
        out["targets"][name] = {**d, "device_seconds_roofline": device,
                                "device_seconds_at_mfu": estimate, "step_seconds": step,
                                "bound_by": "host" if host > estimate else "device",
                                "hours_25k": hours, "share_of_device": share,
                                "dominant": top}
        rows.append((name, f"{device:.2f}", f"{estimate:.2f}", f"{host:.2f}",
                     f"{hours['today']:.1f} ({out['targets'][name]['bound_by']})",
                     f"{hours['device_bound']:.1f}", f"{hours['roofline']:.1f}",
                     f"{top} {share[top]:.0%}"))
    write("lsr_cost", out, rows, ("target", "device s/step (roofline)",
                                  f"device s/step at MFU {args.mfu:g}",
                                  "host s/step (1 thread, here)", "hours for 25k steps",
                                  "device-bound hours", "hours at the roofline",
                                  "dominant device part"))


if __name__ == "__main__":
    main()
