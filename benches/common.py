"""Benchmark plumbing: timing, the machine's measured matmul peak, JSON + Markdown output."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp

# REPLUG_BENCH_OUT redirects results (the device check writes them under its own folder).
RESULTS = pathlib.Path(os.environ.get("REPLUG_BENCH_OUT",
                                     pathlib.Path(__file__).resolve().parent / "results"))


def best_time(fn, repeats: int = 3, warmup: int = 1) -> float:
    """Best wall time of ``fn()`` (which must block until its result is ready)."""
    return best_times({"fn": fn}, repeats, warmup)["fn"]


def best_times(fns: dict, repeats: int = 3, warmup: int = 1, settle: float = 0.1) -> dict:
    """Best wall time of each ``fns[name]()``, the contenders run in alternation (one round
    is one call of each), so that a slow spell of a shared host weighs on all of them rather
    than on whichever happened to run then. Each must block until its result is ready.

    Each timed call starts ``settle`` seconds after the previous one ends: right after a
    call, its thread pool still spins (OpenMP's, XLA's) and slows the next contender. Measured
    on a 4352×384·384×1536 matmul, JAX then PyTorch back to back: 148 vs 167 GFLOP/s; with
    0.05 s between them 154 vs 153, as each runs alone (157 vs 155)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            time.sleep(settle)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: min(ts) for name, ts in times.items()}


def matmul_peak_flops(n: int | None = None, dtype=jnp.float32) -> float:
    """Measured FLOP/s of a jitted square matmul on the default device (the 'peak').

    ``n`` defaults to 2048 on CPU and 8192 on accelerators (smaller products leave a GPU idle).
    """
    n = n or (2048 if jax.default_backend() == "cpu" else 8192)
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    t = best_time(lambda: f(a, a).block_until_ready(), repeats=5)
    return 2 * n**3 / t


def torch_device() -> str:
    """Where the PyTorch reference runs: the GPU when JAX runs on one and torch sees it."""
    import torch

    return "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"


def torch_synced(fn, device: str):
    """``fn`` followed by a device synchronisation, so that wall time covers the GPU work."""
    import torch

    def run():
        out = fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return out

    return run


def torch_causal_lm(source: str, dtype: str, device: str):
    """The PyTorch reference for an LM source (packaged name, HF folder or ``.gguf``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from replug_jax.models.weights import resolve

    resolved = resolve(source)
    kwargs = {"dtype": getattr(torch, dtype)}
    if resolved.kind == "gguf":
        kwargs["gguf_file"] = resolved.path.name
        path = resolved.path.parent
    else:
        path = resolved.path
    return AutoModelForCausalLM.from_pretrained(str(path), **kwargs).to(device).eval()


def available_memory(device=None) -> int:
    """Bytes a computation on ``device`` (default: JAX's first) can still allocate: the
    accelerator's limit minus what is in use, or the host's available memory on a CPU."""
    stats = (device or jax.devices()[0]).memory_stats()
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def machine() -> dict:
    dev = jax.devices()[0]
    return {"platform": dev.platform, "device": getattr(dev, "device_kind", str(dev)),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "jax": jax.__version__}


def write(name: str, result: dict, table_rows: list[tuple], header: tuple) -> pathlib.Path:
    """``benches/results/<name>.json`` and ``.md`` (a short Markdown table)."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine(), **result}
    (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# {name}", "", f"machine: {result['machine']}", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table_rows]
    md = RESULTS / f"{name}.md"
    md.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return md
