"""Index building and search: our encoder vs PyTorch on the NQ passages, exact vs IVF search
QPS on 100k clustered vectors, and the embedding step's memory as N grows (memmap).

Usage: ``python -m benches.bench_retrieval [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import tempfile

import numpy as np

from benches.common import best_time, write
from experiments.lib.common import SHARED_DATA


def nq_passages(limit: int) -> list[str]:
    path = SHARED_DATA / "nq_gold_passages" / "nq_openbook.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()][:limit]
    return [re.match(r"Context: (.*)\n\nQuestion:", r["query"], re.S).group(1) for r in rows]


_MEMORY_CHILD = """
import resource, sys, tempfile, pathlib
from benches.bench_retrieval import encode_memmap_rss
print(encode_memmap_rss(int(sys.argv[1])))
"""


def encode_memmap_rss(n: int) -> float:
    """Peak RSS (MiB) of embedding ``n`` short passages into a memmap with a tiny encoder."""
    from tests._models import tiny_retriever

    retriever = tiny_retriever(0)
    texts = [f"passage {i} about topic {i % 97}" for i in range(n)]
    with tempfile.TemporaryDirectory() as d:
        retriever.encode_to_file(texts, f"{d}/e.npy", block_size=2048, progress=False)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller sizes (smoke run)")
    args = ap.parse_args(argv)
    import faiss
    import torch
    from transformers import BertModel

    from replug_jax.models.weights import packaged_path
    from replug_jax.retrieval.encoder import Retriever

    rows, out = [], {}
    n = 64 if args.quick else 256
    texts = nq_passages(n)
    retriever = Retriever.load("minilm", max_length=256, batch_size=32)
    retriever.encode(texts[:32])  # compile the buckets
    ours = best_time(lambda: retriever.encode(texts), repeats=1, warmup=1)
    tok = retriever.model.tokenizer
    ref = BertModel.from_pretrained(str(packaged_path("minilm"))).eval()

    def torch_encode():
        with torch.no_grad():
            for i in range(0, n, 32):
                enc = tok(texts[i:i + 32], padding=True, truncation=True, max_length=256,
                          return_tensors="pt")
                h = ref(**enc).last_hidden_state
                m = enc["attention_mask"][..., None]
                (h * m).sum(1) / m.sum(1)

    theirs = best_time(torch_encode, repeats=1, warmup=1)
    out["nq_encode"] = {"passages": n, "ours_passages_per_s": n / ours,
                        "torch_passages_per_s": n / theirs, "ratio": theirs / ours}
    rows.append(("NQ passage encoding (passages/s)", f"{n / ours:.1f}", f"{n / theirs:.1f}",
                 f"{theirs / ours:.2f}x"))

    # Search: exact vs IVF on clustered synthetic vectors.
    N, D = (20_000 if args.quick else 100_000), 384
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(256, D)).astype(np.float32)
    x = centers[rng.integers(0, 256, N)] + 0.3 * rng.normal(size=(N, D)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    q = x[rng.choice(N, 1000, replace=False)] + 0.05 * rng.normal(size=(1000, D)).astype(
        np.float32)
    flat = faiss.IndexFlatIP(D)
    flat.add(x)
    ivf = faiss.index_factory(D, "IVF1024,Flat", faiss.METRIC_INNER_PRODUCT)
    ivf.train(x)
    ivf.add(x)
    ivf.nprobe = 16
    t_flat = best_time(lambda: flat.search(q, 10), repeats=2)
    t_ivf = best_time(lambda: ivf.search(q, 10), repeats=2)
    exact_ids = flat.search(q, 10)[1]
    ivf_ids = ivf.search(q, 10)[1]
    recall = float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(exact_ids, ivf_ids)]))
    out["search"] = {"n": N, "dim": D, "queries": 1000, "exact_qps": 1000 / t_flat,
                     "ivf_qps": 1000 / t_ivf, "ivf_over_exact": t_flat / t_ivf,
                     "ivf_recall_at_10": recall}
    rows.append((f"search QPS at N={N} (exact / IVF1024 nprobe 16)", f"{1000 / t_flat:.0f}",
                 f"{1000 / t_ivf:.0f}", f"{t_flat / t_ivf:.1f}x, recall@10 {recall:.3f}"))

    # Memory of the embedding step as N grows: a fresh process per size.
    mem = {}
    for size in ((2_000, 8_000) if args.quick else (5_000, 20_000, 80_000)):
        res = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, str(size)],
                             capture_output=True, text=True, check=True)
        mem[size] = float(res.stdout.strip().splitlines()[-1])
    out["embedding_peak_rss_mib"] = mem
    sizes = sorted(mem)
    rows.append(("peak RSS embedding N passages (MiB)",
                 ", ".join(f"N={s}: {mem[s]:.0f}" for s in sizes), "",
                 f"growth {mem[sizes[-1]] / mem[sizes[0]]:.2f}x for {sizes[-1] // sizes[0]}x N"))
    write("retrieval", out, rows, ("what", "ours", "reference", "ratio"))


if __name__ == "__main__":
    main()
