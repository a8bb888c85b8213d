"""Host memory of one index refresh (FAISS backend), at a size this machine can hold, in units
of the index itself (N x D x 4 bytes) so that it scales to the paper's 21M passages.

A refresh runs while training searches the live index: the process holds that index, reads the
new embeddings (a memory-mapped ``.npy``), builds the new index and writes it. For N in
``--sizes`` (D = ``--dim``), the embeddings of index versions 0 and 1 are written first (random
unit vectors: the encoder is not what is measured), then a fresh process builds version 0 (the
live index), resets its peak RSS (``/proc/self/clear_refs``) and runs
``IndexRefresher.build(1)`` — on one process, and as process 0 of 2 (every process builds
the whole index from both processes' shares). It reports what the refresh added to the peak:
RSS (``VmHWM``, which counts the mapped embeddings' pages while they are read) and anonymous
RSS (``RssAnon`` sampled every 10 ms: the memory the process holds itself). The minimum is one
new index (1.0x); the live index is held before and after (not counted).

Usage: ``python -m benches.bench_refresh_memory [--sizes 250000 1000000] [--dim 384]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

from benches.bench_lsr_memory import synthetic_store
from benches.common import write

_RUN = """
import json, pathlib, sys, threading, time
import numpy as np

peak_anon = [0]


def status(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024


def sample_anon():
    while True:
        peak_anon[0] = max(peak_anon[0], status("RssAnon"))
        time.sleep(0.01)


from flax import nnx
from replug_jax.models import RetrieverModel, load_tokenizer
from replug_jax.models.bert import BertConfig, BertEncoder
from replug_jax.retrieval.encoder import Retriever
from replug_jax.retrieval.store import PassageStore
from replug_jax.train.config import LSRConfig
from replug_jax.train.refresh import IndexRefresher

store_path, workdir, dim, pcount = sys.argv[1], pathlib.Path(sys.argv[2]), int(sys.argv[3]), \\
    int(sys.argv[4])
bcfg = BertConfig(hidden_size=dim, num_layers=1, num_heads=4, intermediate_size=64,
                  max_position=64, has_pooler=False)
retriever = Retriever(RetrieverModel(BertEncoder(bcfg, rngs=nnx.Rngs(0)),
                                     load_tokenizer("minilm"), bcfg, "mean", False, "tiny",
                                     "tiny"), similarity="cosine", max_length=32)
cfg = LSRConfig.from_tree({"retriever.name": "tiny", "lm.name": "tiny",
                           "retrieval": {"index_backend": "faiss", "index_factory": "Flat"},
                           "num_devices": 1})
store = PassageStore.open(store_path)
refresher = IndexRefresher(workdir, cfg.retrieval, retriever, store, None, params_now=dict,
                           process_index=0, process_count=pcount)
refresher.index = refresher.build(0, {})  # the live index training searches
time.sleep(0.1)
threading.Thread(target=sample_anon, daemon=True).start()
time.sleep(0.05)
pathlib.Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS
rss0, anon0 = status("VmRSS"), status("RssAnon")
peak_anon[0] = anon0
refresher.build(1, {})
time.sleep(0.05)
print(json.dumps({"rss_added": status("VmHWM") - rss0, "anon_added": peak_anon[0] - anon0}))
"""


def write_embeddings(path: pathlib.Path, rows: int, dim: int, seed: int) -> None:
    """Random unit vectors as a ``.npy``, written block by block."""
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(rows, dim))
    rng = np.random.default_rng(seed)
    for lo in range(0, rows, 65536):
        x = rng.normal(size=(min(rows, lo + 65536) - lo, dim)).astype(np.float32)
        out[lo:lo + len(x)] = x / np.linalg.norm(x, axis=1, keepdims=True)
    out.flush()
    del out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[250_000, 1_000_000],
                    help="corpus sizes N (passages)")
    ap.add_argument("--dim", type=int, default=384, help="embedding width D")
    args = ap.parse_args(argv)
    out, rows = {"sizes": args.sizes, "dim": args.dim, "runs": []}, []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            store = pathlib.Path(tmp) / f"store_{n}.arrow"
            synthetic_store(n, store)
            for pcount in (1, 2):
                work = pathlib.Path(tmp) / f"run_{n}_{pcount}"
                half = (n + 1) // 2
                for version in (0, 1):
                    folder = work / "index" / f"v{version}"
                    if pcount == 1:
                        write_embeddings(folder / "emb.npy", n, args.dim, version)
                    else:
                        write_embeddings(folder / "emb.p0of2.npy", half, args.dim, version)
                        write_embeddings(folder / "emb.p1of2.npy", n - half, args.dim, 9)
                res = subprocess.run([sys.executable, "-c", _RUN, str(store), str(work),
                                      str(args.dim), str(pcount)],
                                     capture_output=True, text=True)
                if res.returncode:
                    raise SystemExit(res.stderr[-3000:])
                got = json.loads(res.stdout.strip().splitlines()[-1])
                index_bytes = n * args.dim * 4
                run = {"n": n, "processes": pcount, "index_mib": index_bytes / 2**20,
                       "rss_added_mib": got["rss_added"] / 2**20,
                       "anon_added_mib": got["anon_added"] / 2**20,
                       "rss_added_x_index": got["rss_added"] / index_bytes,
                       "anon_added_x_index": got["anon_added"] / index_bytes}
                out["runs"].append(run)
                print(run, flush=True)
                rows.append((f"{n:,}", pcount, f"{run['index_mib']:.0f}",
                             f"{run['rss_added_mib']:.0f} ({run['rss_added_x_index']:.2f}x)",
                             f"{run['anon_added_mib']:.0f} ({run['anon_added_x_index']:.2f}x)"))
    write("refresh_memory", out, rows, ("passages", "processes", "index MiB",
                                        "peak RSS added MiB", "peak anonymous RSS added MiB"))


if __name__ == "__main__":
    main()
