"""Run every benchmark in turn with its defaults; each writes ``benches/results/<name>.json``
and ``.md``. ``--quick`` is passed to those that have a smoke size; ``--only`` picks some.
The datastore and recall benchmarks at their default 1M–4M sizes take hours on 2 CPU cores.

Usage: ``python -m benches.run_all [--quick] [--only bench_models bench_lsr ...]``.
"""

import argparse
import importlib

BENCHES = ("bench_models", "bench_inference", "bench_lsr", "bench_encode", "bench_retrieval",
           "bench_sharded_topk", "bench_recall", "bench_datastore", "bench_serve",
           "bench_first_run", "bench_scoring", "bench_precision", "bench_api_scoring",
           "lm_recipes", "bench_lsr_prefetch", "bench_lsr_memory")
# bench_sharded_lm runs on its own: it sets 8 simulated CPU devices before JAX first loads
HAS_QUICK = {"bench_models", "bench_inference", "bench_lsr", "bench_retrieval", "bench_scoring",
             "bench_precision"}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke sizes for {', '.join(sorted(HAS_QUICK))}")
    ap.add_argument("--only", nargs="+", choices=BENCHES, default=BENCHES,
                    help="run only these benchmarks (default: all, in the order listed)")
    args = ap.parse_args(argv)
    for name in args.only:
        print(f"== {name}", flush=True)
        importlib.import_module(f"benches.{name}").main(
            ["--quick"] if args.quick and name in HAS_QUICK else [])


if __name__ == "__main__":
    main()
