"""Run every benchmark; each writes ``benches/results/<name>.json`` and ``.md``.

Usage: ``python -m benches.run_all [--quick]``.
"""

import sys

from benches import bench_inference, bench_models, bench_retrieval


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    for bench in (bench_models, bench_retrieval, bench_inference):
        bench.main(argv)


if __name__ == "__main__":
    main()
