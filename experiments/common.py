"""Experiment plumbing: configs with variants, result folders (JSON, Markdown, PNG), provenance."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
SHARED_DATA = pathlib.Path(os.environ.get("REPLUG_SHARED_DATA", ROOT.parent / "shared" / "data"))


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance() -> dict:
    import jax

    return {"git_commit": git_commit(), "date": datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"), "python": platform.python_version(),
        "jax": jax.__version__, "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()], "cpu_count": os.cpu_count(),
        "command": " ".join([pathlib.Path(sys.executable).name] + sys.argv)}


def require_data(*parts: str) -> pathlib.Path:
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        raise SystemExit(f"{path} is missing: this experiment needs the evaluation data "
                         "(set REPLUG_SHARED_DATA to its folder)")
    return path


def pick_config(configs: dict, name: str, overrides: list[str]):
    """``configs[name]`` with ``key=value`` overrides (values parsed as JSON when possible)."""
    if name not in configs:
        raise SystemExit(f"unknown config {name!r}; choose from {sorted(configs)}")
    cfg = configs[name]
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    changes = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in fields:
            raise SystemExit(f"unknown config key {key!r}; keys: {sorted(fields)}")
        try:
            changes[key] = json.loads(value)
        except json.JSONDecodeError:
            changes[key] = value
    return dataclasses.replace(cfg, **changes)


def write_results(name: str, variant: str, payload: dict, table: list[tuple], header: tuple,
                  notes: str = "") -> pathlib.Path:
    """``experiments/results/<name>/<variant>.json`` + ``.md`` (table + notes), atomically."""
    out = RESULTS / name
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f"{variant}.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    tmp.replace(out / f"{variant}.json")
    lines = [f"# {name} ({variant})", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table]
    if notes:
        lines += ["", notes]
    (out / f"{variant}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return out


class Stopwatch:
    def __enter__(self):
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
