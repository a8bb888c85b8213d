"""Which step of an LSR run is kept: the dev curve read every ``eval_every`` steps, the best
point under the config's ``select_on`` (with early stopping after ``patience`` evaluations
without a new best), and the parameters of that point, all kept in the work directory so that
a resumed run selects exactly as an uninterrupted one.

Files: ``curve.jsonl`` (one line per evaluation, step 0 = the base retriever), ``best.npz``
with ``best.json`` (the kept parameters and their curve point), ``selection.json`` (written
once the run has ended: by its budget or by early stopping).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from replug_jax.fileio import atomic_path, write_json_atomic, write_text_atomic
from replug_jax.train.refresh import flatten_params, unflatten_params


def read_jsonl(path: pathlib.Path) -> list[dict]:
    """The records of a JSON-lines log; a last line cut short (an interrupted append, a full
    disk) is dropped, any other unreadable line is refused naming the file and line."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as err:
            if number == len(lines):  # an append cut short: that step is redone
                break
            raise ValueError(f"{path}, line {number}: not JSON ({err.msg}); the log is "
                             "damaged: delete the lines from there on to resume") from None
    return out


class Selection:
    """The selection rule of a config (``select_on``, ``patience``)."""

    def __init__(self, select_on: str, patience: int):
        self.select_on, self.patience = select_on, patience

    def value(self, entry: dict, base: dict) -> float:
        """Lower is better; inf: not eligible (recall@1's guard: a step whose dev-pool
        log-likelihood is below the base's is never kept)."""
        if self.select_on == "pool_loglik":
            return entry["dev_bpb"]
        if self.select_on == "recall@1":
            if entry["dev_loglik"] < base["dev_loglik"]:
                return float("inf")
            return -entry["dev_recall@1"]
        return -entry["step"]  # "last": a fixed budget, the last point is the result

    def replay(self, curve: list[dict]) -> tuple[int, int]:
        """(best step, evaluations since it) of a curve, as the run saw them."""
        best_value, best_step, since = self.value(curve[0], curve[0]), 0, 0
        for entry in curve[1:]:
            value = self.value(entry, curve[0])
            if value < best_value:
                best_value, best_step, since = value, entry["step"], 0
            else:
                since += 1
        return best_step, since

    def stops(self, since_best: int) -> bool:
        return self.select_on != "last" and 0 < self.patience <= since_best


class Curve:
    """The dev curve and the kept parameters of one work directory."""

    def __init__(self, workdir: pathlib.Path, selection: Selection):
        self.dir, self.selection = workdir, selection
        self.path = workdir / "curve.jsonl"
        self.points: list[dict] = []

    def resume(self, step: int) -> None:
        """Read the curve back to the restored ``step`` (later points are redone)."""
        self.points = [p for p in read_jsonl(self.path) if p["step"] <= step]
        write_text_atomic("".join(json.dumps(p) + "\n" for p in self.points), self.path)

    def add(self, entry: dict, params) -> bool:
        """Record a point; keep ``params`` when it is the new best. Returns whether the run
        should stop now (patience spent)."""
        self.points.append(entry)
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")
        best_step, since = self.selection.replay(self.points)
        if best_step == entry["step"]:
            with atomic_path(self.dir / "best.npz") as tmp, open(tmp, "wb") as f:
                np.savez(f, **flatten_params(params))
            write_json_atomic(entry, self.dir / "best.json")
        return self.selection.stops(since)

    def best(self, like) -> tuple[dict, object]:
        """The kept point and its parameters (shaped like ``like``)."""
        entry = json.loads((self.dir / "best.json").read_text())
        with np.load(self.dir / "best.npz", allow_pickle=False) as z:
            return entry, unflatten_params(dict(z), like)

    def finish(self, step: int, early: bool) -> None:
        write_json_atomic({"ended_at": step, "stopped_early": early,
                           "best_step": self.selection.replay(self.points)[0]},
                          self.dir / "selection.json")

    def ended(self) -> dict | None:
        path = self.dir / "selection.json"
        return json.loads(path.read_text()) if path.exists() else None
