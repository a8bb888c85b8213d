"""Corpus embedding throughput and what it means at paper scale.

Encodes ``--passages`` synthetic 100-word passages (DPR's length; about 128-140 WordPieces)
with a retriever in a given dtype, data-parallel over every local device, and reports
passages/s, the fraction of the measured matmul peak, and the projected hours to embed DPR's
21M Wikipedia passages and the paper's 36M Pile documents on this machine.

Usage: ``python -m benches.bench_encode [--retriever minilm] [--dtype bfloat16]``. Writes
``benches/results/<name>.{json,md}`` (default name ``encode_<retriever>_<dtype>``).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from benches.common import matmul_peak_flops, write
from replug_jax.models import load_retriever
from replug_jax.retrieval.encoder import Retriever

WORDS = ("the retrieval augmented language model reads a passage about history science "
         "geography music and sport from a large datastore of encyclopedia text").split()
CORPORA = {"DPR Wikipedia (21,015,324 passages)": 21_015_324,
           "REPLUG Pile subset (36M documents)": 36_000_000}


def passages(n: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(100)) + f" #{i}"
            for i in range(n)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--retriever", default="minilm", help="retriever source (default minilm)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="parameter and activation dtype")
    ap.add_argument("--passages", type=int, default=0,
                    help="passages to encode (default 256 on CPU, 16384 on accelerators)")
    ap.add_argument("--batch-size", type=int, default=None, help="encoding batch size")
    ap.add_argument("--max-length", type=int, default=256, help="encoder token limit")
    ap.add_argument("--name", default=None, help="results file name")
    args = ap.parse_args(argv)
    n = args.passages or (256 if jax.default_backend() == "cpu" else 16384)
    model = load_retriever(args.retriever, dtype=args.dtype)
    retriever = Retriever(model, max_length=args.max_length, batch_size=args.batch_size)
    texts = passages(n)
    ids = retriever.tokenize(texts)
    tokens = sum(len(x) for x in ids)
    retriever.encode_ids(ids[: retriever.batch_size * 2])  # compile
    t0 = time.perf_counter()
    retriever.encode_ids(ids)
    seconds = time.perf_counter() - t0
    cfg = model.config
    # forward FLOPs per token: 2 x (4 H^2 attention projections + 2 H I MLP) per layer
    flops_per_token = 2 * cfg.num_layers * (4 * cfg.hidden_size ** 2
                                            + 2 * cfg.hidden_size * cfg.intermediate_size)
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    devices = 1 if retriever.mesh is None else retriever.mesh.devices.size
    peak = matmul_peak_flops(dtype=dtype) * devices
    rate = n / seconds
    result = {"retriever": args.retriever, "dtype": args.dtype, "passages": n,
              "tokens": tokens, "devices": devices, "batch_size": retriever.batch_size,
              "passages_per_s": rate, "tokens_per_s": tokens / seconds,
              "fraction_of_matmul_peak": flops_per_token * tokens / seconds / peak,
              "projected_hours": {k: v / rate / 3600 for k, v in CORPORA.items()}}
    rows = [("passages/s", f"{rate:.1f}"),
            ("fraction of the measured matmul peak",
             f"{result['fraction_of_matmul_peak']:.0%}")]
    rows += [(f"hours to embed {k}", f"{v:.1f}") for k, v in result["projected_hours"].items()]
    write(args.name or f"encode_{args.retriever.split('/')[-1]}_{args.dtype}", result, rows,
          ("what", "value"))


if __name__ == "__main__":
    main()
