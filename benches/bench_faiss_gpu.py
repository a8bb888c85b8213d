"""FAISS on a GPU against FAISS on the CPU, same vectors, same run: IVF training time, and
search queries/s with recall@10 against exact search, for Flat and IVF-PQ.

Needs a FAISS build with GPU support (``faiss-gpu-cu12`` from PyPI; the device check installs
its wheel into a separate folder, since it cannot replace ``faiss-cpu`` in place). On a machine
without it the script says so in one line and exits 2.

Usage: ``python -m benches.bench_faiss_gpu [--n 1000000] [--dim 768] [--factory IVF4096,PQ64]``.
Writes ``benches/results/faiss_gpu.{json,md}``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benches.common import write
from benches.synthetic import Generator


def timed(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def recall(ids_QK: np.ndarray, exact_QK: np.ndarray) -> float:
    return float(np.mean([len(set(a) & set(b)) / len(b) for a, b in zip(ids_QK, exact_QK)]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=1_000_000, help="corpus vectors (default 1M)")
    ap.add_argument("--dim", type=int, default=768, help="dimension (default 768)")
    ap.add_argument("--factory", default="IVF4096,PQ64", help="the approximate index")
    ap.add_argument("--nprobe", type=int, default=32, help="IVF lists searched (default 32)")
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 1024],
                    help="queries per search (default 64 and 1024)")
    ap.add_argument("--k", type=int, default=10, help="k (default 10)")
    args = ap.parse_args(argv)
    import faiss

    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() == 0:
        raise SystemExit("bench_faiss_gpu: error: this FAISS build sees no GPU (install "
                         "faiss-gpu-cu12 and run on a GPU machine)")
    gen = Generator(dim=args.dim)
    corpus = gen.vectors(0, args.n)
    res = faiss.StandardGpuResources()
    rows, results = [], []
    for factory in ("Flat", args.factory):
        cpu = faiss.index_factory(args.dim, factory, faiss.METRIC_INNER_PRODUCT)
        entry = {"factory": factory}
        if not cpu.is_trained:
            train = corpus[np.random.default_rng(0).choice(args.n, min(args.n, 256 * 1024),
                                                           replace=False)]
            t0 = time.perf_counter()
            cpu.train(train)
            entry["train_s_cpu"] = time.perf_counter() - t0
            fresh = faiss.index_cpu_to_gpu(res, 0, faiss.index_factory(
                args.dim, factory, faiss.METRIC_INNER_PRODUCT))
            t0 = time.perf_counter()
            fresh.train(train)
            entry["train_s_gpu"] = time.perf_counter() - t0
        cpu.add(corpus)
        gpu = faiss.index_cpu_to_gpu(res, 0, cpu)
        if factory != "Flat":
            faiss.ParameterSpace().set_index_parameter(cpu, "nprobe", args.nprobe)
            faiss.GpuParameterSpace().set_index_parameter(gpu, "nprobe", args.nprobe)
        for batch in args.batches:
            q = gen.queries(batch)
            exact = q @ corpus.T
            exact_ids = np.argsort(-exact, axis=1)[:, :args.k]
            for where, index in (("cpu", cpu), ("gpu", gpu)):
                seconds = timed(lambda: index.search(q, args.k))
                entry[f"{where}_qps_{batch}"] = batch / seconds
                entry[f"{where}_recall_{batch}"] = recall(index.search(q, args.k)[1], exact_ids)
            rows.append((factory, batch, f"{entry[f'cpu_qps_{batch}']:.0f}",
                         f"{entry[f'gpu_qps_{batch}']:.0f}",
                         f"{entry[f'gpu_qps_{batch}'] / entry[f'cpu_qps_{batch}']:.1f}x",
                         f"{entry[f'gpu_recall_{batch}']:.3f}",
                         f"{entry.get('train_s_cpu', 0):.1f} / {entry.get('train_s_gpu', 0):.1f}"
                         if "train_s_cpu" in entry else ""))
        results.append(entry)
        print(entry, flush=True)
    write("faiss_gpu", {"n": args.n, "dim": args.dim, "k": args.k, "nprobe": args.nprobe,
                        "results": results}, rows,
          ("index", "batch", "CPU queries/s", "GPU queries/s", "GPU / CPU", "GPU recall@k",
           "train s (CPU / GPU)"))


if __name__ == "__main__":
    main()
