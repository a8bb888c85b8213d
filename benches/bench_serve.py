"""`replug serve` under load, on loopback: 1, 4 and 16 concurrent clients sending a fixed
number of scoring and greedy-generation requests, with batching on (concurrent requests share
forward passes) and off (``max_batch=1``: one request at a time), measured side by side.

Reports per level: throughput (tokens scored + generated per second), p50 / p99 latency,
errors, and the process's RSS before and after. Usage:
``python -m benches.bench_serve [--requests 32] [--levels 1 4 16]``. Writes
``benches/results/serve.{json,md}``.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import socket
import threading
import time

import httpx
import numpy as np

from benches.common import write

PROMPTS = ["The capital of Germany is Berlin, and the capital of France is",
           "Water boils at one hundred degrees Celsius at sea level, which",
           "The largest planet in the solar system is Jupiter, a gas giant that",
           "Python is a programming language that emphasises readability and",
           "The river Nile flows north through Egypt before it reaches the",
           "In chess, the knight moves in an L shape, two squares in one",
           "Photosynthesis turns light, water and carbon dioxide into",
           "The first person to walk on the Moon was Neil Armstrong, who"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_level(url: str, clients: int, total: int, new_tokens: int) -> dict:
    bodies = []
    for i in range(total):
        prompt = PROMPTS[i % len(PROMPTS)]
        bodies.append({"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0}
                      if i % 2 == 0 else
                      {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0})

    def one(body):
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        seconds = time.perf_counter() - t0
        if r.status_code != 200:
            return seconds, 0, True
        usage = r.json()["usage"]
        return seconds, usage["prompt_tokens"] + usage["completion_tokens"], False

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(one, bodies))
    wall = time.perf_counter() - t0
    latency = np.array([s for s, _, _ in results])
    return {"clients": clients, "requests": total, "wall_s": wall,
            "tokens_per_s": sum(t for _, t, _ in results) / wall,
            "p50_s": float(np.percentile(latency, 50)), "p99_s": float(np.percentile(latency, 99)),
            "errors": sum(e for _, _, e in results)}


def main(argv=None) -> None:
    import uvicorn

    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.serve.app import ServeLimits, create_app

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=32, help="requests per level (default 32)")
    ap.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16],
                    help="concurrent clients per level (default 1 4 16)")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens per generation")
    ap.add_argument("--lm", default="smollm2", help="LM source (default smollm2)")
    args = ap.parse_args(argv)
    lm = FlaxLM.load(args.lm, max_context=512)
    rows, results = [], []
    for mode, limits in (("batched", ServeLimits(max_batch=16, batch_window_s=0.01)),
                         ("one at a time", ServeLimits(max_batch=1, batch_window_s=0.0))):
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(create_app(lm, "bench", limits=limits),
                                               host="127.0.0.1", port=port,
                                               log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        for clients in args.levels:  # warm-up: compile every shape this level will meet
            run_level(url, clients, min(args.requests, 2 * clients), args.new_tokens)
        for clients in args.levels:
            before = rss_mib()
            r = run_level(url, clients, args.requests, args.new_tokens)
            r |= {"mode": mode, "rss_before_mib": before, "rss_after_mib": rss_mib()}
            results.append(r)
            print(r, flush=True)
        server.should_exit = True
        thread.join(timeout=60)
    for r in results:
        base = next(x for x in results if x["mode"] == "one at a time"
                    and x["clients"] == r["clients"])
        r["speedup_vs_one_at_a_time"] = r["tokens_per_s"] / base["tokens_per_s"]
        rows.append((r["mode"], r["clients"], r["requests"], f"{r['tokens_per_s']:.0f}",
                     f"{r['speedup_vs_one_at_a_time']:.2f}x", f"{r['p50_s']:.2f} s",
                     f"{r['p99_s']:.2f} s", r["errors"],
                     f"{r['rss_before_mib']:.0f} → {r['rss_after_mib']:.0f}"))
    write("serve", {"lm": args.lm, "new_tokens": args.new_tokens, "results": results}, rows,
          ("mode", "clients", "requests", "tokens/s", "vs one at a time", "p50", "p99",
           "errors", "RSS MiB"))


if __name__ == "__main__":
    main()
