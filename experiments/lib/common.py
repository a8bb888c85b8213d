"""Experiment plumbing: configs with variants, result folders (JSON, Markdown, PNG), provenance."""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys

from replug_jax import config
from replug_jax.fileio import write_text_atomic

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
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
        "command": command_line()}


def command_line() -> str:
    """The command that reproduces this run (``python -m experiments.<name> ...``)."""
    script = pathlib.Path(sys.argv[0]).resolve()
    if script.parent in (EXPERIMENTS, EXPERIMENTS / "lib"):
        package = ".".join(script.parent.relative_to(ROOT).parts)
        head = ["python", "-m", f"{package}.{script.stem}"]
    else:
        head = ["python", sys.argv[0]]
    return shlex.join(head + sys.argv[1:])


def require_data(*parts: str) -> pathlib.Path:
    path = SHARED_DATA.joinpath(*parts)
    if not path.exists():
        raise SystemExit(f"{path} is missing: this experiment needs the evaluation data "
                         "(set REPLUG_SHARED_DATA to its folder)")
    return path


def pick_config(configs: dict, name: str, overrides: list[str]):
    """``configs[name]``, or ``path/to/config.py:variant``, with ``key=value`` overrides coerced
    to each field's type: the loader ``replug train-lsr`` uses (:mod:`replug_jax.config`);
    problems raise :class:`~replug_jax.config.ConfigError`."""
    if ":" in name or name.endswith(".py"):
        return config.load(name, overrides)[0]
    return config.select(configs, name, overrides)


def run(main) -> None:
    """Run an experiment's ``main``; a config or input problem is one line and exit code 2,
    as with the ``replug`` command. XLA programs go to the persistent compilation cache (as
    the command's do), so a resumed run does not compile its shapes again."""
    from replug_jax.cli.common import setup_jax

    setup_jax()
    try:
        main()
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def parse_experiment_args(argv, doc: str, configs: dict, extra=None):
    """``(args, cfg)`` of an experiment script: its docstring as ``--help``, the standard
    options (:func:`add_standard_args`), the script's own (``extra(parser)``) and the chosen
    config with its overrides."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_standard_args(ap, configs)
    if extra is not None:
        extra(ap)
    args = ap.parse_args(argv)
    return args, pick_config(configs, args.config, args.set)


def add_standard_args(ap: argparse.ArgumentParser, configs: dict) -> None:
    ap.add_argument("--config", default="default",
                    help=f"config variant: one of {sorted(configs)}, or path/to/file.py:variant")
    ap.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="override config fields, coerced to each field's type; repeatable: "
                         "--set k=5 --set seed=1 keeps both")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS,
                    help="results root; files go to OUT/<experiment>/<config>.{json,md,png}")
    ap.add_argument("--no-progress", action="store_true", help="hide progress bars")


@functools.lru_cache(maxsize=4)
def load_lm(source: str, max_context: int):
    """A :class:`FlaxLM`, cached per process (experiments run one after another share it)."""
    from replug_jax.lm.flax_scorer import FlaxLM

    return FlaxLM.load(source, max_context=max_context)


@functools.lru_cache(maxsize=4)
def load_retriever(source: str):
    from replug_jax.retrieval.encoder import Retriever

    return Retriever.load(source)


def write_results(name: str, variant: str, payload: dict, table: list[tuple], header: tuple,
                  notes: str = "", root: pathlib.Path = RESULTS,
                  differences: str = "") -> pathlib.Path:
    """``root/<name>/<variant>.json`` + ``.md`` (table + notes), atomically, and the folder's
    ``README.md`` regenerated from every variant there (command, hardware, time, numbers,
    ``differences`` from the paper's setting, the folder's ``CHANGES.md``: results that
    changed, with the old numbers, and its ``TEMPERATURES.md``: the training temperatures and
    Q reduction an LSR study ran with)."""
    out = pathlib.Path(root) / name
    out.mkdir(parents=True, exist_ok=True)
    payload = {**payload, "differences_from_paper": differences}
    write_text_atomic(json.dumps(payload, indent=2, default=str) + "\n",
                      out / f"{variant}.json")
    lines = [f"# {name} ({variant})", "", "| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in table]
    if notes:
        lines += ["", notes]
    (out / f"{variant}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _write_readme(out)
    return out


def current_numbers(folder: pathlib.Path) -> str:
    """The line a results README opens with: which numbers are current (each variant's JSON)
    and the commit and date of the run that wrote them."""
    runs = []
    for js in sorted(folder.glob("*.json")):
        try:
            prov = json.loads(js.read_text()).get("provenance", {})
        except json.JSONDecodeError:
            continue
        runs.append(f"`{js.stem}` (commit `{str(prov.get('git_commit', '?'))[:10]}`, "
                    f"{str(prov.get('date', '?'))[:10]})")
    return ("**Current numbers**: those of " + ", ".join(runs) + "; each section below is its "
            "variant's JSON. Superseded numbers are under \"Changed results\"."
            if runs else "**Current numbers**: none yet.")


def _write_readme(folder: pathlib.Path) -> None:
    """The folder's README: every variant's JSON, table and plot. How the runs differ from the
    paper is said once when every variant states the same, else in each variant's section (a
    folder can hold variants of other datasets, or runs stated before the text changed)."""
    runs = {}
    for js in sorted(folder.glob("*.json")):
        try:
            runs[js] = json.loads(js.read_text())
        except json.JSONDecodeError:
            continue
    stated = {d.get("differences_from_paper") or "" for d in runs.values()} - {""}
    shared = len(stated) <= 1
    parts = [f"# {folder.name}: results", "", current_numbers(folder), "",
             "Regenerated by the script after every run; one section per config variant.", ""]
    if stated and shared:
        parts += ["## How this differs from the paper", "", *stated, ""]
    changes = folder / "CHANGES.md"  # results that changed, the old numbers beside the new
    if changes.exists():
        parts += ["## Changed results", "", changes.read_text().strip(), ""]
    temperatures = folder / "TEMPERATURES.md"  # the γ, β and Q an LSR study trained with
    if temperatures.exists():
        parts += ["## Training temperatures and Q", "", temperatures.read_text().strip(), ""]
    for js, data in runs.items():
        prov = data.get("provenance", {})
        md = folder / f"{js.stem}.md"
        parts += [f"## `{js.stem}`", "",
                  f"- command: `{prov.get('command', '?')}`",
                  f"- hardware: {prov.get('cpu_count', '?')} CPU cores, JAX backend "
                  f"{prov.get('backend', '?')} ({', '.join(prov.get('devices', [])[:1])})",
                  f"- time: {data.get('seconds', float('nan')):.0f} s; date {prov.get('date', '?')}"
                  f"; commit `{prov.get('git_commit', '?')[:10]}`", ""]
        if not shared and data.get("differences_from_paper"):
            parts += [f"How this differs from the paper: {data['differences_from_paper']}", ""]
        if md.exists():
            parts += md.read_text().splitlines()[2:] + [""]
        if (folder / f"{js.stem}.png").exists():
            parts += [f"![{js.stem}]({js.stem}.png)", ""]
    write_text_atomic("\n".join(parts), folder / "README.md")


def new_figure(ncols: int = 1, figsize=(5, 3), **kwargs):
    """``(fig, axes)`` from ``plt.subplots`` on the file-only Agg backend (no display)."""
    from replug_jax.imports import require

    matplotlib = require("matplotlib", "experiments", "plotting experiment results")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize, **kwargs)


def save_figure(fig, path: pathlib.Path) -> None:
    """Write ``fig`` as a PNG; a variant's plot beside its results JSON also joins the folder's
    README (the scripts plot after ``write_results`` has written it)."""
    path = pathlib.Path(path)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    if path.with_suffix(".json").exists() and (path.parent / "README.md").exists():
        _write_readme(path.parent)

