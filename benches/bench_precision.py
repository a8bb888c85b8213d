"""bfloat16 against float32 for LM scoring, on the same weights and pairs, in one run.

REPLUG mixes the LM's per-token log-probs and LSR trains on its sequence scores, so what matters
about a lower precision is (1) the per-token and per-sequence error of the log-probs, (2)
whether the K documents are ranked alike by the LM's score (what LSR's Q = softmax(score/β)
sees), and (3) speed. Pairs: SQuAD questions of a few articles with their top-``k``
paragraphs (``--synthetic``: random tokens in that shape, where the data files are absent).
Reported: pairs/s of each dtype and their ratio, mean / max |Δ log p| per token, mean / max
|Δ| of the summed and mean sequence scores, and per question the top-1 agreement and Kendall's
τ of the K documents' ranking by mean log-prob. float32 is the reference.

Usage: ``python -m benches.bench_precision [--quick] [--data DIR] [--synthetic]``.
"""

from __future__ import annotations

import pathlib

import numpy as np

from benches.bench_scoring import squad_pairs, synthetic_pairs, workload_parser
from benches.common import best_times, write


def main(argv=None):
    ap = workload_parser(__doc__)
    ap.add_argument("--name", default="precision", help="results file stem")
    args = ap.parse_args(argv)
    from scipy.stats import kendalltau

    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.retrieval.encoder import Retriever

    lms = {dt: FlaxLM.load(args.lm, dtype=dt, max_context=1024)
           for dt in ("float32", "bfloat16")}
    n_q = 4 if args.quick else 12
    if args.synthetic:
        prompts, conts = synthetic_pairs(lms["float32"], n_q, args.k)
    else:
        data = pathlib.Path(args.data)
        if not (data / "squad_v1.1").is_dir():
            ap.error(f"--data {data}: no squad_v1.1/ (or pass --synthetic)")
        prompts, conts = squad_pairs(data, Retriever.load("minilm", max_length=256), 2,
                                     n_q // 2, args.k)
    pairs = [lms["float32"].split_continuation(p, c) for p, c in zip(prompts, conts)]
    prefixes, cont_ids = [a for a, _ in pairs], [b for _, b in pairs]
    got = {dt: lm.score_token_ids(prefixes, cont_ids) for dt, lm in lms.items()}  # compiles
    times = best_times({dt: (lambda lm=lm: lm.score_token_ids(prefixes, cont_ids))
                        for dt, lm in lms.items()}, repeats=1, warmup=0)
    ref, low = got["float32"], got["bfloat16"]
    tok = np.abs(np.concatenate(low) - np.concatenate(ref))
    seq_sum = np.abs(np.array([a.sum() - b.sum() for a, b in zip(low, ref)]))
    mean_ref = np.array([r.mean() for r in ref]).reshape(-1, args.k)
    mean_low = np.array([r.mean() for r in low]).reshape(-1, args.k)
    taus = [kendalltau(a, b).statistic for a, b in zip(mean_ref, mean_low)]
    top1 = float(np.mean(mean_ref.argmax(1) == mean_low.argmax(1)))
    out = {"lm": args.lm, "pairs": len(pairs), "k": args.k, "synthetic": args.synthetic,
           "pairs_per_s": {dt: len(pairs) / t for dt, t in times.items()},
           "bf16_speedup": times["float32"] / times["bfloat16"],
           "token_abs_err_mean": float(tok.mean()), "token_abs_err_max": float(tok.max()),
           "sequence_sum_abs_err_mean": float(seq_sum.mean()),
           "sequence_sum_abs_err_max": float(seq_sum.max()),
           "ranking_kendall_tau_mean": float(np.nanmean(taus)),
           "ranking_top1_agreement": top1}
    rows = [("pairs/s float32 / bfloat16", f"{out['pairs_per_s']['float32']:.2f} / "
             f"{out['pairs_per_s']['bfloat16']:.2f}", f"{out['bf16_speedup']:.2f}x"),
            ("|Δ log p| per token, mean / max", f"{tok.mean():.4f} / {tok.max():.3f}", ""),
            ("|Δ| of the summed sequence score, mean / max",
             f"{seq_sum.mean():.3f} / {seq_sum.max():.3f}", ""),
            (f"ranking of the {args.k} documents by mean log-prob: Kendall τ / top-1 agreement",
             f"{np.nanmean(taus):.3f} / {top1:.3f}", "")]
    write(args.name, out, rows, ("bfloat16 against float32", "value", "ratio"))


if __name__ == "__main__":
    main()
