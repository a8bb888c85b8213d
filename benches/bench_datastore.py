"""The datastore at scale: build, load and search synthetic indexes of millions of passages.

For each size N (default 1M and 4M) a synthetic datastore (``benches/synthetic.py``: a passage
store and 384-d clustered embeddings) goes through ``replug index build --embeddings`` with
Flat, IVF-Flat and IVF-PQ, each in a fresh process so that its **peak RSS** is its own. Another
fresh process loads the index (memory-mapped) and searches it: load time, RSS after load, QPS
at batch 64 and k = 20, and recall@10 against the Flat index's exact top-10. Finally one real
``replug index search`` (query encoded by MiniLM) on the largest IVF-PQ index.

Usage: ``python -m benches.bench_datastore [--sizes 1000000 4000000] [--work DIR]``.
Writes ``benches/results/datastore.{json,md}``. Needs about 3.2 GB of disk per million
passages (embeddings, Flat and IVF-Flat indexes).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

from benches.common import write

QUERIES = 1024
BATCH = 64
K = 20


def rss_mib(field: str = "VmRSS") -> float:
    """Resident memory; ``RssAnon`` is the process's own, ``RssFile`` mapped file pages (page
    cache the kernel can drop, shared with every process mapping the file)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def peak_mib() -> float:
    """This process's peak resident memory (VmHWM: unlike ``ru_maxrss``, it is not inherited
    from the parent across fork and exec)."""
    return rss_mib("VmHWM")


def dir_bytes(path: pathlib.Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def child(argv: list[str]) -> None:
    """One measured step in a fresh process; prints one JSON line."""
    step, data, idx = argv[0], pathlib.Path(argv[1]), pathlib.Path(argv[2])
    if step == "build":
        from replug_jax.cli import main as cli

        factory, nprobe, rerank = argv[3], argv[4], argv[5]
        t0 = time.perf_counter()
        code = cli(["index", "build", "--corpus", str(data / "passages.arrow"), "--embeddings",
                    str(data / "emb.npy"), "--factory", factory, "--nprobe", nprobe,
                    "--rerank", rerank, "--out", str(idx), "--json"])
        assert code == 0
        out = {"build_s": time.perf_counter() - t0, "build_peak_rss_mib": peak_mib()}
    elif step == "search":
        from benches.synthetic import Generator
        from replug_jax.retrieval import Index

        queries = Generator().queries(QUERIES)
        rss0 = rss_mib()
        t0 = time.perf_counter()
        index = Index.load(idx)
        load_s = time.perf_counter() - t0
        rss_load = rss_mib() - rss0
        out = {"load_s": load_s, "rss_after_load_mib": rss_load, "by_nprobe": {}}
        for nprobe in [int(x) for x in argv[3].split(",")]:
            index.set_nprobe(nprobe)
            index.search(queries[:BATCH], K)  # warm-up
            t0 = time.perf_counter()
            ids = np.concatenate([index.search(queries[i:i + BATCH], K).ids
                                  for i in range(0, QUERIES, BATCH)])
            seconds = time.perf_counter() - t0
            np.save(idx.with_suffix(f".ids{nprobe}.npy"), ids[:, :10])
            out["by_nprobe"][nprobe] = {"qps": QUERIES / seconds}
        out |= {"rss_after_search_mib": rss_mib() - rss0, "search_peak_rss_mib": peak_mib()}
    elif step == "store":  # random access into the memory-mapped passage store
        from replug_jax.retrieval.store import PassageStore

        anon0, file0 = rss_mib("RssAnon"), rss_mib("RssFile")
        t0 = time.perf_counter()
        store = PassageStore.open(data / "passages.arrow")
        open_s = time.perf_counter() - t0
        ids = np.random.default_rng(0).integers(len(store), size=10000)
        t0 = time.perf_counter()
        for i in ids[:2000]:
            store[int(i)]
        one_us = (time.perf_counter() - t0) / 2000 * 1e6
        t0 = time.perf_counter()
        for start in range(0, len(ids), 64 * 20):  # a search's passages: batch 64 x k 20
            store.take(ids[start:start + 64 * 20])
        batch_us = (time.perf_counter() - t0) / len(ids) * 1e6
        out = {"n": len(store), "open_s": open_s, "lookup_us": one_us,
               "lookup_in_batches_us": batch_us,
               "rss_anon_after_mib": rss_mib("RssAnon") - anon0,
               "rss_file_after_mib": rss_mib("RssFile") - file0,
               "file_mib": (data / "passages.arrow").stat().st_size / 2**20}
    else:  # the real command, query encoded by the packaged MiniLM
        from replug_jax.cli import main as cli

        t0 = time.perf_counter()
        assert cli(["index", "search", str(idx), "how are dense indexes sharded?", "-k",
                    str(K), "--json"]) == 0
        out = {"cli_search_s": time.perf_counter() - t0, "cli_search_peak_rss_mib": peak_mib()}
    print("RESULT " + json.dumps(out))


def run_child(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "benches.bench_datastore", "_child", *args],
                          capture_output=True, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"step {args[:1]} failed:\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        return child(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 4_000_000],
                    help="datastore sizes N (default 1M and 4M)")
    ap.add_argument("--factories", nargs="+",
                    default=["Flat", "IVF{nlist},Flat", "OPQ64,IVF{nlist},PQ64"],
                    help="FAISS factories; {nlist} becomes 2·sqrt(N) rounded to a power of 2")
    ap.add_argument("--nprobe", type=int, nargs="+", default=[16, 64, 256],
                    help="IVF lists searched, each measured (default 16 64 256)")
    ap.add_argument("--work", type=pathlib.Path, default=pathlib.Path("/tmp/replug_datastore"),
                    help="scratch folder (datastores are kept there for reruns)")
    ap.add_argument("--keep", action="store_true", help="keep the built indexes")
    ap.add_argument("--rerank", type=int, default=0, metavar="F",
                    help="build PQ indexes with exact re-ranking of F x k candidates from "
                    "float16 vectors on disk (default 0: off)")
    ap.add_argument("--name", default="datastore", help="results file name")
    ap.add_argument("--store-only", action="store_true",
                    help="only the passage store's random-access latency and RSS "
                    "(datastore_store.{json,md})")
    args = ap.parse_args(argv)
    from benches.synthetic import write_datastore

    if args.store_only:
        rows, results = [], []
        for n in args.sizes:
            data = args.work / f"n{n}"
            if not (data / "passages.arrow").exists():
                write_datastore(data, n)
            r = run_child("store", str(data), str(data))
            results.append(r)
            rows.append((f"{n:,}", f"{r['file_mib']:.0f}", f"{r['open_s'] * 1e3:.1f} ms",
                         f"{r['lookup_us']:.0f} µs", f"{r['lookup_in_batches_us']:.1f} µs",
                         f"{r['rss_anon_after_mib']:.0f}", f"{r['rss_file_after_mib']:.0f}"))
        write("datastore_store", {"results": results}, rows,
              ("N", "passages.arrow MiB", "open", "one lookup by id",
               "per passage, 1280 at a time", "own memory (RssAnon) after 10k lookups, MiB",
               "mapped file pages (RssFile), MiB"))
        return

    rows, results = [], []
    for n in args.sizes:
        data = args.work / f"n{n}"
        if not (data / "emb.npy").exists():
            t0 = time.perf_counter()
            write_datastore(data, n)
            print(f"generated N={n} in {time.perf_counter() - t0:.0f} s", flush=True)
        nlist = 1 << int(round(np.log2(2 * np.sqrt(n))))
        truth = data / f"exact_top10_q{QUERIES}.npy"  # from a Flat run, kept for later runs
        exact = np.load(truth) if truth.exists() else None
        for template in args.factories:
            factory = template.format(nlist=nlist)
            idx = data / ("idx-" + factory.replace(",", "_"))
            shutil.rmtree(idx, ignore_errors=True)
            nprobes = args.nprobe if "IVF" in factory else [0]
            rerank = args.rerank if "PQ" in factory else 0
            r = {"n": n, "factory": factory + (f" + rerank {rerank}x" if rerank else "")}
            r |= run_child("build", str(data), str(idx), factory, str(nprobes[0] or 16),
                           str(rerank))
            r["disk_mib"] = dir_bytes(idx) / 2**20
            r |= run_child("search", str(data), str(idx), ",".join(map(str, nprobes)))
            for nprobe in nprobes:
                ids = np.load(idx.with_suffix(f".ids{nprobe}.npy"))
                if factory == "Flat":
                    exact = ids
                    np.save(truth, ids)
                m = r["by_nprobe"][str(nprobe)]
                if exact is not None:
                    m["recall_at_10"] = float(np.mean([len(set(a) & set(b)) / 10
                                                       for a, b in zip(ids, exact)]))
                rows.append((f"{n:,}", r["factory"], nprobe or "", f"{r['build_s']:.0f} s",
                             f"{r['build_peak_rss_mib']:.0f}", f"{r['disk_mib']:.0f}",
                             f"{r['load_s']:.2f} s", f"{r['rss_after_load_mib']:.0f}",
                             f"{r['search_peak_rss_mib']:.0f}", f"{m['qps']:.0f}",
                             f"{m.get('recall_at_10', float('nan')):.3f}"))
            if factory == args.factories[-1].format(nlist=nlist) and n == max(args.sizes):
                r |= run_child("cli", str(data), str(idx))
            for f in data.glob(idx.name + ".ids*.npy"):
                f.unlink()
            if not args.keep:
                shutil.rmtree(idx, ignore_errors=True)
            print(json.dumps(r), flush=True)
            results.append(r)
    write(args.name, {"queries": QUERIES, "batch": BATCH, "k": K, "results": results}, rows,
          ("N", "factory", "nprobe", "build", "build peak RSS MiB", "disk MiB", "load",
           "RSS after load MiB", "search peak RSS MiB", "QPS (batch 64, k 20)",
           "recall@10 vs exact"))


if __name__ == "__main__":
    main()
