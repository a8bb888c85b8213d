"""The API scorer against `replug serve` on loopback: one prompt per scoring request against
many (``prompt: [...]``, which the probe found the server takes), the same pairs and the same
concurrency, measured in one run.

Reports requests/s and prompts (pairs)/s of each setting and the ratio, and checks the scores
agree. Usage: ``python -m benches.bench_api_scoring [--pairs 64] [--batch-size 16]
[--concurrency 4]``. Writes ``benches/results/api_scoring.{json,md}``.
"""

from __future__ import annotations

import argparse
import threading
import time

import numpy as np

from benches.bench_serve import PROMPTS, free_port
from benches.common import write


def main(argv=None) -> None:
    import uvicorn

    from replug_jax.lm.api_scorer import APIScorer
    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.serve.app import ServeLimits, create_app

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=64, help="pairs scored per setting")
    ap.add_argument("--batch-size", type=int, default=16, help="prompts per batched request")
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    ap.add_argument("--lm", default="smollm2", help="LM source (default smollm2)")
    args = ap.parse_args(argv)
    lm = FlaxLM.load(args.lm, max_context=512)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(
        create_app(lm, "bench", limits=ServeLimits(max_batch=16, batch_window_s=0.01)),
        host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    prompts = [PROMPTS[i % len(PROMPTS)].rsplit(" ", 3)[0] for i in range(args.pairs)]
    conts = [" " + " ".join(PROMPTS[i % len(PROMPTS)].rsplit(" ", 3)[1:])
             for i in range(args.pairs)]
    out, scores = {"lm": args.lm, "pairs": args.pairs, "concurrency": args.concurrency}, {}
    for name, size in (("one prompt per request", 1), ("many per request", args.batch_size)):
        api = APIScorer.connect(url, model="bench", batch_size=size,
                                concurrency=args.concurrency)
        api.score_continuations(prompts[:size * args.concurrency],
                                conts[:size * args.concurrency])  # warm-up: compile shapes
        calls = api.cost.snapshot()["lm_calls"]
        t0 = time.perf_counter()
        scores[name] = api.score_continuations(prompts, conts)
        wall = time.perf_counter() - t0
        requests = api.cost.snapshot()["lm_calls"] - calls
        out[name] = {"batch_size": size, "prompt_lists": api.server.prompt_lists,
                     "requests": requests, "seconds": wall,
                     "requests_per_s": requests / wall, "prompts_per_s": args.pairs / wall}
        api.close()
    server.should_exit = True
    one, many = out["one prompt per request"], out["many per request"]
    out["speedup"] = many["prompts_per_s"] / one["prompts_per_s"]
    out["max_abs_diff"] = max(float(np.abs(a.logprobs - b.logprobs).max()) for a, b in zip(
        scores["one prompt per request"], scores["many per request"]))
    rows = [(name, out[name]["batch_size"], out[name]["requests"],
             f"{out[name]['requests_per_s']:.2f}", f"{out[name]['prompts_per_s']:.2f}",
             "1.00x" if out[name] is one else f"{out['speedup']:.2f}x")
            for name in ("one prompt per request", "many per request")]
    rows.append(("max |Δ log p| between them", "", "", "", f"{out['max_abs_diff']:.1e}", ""))
    write("api_scoring", out, rows, ("setting", "prompts per request", "requests",
                                     "requests/s", "prompts/s", "ratio"))


if __name__ == "__main__":
    main()
