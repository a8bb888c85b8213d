"""Recall against speed, on two kinds of synthetic data: the recall@10 / queries-per-second
frontier of Flat, IVF-Flat and IVF-PQ (with float32 re-ranking) over nprobe × re-rank factor,
measured with :mod:`replug_jax.retrieval.quality` on held-out queries (exact search streamed
over the vectors). ``latent``: topics in a 64-d latent space (``benches/synthetic.py``);
``tight``: clusters of about a thousand nearly equidistant members, hard for PQ codes.

Usage: ``python -m benches.bench_recall [--n 1000000] [--kinds latent tight]``; writes
``benches/results/recall.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import numpy as np

from benches.synthetic import Generator


def frontier(index, source, queries, exact, nprobes, reranks):
    from replug_jax.retrieval.quality import measure

    return [measure(index, source, queries, exact, 10, nprobe=p, rerank=r)
            for r in reranks for p in nprobes]


def main(argv=None):
    from replug_jax.retrieval.corpus import Passage
    from replug_jax.retrieval import EmbeddingSource, build_index
    from replug_jax.retrieval.quality import exact_neighbours

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000, help="vectors per datastore")
    ap.add_argument("--dim", type=int, default=384, help="vector dimension")
    ap.add_argument("--queries", type=int, default=256, help="held-out queries")
    ap.add_argument("--kinds", nargs="+", default=["latent", "tight"], help="data kinds")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benches/results"),
                    help="results folder")
    args = ap.parse_args(argv)
    nlist = 1 << max(4, int(np.log2(np.sqrt(args.n))) + 1)
    factories = ["Flat", f"IVF{nlist},Flat", f"IVF{nlist},PQ{args.dim // 8}"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.kinds:
            gen = Generator(args.dim, topics=max(args.n // 1000, 16), kind=kind)
            emb = np.lib.format.open_memmap(f"{tmp}/emb.npy", "w+", np.float32,
                                            (args.n, args.dim))
            for lo in range(0, args.n, 65536):
                emb[lo:min(args.n, lo + 65536)] = gen.vectors(lo, min(args.n, lo + 65536))
            emb.flush()
            queries = gen.queries(args.queries)
            source = EmbeddingSource.from_files([f"{tmp}/emb.npy"])
            exact = exact_neighbours(source, queries, 10)
            for factory in factories:
                t0 = time.perf_counter()
                index = build_index([Passage(i, "") for i in range(args.n)], None,
                                    f"{tmp}/{kind}-{len(rows)}", factory=factory,
                                    embeddings=f"{tmp}/emb.npy", progress=False,
                                    target_recall=0.95 if "PQ" in factory else None)
                build_s = time.perf_counter() - t0
                pq = "PQ" in factory
                points = frontier(index, source, queries, exact,
                                  [None] if factory == "Flat" else [1, 4, 16, 64],
                                  [0, 8, 32, 128] if pq else [0])
                rows.append({"kind": kind, "factory": factory, "n": args.n,
                             "build_seconds": build_s, "points": points,
                             "tuned": index.manifest.get("recall", {}).get("tuning", {}).get(
                                 "best")})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "recall.json").write_text(json.dumps(rows, indent=1) + "\n")
    lines = ["| data | index | nprobe, re-rank: recall@10 (QPS) |", "|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} {r['n']:,} | {r['factory']} | " + "; ".join(
            f"{p['nprobe']}, ×{p['rerank']}: {p['recall']:.3f} ({p['qps']:.0f})"
            for p in r["points"]) + " |")
    (args.out / "recall.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    from replug_jax.imports import require

    matplotlib = require("matplotlib", "experiments", "plotting")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.kinds), figsize=(5 * len(args.kinds), 3.5),
                             squeeze=False)
    for ax, kind in zip(axes[0], args.kinds):
        for r in (r for r in rows if r["kind"] == kind):
            ax.plot([p["qps"] for p in r["points"]], [p["recall"] for p in r["points"]], "o",
                    label=r["factory"], ms=4)
        ax.set_xscale("log")
        ax.set_xlabel("queries / s")
        ax.set_ylabel("recall@10")
        ax.set_title(f"{kind} ({args.n:,} × {args.dim})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out / "recall.png", dpi=120)


if __name__ == "__main__":
    main()
