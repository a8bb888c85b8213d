"""Training-time retrieval in JAX: exact top-k (:func:`~replug_jax.retrieval.jax_search.exact_topk`,
two-stage per block) against FAISS ``IndexFlatIP`` on the same vectors in the same run, as a
fraction of the machine's measured matmul peak, with the ids compared.

Host mode (default): for each N, FAISS exact search, JAX in the backend's storage dtype
(float32 on CPU) and in the other dtype, the same search sharded over 8 devices (simulated on
a CPU: the cost of the shard_map / all_gather / merge structure, not a speed-up), and a square
matmul (the peak), timed in alternation. Every row reports queries/s, the share of the matmul
peak (2·B·N·D FLOPs per search) and the fraction of result ids equal to FAISS's (as sets per
query: ties may order differently).

Device mode (``--device-resident N``): a corpus generated on the accelerators (no host copy),
queries/s and GB/s scanned at each batch, against the device's measured copy bandwidth.

Usage: ``python -m benches.bench_sharded_topk [--sizes 1000000 4000000] [--batches 64]``.
Writes ``benches/results/sharded_topk.{json,md}`` (device mode: ``sharded_topk_device``).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import gc  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benches.common import best_time, best_times, write  # noqa: E402
from benches.synthetic import Generator  # noqa: E402
from replug_jax.retrieval import (  # noqa: E402
    exact_topk,
    shard_corpus,
    sharded_topk,
    storage_dtype,
)
from replug_jax.sharding import make_mesh  # noqa: E402


def timed(fn, repeats: int = 3) -> float:
    """Best wall time of ``fn`` after one compiling call."""
    return best_time(lambda: jax.block_until_ready(fn()), repeats=repeats)


def same_ids(a_BK, b_BK) -> float:
    """Fraction of result ids two searches share, per query as sets."""
    return float(np.mean([len(set(x) & set(y)) / len(x)
                          for x, y in zip(np.asarray(a_BK).tolist(), np.asarray(b_BK).tolist())]))


def square_matmul(n: int = 2048):
    """The machine's matmul peak as a contender: a jitted square float32 matmul, 2·n³ FLOPs."""
    x = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda a: a @ a)
    return (lambda: jax.block_until_ready(f(x))), 2.0 * n ** 3


@jax.jit
def scores_only(c_ND, q_BD):
    """The scores of every row for every query and their maximum: what any exact top-k built
    on XLA's matmul must at least do (the bound the top-k's share of the peak is read
    against)."""
    return jnp.dot(c_ND, q_BD.astype(c_ND.dtype).T, preferred_element_type=jnp.float32).max(0)


def host(args) -> None:
    """FAISS, JAX in both dtypes, the 8-device search and the square matmul that defines the
    peak, timed in alternation (one call of each per round, best of the rounds): a slow spell
    of the shared host weighs on all of them, so the ratios and the shares of the peak hold."""
    import faiss

    gen = Generator()
    fast, other = storage_dtype(), {"float32": "bfloat16", "bfloat16": "float32"}[storage_dtype()]
    peak_fn, peak_flops = square_matmul()
    rows, results = [], []
    for n in args.sizes:
        # memory at 4M x 384: the float32 corpus (JAX aliases it on a CPU) and FAISS's copy;
        # the other dtype and the 8-device structure at the smallest size only
        corpus = np.empty((n, gen.dim), np.float32)
        for lo in range(0, n, 1 << 18):
            corpus[lo:lo + (1 << 18)] = gen.vectors(lo, min(n, lo + (1 << 18)))
        first = n == min(args.sizes)
        mesh = make_mesh(8) if args.sharded and len(jax.devices()) >= 8 and first else None
        sharded = shard_corpus(corpus, mesh)[0] if mesh is not None else None
        arrays = {fast: jnp.asarray(corpus, fast, copy=False)}
        if first:
            arrays[other] = arrays[fast].astype(other)
        flat = faiss.IndexFlatIP(gen.dim)
        for lo in range(0, n, 1 << 18):
            flat.add(corpus[lo:lo + (1 << 18)])
        for batch in args.batches:
            queries = gen.queries(batch)
            contenders = {"peak": peak_fn,
                          "faiss": lambda flat=flat: flat.search(queries, args.k),
                          "scores": lambda c=arrays[fast]: jax.block_until_ready(
                              scores_only(c, queries))}
            for dtype, c in arrays.items():
                contenders[dtype] = lambda c=c: jax.block_until_ready(
                    exact_topk(queries, c, args.k))
            if sharded is not None:
                contenders["sharded_8"] = lambda sharded=sharded: jax.block_until_ready(
                    sharded_topk(queries, sharded, args.k, n, mesh))
            t = best_times(contenders, repeats=args.repeats)
            peak = peak_flops / t["peak"]
            flops = 2 * batch * n * gen.dim
            f_ids = flat.search(queries, args.k)[1]
            entry = {"n": n, "batch": batch, "k": args.k, "matmul_peak_flops": peak,
                     "scores_only_peak_fraction": flops / t["scores"] / peak,
                     "faiss_qps": batch / t["faiss"], "faiss_peak_fraction":
                     flops / t["faiss"] / peak, "jax": {}}
            for dtype, c in arrays.items():
                entry["jax"][dtype] = {
                    "qps": batch / t[dtype], "peak_fraction": flops / t[dtype] / peak,
                    "vs_faiss": t["faiss"] / t[dtype],
                    "same_ids_as_faiss": same_ids(exact_topk(queries, c, args.k)[1], f_ids)}
            if sharded is not None:
                entry["sharded_8"] = {
                    "qps": batch / t["sharded_8"], "vs_faiss": t["faiss"] / t["sharded_8"],
                    "same_ids_as_faiss": same_ids(
                        sharded_topk(queries, sharded, args.k, n, mesh)[1], f_ids)}
            results.append(entry)
            print(entry, flush=True)
            for dtype, r in entry["jax"].items():
                rows.append((f"{n:,}", batch, f"JAX exact, {dtype}" + (" (default)"
                                                                      if dtype == fast else ""),
                             f"{r['qps']:.0f}", f"{r['peak_fraction']:.0%}",
                             f"{r['vs_faiss']:.2f}x", f"{r['same_ids_as_faiss']:.4f}"))
            rows.append((f"{n:,}", batch, "bound: the scores matmul alone (c·qᵀ, then max)",
                         f"{batch / t['scores']:.0f}", f"{entry['scores_only_peak_fraction']:.0%}",
                         f"{t['faiss'] / t['scores']:.2f}x", ""))
            rows.append((f"{n:,}", batch, "FAISS IndexFlatIP", f"{entry['faiss_qps']:.0f}",
                         f"{entry['faiss_peak_fraction']:.0%}", "1.00x", "1.0000"))
            if "sharded_8" in entry:
                r = entry["sharded_8"]
                rows.append((f"{n:,}", batch, "JAX exact, 8 simulated devices",
                             f"{r['qps']:.0f}", "", f"{r['vs_faiss']:.2f}x",
                             f"{r['same_ids_as_faiss']:.4f}"))
        flat.reset()
        del arrays, sharded, contenders, corpus
        gc.collect()
    write("sharded_topk", {"k": args.k, "dim": 384, "storage_dtype": fast,
                           "peak": "a jitted 2048² float32 matmul, timed in the same rounds",
                           "results": results}, rows,
          ("N (384-d)", "batch", "search", "queries/s", "of matmul peak", "vs FAISS",
           "same ids as FAISS"))


def copy_bandwidth(x) -> float:
    """Bytes per second of a jitted elementwise pass over ``x`` (read + write)."""
    f = jax.jit(lambda a: a * 2)
    return 2 * x.size * x.dtype.itemsize / timed(lambda: f(x))


def device_resident(args) -> None:
    """Exact top-k over a corpus that never exists on the host."""
    mesh = make_mesh()
    d = mesh.devices.size
    n = -(-args.device_resident // d) * d
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))

    @jax.jit
    def make(key):
        x = jax.random.normal(key, (n, args.dim), jnp.bfloat16)
        return jax.lax.with_sharding_constraint(
            x / jnp.linalg.norm(x.astype(jnp.float32), axis=1, keepdims=True).astype(x.dtype),
            sharding)

    corpus = make(jax.random.key(0))
    bandwidth = copy_bandwidth(corpus) / d  # per device
    corpus_bytes = n * args.dim * 2
    rows, results = [], []
    for batch in args.batches:
        queries = np.asarray(jax.random.normal(jax.random.key(1), (batch, args.dim)))
        seconds = timed(lambda: sharded_topk(queries, corpus, args.k, n, mesh))
        scanned = corpus_bytes / seconds / d  # bytes of corpus read per second per device
        out = {"n": n, "dim": args.dim, "devices": d, "batch": batch, "k": args.k,
               "qps": batch / seconds, "seconds_per_search": seconds,
               "corpus_gib": corpus_bytes / 2**30, "bytes_per_s_per_device": scanned,
               "copy_bandwidth_per_device": bandwidth,
               "bandwidth_fraction": scanned / bandwidth}
        results.append(out)
        print(out, flush=True)
        rows.append((f"{n:,} x {args.dim} bf16 ({out['corpus_gib']:.1f} GiB) on {d} device(s)",
                     batch, f"{out['qps']:.0f}", f"{scanned / 2**30:.0f} GiB/s",
                     f"{out['bandwidth_fraction']:.0%}"))
    write("sharded_topk_device", {"results": results}, rows,
          ("corpus", "batch", "queries/s", "scanned per device", "of copy bandwidth"))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 4_000_000],
                    help="corpus sizes N of 384-d vectors (default 1M and 4M)")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help="queries per search (default 64 on the host; 64 and 1024 on devices)")
    ap.add_argument("--k", type=int, default=20, help="k (default 20, the paper's)")
    ap.add_argument("--no-sharded", dest="sharded", action="store_false",
                    help="skip the 8-simulated-device rows")
    ap.add_argument("--repeats", type=int, default=5,
                    help="rounds of alternating calls; each contender's best round counts")
    ap.add_argument("--device-resident", type=int, default=0, metavar="N",
                    help="instead: one corpus of N x --dim bf16 rows generated on the devices "
                    "(accelerators: e.g. 20000000), queries/s and GB/s scanned")
    ap.add_argument("--dim", type=int, default=768, help="dimension for --device-resident")
    args = ap.parse_args(argv)
    if args.device_resident:
        args.batches = args.batches or [64, 1024]
        return device_resident(args)
    args.batches = args.batches or [64]
    host(args)


if __name__ == "__main__":
    main()
