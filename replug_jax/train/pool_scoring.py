"""The frozen LM's scores of a pool's (example, candidate) pairs, computed once, part by
part, resumable (paper §4.2's ``Q``, at a cost a CPU can pay: :mod:`replug_jax.train.pool`)."""

from __future__ import annotations

import hashlib
import json
import pathlib
import time
import zipfile
from typing import Sequence

import numpy as np

from replug_jax.fileio import atomic_path, write_json_atomic
from replug_jax.lm.score_store import ScoreStore, pair_key
from replug_jax.train.data import Example
from replug_jax.train.supervision import branch_prompts


def score_pairs(examples: Sequence[Example], candidates_EM: np.ndarray, passages_by_id: dict,
                scorer, directory: str | pathlib.Path, provenance: dict, *,
                separator: str = "\n\n", part_size: int = 32, progress: bool = True,
                store: ScoreStore | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """``(log-probs [E, M, T], target tokens [E], provenance)`` of every (example, candidate)
    pair (candidates ``-1``: none; an example may have none), scored once.

    Pairs are scored ``part_size`` examples at a time (``scorer`` buckets them by length) and
    each part is written as its own file in ``directory``, so a killed build resumes at the
    first missing part; a folder holding parts of another build (``provenance`` or the
    candidates differ) is refused. The provenance returned adds the pairs/s measured, from
    the scoring time each part keeps (so a resumed or reloaded build still states it).
    With a ``store`` (:class:`~replug_jax.lm.score_store.ScoreStore`, keyed by the pairs'
    text), a part's pairs already in it are not scored again, and those scored are added:
    pools of other candidates, splits or runs share their pairs through it.
    """
    from tqdm.auto import tqdm

    d = pathlib.Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    key_path = d / "build.json"
    candidates_EM = np.asarray(candidates_EM, np.int64)
    # Everything the scores depend on is in the key (the separator and the part size too),
    # compared after the JSON round trip it makes on disk (tuples come back as lists).
    provenance = json.loads(json.dumps({
        **provenance, "separator": separator, "part_size": part_size,
        "candidates_sha256": hashlib.sha256(
            np.ascontiguousarray(candidates_EM).tobytes()).hexdigest()}))
    if key_path.exists() and json.loads(key_path.read_text()) != provenance:
        raise ValueError(f"{d}: holds parts of a pool built with other settings; use another "
                         "folder or delete it")
    write_json_atomic(provenance, key_path)
    e, m = candidates_EM.shape
    parts = range(0, e, part_size)
    bar = tqdm(total=int((candidates_EM >= 0).sum()), desc="scoring the pool", unit="pair",
               disable=not progress)
    seconds, scored = 0.0, 0
    for lo in parts:
        path = d / f"part-{lo // part_size:05d}.npz"
        hi = min(e, lo + part_size)
        pairs = [(i, j) for i in range(lo, hi) for j in range(m) if candidates_EM[i, j] >= 0]
        if path.exists() and _part_readable(path, hi - lo, m):
            bar.update(len(pairs))
            continue
        exs = [examples[i] for i, _ in pairs]
        prompts = branch_prompts(exs, [passages_by_id[int(candidates_EM[i, j])]
                                       for i, j in pairs], scorer, separator)
        rows, seconds_part = _score(prompts, [ex.continuation for ex in exs], scorer, store)
        t = max((len(r) for r in rows), default=1)
        lp = np.zeros((hi - lo, m, t), np.float32)
        n_tok = np.zeros(hi - lo, np.int64)
        for (i, j), r in zip(pairs, rows):
            lp[i - lo, j, :len(r)] = r
            n_tok[i - lo] = len(r)
        with atomic_path(path) as tmp, open(tmp, "wb") as f:  # its time: the rate survives
            np.savez(f, logprobs=lp, tokens=n_tok, seconds=seconds_part)
        bar.update(len(pairs))
    bar.close()
    t_max = 0
    loaded = []
    for lo in parts:
        with np.load(d / f"part-{lo // part_size:05d}.npz", allow_pickle=False) as z:
            loaded.append((z["logprobs"], z["tokens"]))
            t_max = max(t_max, z["logprobs"].shape[-1])
            if "seconds" in z.files:  # parts written before the time was kept have none
                seconds += float(z["seconds"])
                scored += int((candidates_EM[lo:lo + part_size] >= 0).sum())
    lp_EMT = np.concatenate([np.pad(a, ((0, 0), (0, 0), (0, t_max - a.shape[-1])))
                             for a, _ in loaded])
    n_tok_E = np.concatenate([b for _, b in loaded])
    measured = {"pairs": int((candidates_EM >= 0).sum())}
    if scored:
        measured.update(pairs_timed=scored, pairs_per_second=round(scored / seconds, 3))
    return lp_EMT, n_tok_E, {**provenance, **measured}


def _score(prompts: list[str], continuations: list[str], scorer, store: ScoreStore | None
           ) -> tuple[list[np.ndarray], float]:
    """Per pair its log-probs, and the seconds they cost: the LM's call for the pairs the
    ``store`` lacks, plus the stored pairs' shares of the calls that scored them."""
    keys = [pair_key(p, c) for p, c in zip(prompts, continuations)]
    todo = [n for n, key in enumerate(keys) if store is None or key not in store]
    t0 = time.perf_counter()
    results = scorer.score_continuations([prompts[n] for n in todo],
                                         [continuations[n] for n in todo]) if todo else []
    seconds = time.perf_counter() - t0
    fresh = {n: np.asarray(r.logprobs, np.float32) for n, r in zip(todo, results)}
    if store is not None:
        store.add([keys[n] for n in todo], [fresh[n] for n in todo], seconds)
        seconds += sum(store.get(key)[1] for n, key in enumerate(keys) if n not in fresh)
    return [fresh[n] if n in fresh else store.get(key)[0] for n, key in enumerate(keys)], seconds


def _part_readable(path: pathlib.Path, rows: int, m: int) -> bool:
    """Whether a pool part is whole (a part cut short by a crash of the disk or the machine
    is rescored, with a warning, instead of stopping the build)."""
    import warnings

    try:
        with np.load(path, allow_pickle=False) as z:
            if z["logprobs"].shape[:2] == (rows, m) and z["tokens"].shape == (rows,):
                return True
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
        pass
    warnings.warn(f"{path}: unreadable or of the wrong shape; scoring that part again",
                  stacklevel=3)
    return False
