"""Peak host memory of an LSR run against the size of its corpus: the passages read by id from
a memory-mapped store (what ``train-lsr`` does when ``corpus`` is an index folder or its
``passages.arrow``) against the same passages handed over as a Python list.

For N in ``--sizes``, a synthetic store of N passages (30 words each) is written once, then a
fresh process runs 2 LSR steps (a 2-layer, 32-wide random BERT with the MiniLM tokenizer as
the retriever, a tiny random Llama as the LM, FAISS ``Flat``, batch 8, k 4) and reports its
peak RSS (``ru_maxrss``) and its peak *anonymous* RSS (``RssAnon`` of ``/proc/self/status``,
sampled every 20 ms): the memory the process itself holds, without the pages of the
memory-mapped store and embedding files, which count in RSS while they are read but belong to
the kernel's page cache and are dropped under pressure. The FAISS index itself grows with N
(N x 32 x 4 bytes): the table shows it beside the RSS, and the anonymous RSS without it.

Usage: ``python -m benches.bench_lsr_memory [--sizes 100000 1000000]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

from benches.common import write

WORDS = ("river city music science history war king church school team film album game "
         "species island railway station village language party army battle novel song "
         "county district season league").split()

_RUN = """
import json, resource, sys, threading, time
import numpy as np

peak_anon = [0]


def sample_anon():  # anonymous resident memory (heap, arrays), not the mapped files' pages
    while True:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    peak_anon[0] = max(peak_anon[0], int(line.split()[1]))
        time.sleep(0.02)


threading.Thread(target=sample_anon, daemon=True).start()
from flax import nnx
from replug_jax.models import CausalLM, DecoderConfig, LanguageModel, RetrieverModel
from replug_jax.models import load_tokenizer
from replug_jax.models.bert import BertConfig, BertEncoder
from replug_jax.lm.flax_scorer import FlaxLM
from replug_jax.retrieval.encoder import Retriever
from replug_jax.retrieval.store import PassageStore
from replug_jax.train.config import LSRConfig
from replug_jax.train.data import Example
from replug_jax.train.loop import LSRTrainer

store_path, workdir, mode = sys.argv[1:4]
bcfg = BertConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                  max_position=64, has_pooler=False)
retriever = Retriever(RetrieverModel(BertEncoder(bcfg, rngs=nnx.Rngs(0)),
                                     load_tokenizer("minilm"), bcfg, "mean", False, "tiny",
                                     "tiny"), similarity="cosine", max_length=32,
                      batch_size=512)
dcfg = DecoderConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, max_position=512,
                     eos_token_id=2, pad_token_id=2)
lm = FlaxLM(LanguageModel(CausalLM(dcfg, rngs=nnx.Rngs(0)), load_tokenizer("smollm2"), dcfg,
                          "tiny", "tiny"), max_context=256)
store = PassageStore.open(store_path)
passages = store if mode == "store" else list(store)
train = [Example(f"e{i}", f"question {i} about the river", f"Question {i}?", " Answer.")
         for i in range(64)]
cfg = LSRConfig.from_tree({
    "retriever": {"name": "tiny", "query_max_length": 16, "doc_max_length": 32},
    "lm.name": "tiny", "k": 4, "batch_size": 8, "total_steps": 2,
    "retrieval.refresh_every": 1000, "num_devices": 1, "data.leakage": "none"})
LSRTrainer(cfg, workdir, retriever=retriever, lm_scorer=lm, passages=passages, train=train,
           progress=False).run()
time.sleep(0.1)
print(json.dumps({"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "peak_anon_mib": peak_anon[0] / 1024}))
"""


def synthetic_store(n: int, path: pathlib.Path) -> None:
    import numpy as np

    from replug_jax.retrieval.corpus import Passage
    from replug_jax.retrieval.store import write_store

    rng = np.random.default_rng(0)

    def passages():
        for i in range(n):
            words = rng.choice(len(WORDS), 30)
            yield Passage(i, " ".join(WORDS[w] for w in words), f"Article {i // 20}",
                          str(i // 20), 0, 0)

    write_store(passages(), path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000],
                    help="corpus sizes N (passages)")
    ap.add_argument("--modes", nargs="+", default=["store", "list"],
                    help="store (read by id from the memory map) and/or list (in memory)")
    args = ap.parse_args(argv)
    out, rows = {"sizes": args.sizes, "runs": []}, []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            store = pathlib.Path(tmp) / f"store_{n}.arrow"
            synthetic_store(n, store)
            for mode in args.modes:
                work = pathlib.Path(tmp) / f"run_{n}_{mode}"
                res = subprocess.run([sys.executable, "-c", _RUN, str(store), str(work), mode],
                                     capture_output=True, text=True, check=True)
                got = json.loads(res.stdout.strip().splitlines()[-1])
                peak, anon = got["peak_rss_mib"], got["peak_anon_mib"]
                index_mib = n * 32 * 4 / 2**20
                run = {"n": n, "mode": mode, "peak_rss_mib": peak, "peak_anon_mib": anon,
                       "index_mib": index_mib, "anon_without_index_mib": anon - index_mib}
                out["runs"].append(run)
                print(run, flush=True)
                rows.append((f"{n:,}", mode, f"{peak:.0f}", f"{anon:.0f}", f"{index_mib:.0f}",
                             f"{anon - index_mib:.0f}"))
    write("lsr_memory", out, rows, ("passages", "corpus held as", "peak RSS MiB",
                                    "peak anonymous RSS MiB", "FAISS Flat index MiB",
                                    "anonymous RSS without the index MiB"))


if __name__ == "__main__":
    main()
