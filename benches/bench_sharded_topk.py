"""Training-time retrieval in JAX: exact top-k over a corpus sharded along N on 8 devices
against the same corpus on 1 device, at several N, same ids checked.

On a CPU the 8 devices are simulated on the same cores (``XLA_FLAGS`` is set here before JAX
loads), so the ratio shows the cost of the shard_map / all_gather / merge structure rather
than a speed-up; on 8 real accelerators each device scans N/8 rows.

Usage: ``python -m benches.bench_sharded_topk [--sizes 250000 1000000 2000000]``.
Writes ``benches/results/sharded_topk.{json,md}``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benches.common import write  # noqa: E402
from benches.synthetic import Generator  # noqa: E402
from replug_jax.retrieval.index import shard_corpus, sharded_topk  # noqa: E402
from replug_jax.sharding import make_mesh  # noqa: E402


def timed(fn, repeats: int = 3) -> float:
    jax.block_until_ready(fn())  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[250_000, 1_000_000, 2_000_000],
                    help="corpus sizes N (384-d, bfloat16)")
    ap.add_argument("--queries", type=int, default=64, help="queries per search (default 64)")
    ap.add_argument("--k", type=int, default=20, help="k (default 20)")
    ap.add_argument("--device-resident", type=int, default=0, metavar="N",
                    help="instead: one corpus of N x --dim bf16 rows generated on the devices "
                    "(accelerators: the largest N that fits), queries/s over all devices")
    ap.add_argument("--dim", type=int, default=768, help="dimension for --device-resident")
    args = ap.parse_args(argv)
    if args.device_resident:
        return device_resident(args)
    if len(jax.devices()) < 8:
        raise SystemExit("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    gen = Generator()
    queries = gen.queries(args.queries)
    rows, results = [], []
    for n in args.sizes:
        corpus = gen.vectors(0, n)
        out = {"n": n}
        ids = {}
        for devices in (1, 8):
            mesh = make_mesh(devices)
            array, _ = shard_corpus(corpus, mesh, dtype=jnp.bfloat16)

            def search(array=array, mesh=mesh):
                return sharded_topk(queries, array, args.k, n, mesh)

            seconds = timed(search)
            ids[devices] = np.asarray(search()[1])
            out[f"qps_{devices}"] = args.queries / seconds
        out["same_ids"] = float((ids[1] == ids[8]).mean())
        out["ratio_8_over_1"] = out["qps_8"] / out["qps_1"]
        results.append(out)
        rows.append((f"{n:,}", f"{out['qps_1']:.0f}", f"{out['qps_8']:.0f}",
                     f"{out['ratio_8_over_1']:.2f}x", f"{out['same_ids']:.4f}"))
        print(out, flush=True)
    write("sharded_topk", {"queries": args.queries, "k": args.k, "dim": 384,
                           "dtype": "bfloat16", "results": results}, rows,
          ("N (384-d bf16)", "queries/s, 1 device", "queries/s, 8 devices", "8 / 1",
           "same ids"))


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
    queries = np.asarray(jax.random.normal(jax.random.key(1), (args.queries, args.dim)))
    seconds = timed(lambda: sharded_topk(queries, corpus, args.k, n, mesh))
    scanned = n * args.dim * 2 / seconds  # bytes of corpus read per second
    out = {"n": n, "dim": args.dim, "devices": d, "qps": args.queries / seconds,
           "seconds_per_search": seconds, "corpus_gib": n * args.dim * 2 / 2**30,
           "corpus_bytes_per_s": scanned}
    write("sharded_topk_device", out,
          [(f"{n:,} x {args.dim} bf16 ({out['corpus_gib']:.1f} GiB) on {d} device(s)",
            f"{out['qps']:.0f} queries/s", f"{scanned / 2**30:.0f} GiB/s scanned")],
          ("corpus", f"batch {args.queries}, k {args.k}", "bandwidth"))


if __name__ == "__main__":
    main()
