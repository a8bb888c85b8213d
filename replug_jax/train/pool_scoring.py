"""The frozen LM's scores of a pool's (example, candidate) pairs, computed once through the
score store, resumable (paper §4.2's ``Q``, at a cost a CPU can pay:
:mod:`replug_jax.train.pool`)."""

from __future__ import annotations

import hashlib
import json
import pathlib
import time
from typing import Sequence

import numpy as np

from replug_jax.fileio import write_json_atomic
from replug_jax.lm.score_store import ScoreStore, scorer_identity
from replug_jax.train.data import Example
from replug_jax.train.supervision import branch_keys


def score_pairs(examples: Sequence[Example], candidates_EM: np.ndarray, passages_by_id: dict,
                scorer, directory: str | pathlib.Path, provenance: dict, *,
                separator: str = "\n\n", part_size: int = 32, progress: bool = True,
                store: ScoreStore | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """``(log-probs [E, M, T], target tokens [E], provenance)`` of every (example, candidate)
    pair (candidates ``-1``: none; an example may have none), scored once.

    The pairs live in ``store`` (:class:`~replug_jax.lm.score_store.ScoreStore`, keyed by
    the pairs' text; default ``directory/lm_scores``): those it holds are read, the others are
    scored ``part_size`` examples per LM call (``scorer`` buckets them by length; document KV
    reuse shares a passage among a call's examples) and each call's pairs are added to it as
    one atomic part, so a killed build resumes at the first call it lacks, and pools of other
    candidates, splits or runs share their pairs through it. ``directory`` keeps the build's
    key (``build.json``): a folder of another build (``provenance`` or the candidates differ)
    is refused. The provenance returned adds the pairs/s measured, from the scoring time the
    store keeps with each pair (so a resumed or reloaded build still states it).
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
    store = store if store is not None else ScoreStore(d / "lm_scores", scorer_identity(scorer))
    e, m = candidates_EM.shape
    bar = tqdm(total=int((candidates_EM >= 0).sum()), desc="scoring the pool", unit="pair",
               disable=not progress)
    rows = {}  # (example, slot) -> (log-probs, seconds)
    for lo in range(0, e, part_size):
        pairs = [(i, j) for i in range(lo, min(e, lo + part_size)) for j in range(m)
                 if candidates_EM[i, j] >= 0]
        exs = [examples[i] for i, _ in pairs]
        keys, prompts = branch_keys(exs, [passages_by_id[int(candidates_EM[i, j])]
                                          for i, j in pairs], scorer, separator)
        todo = {key: n for n, key in enumerate(keys) if key not in store}  # each pair once
        if todo:
            t0 = time.perf_counter()
            scored = scorer.score_continuations([prompts[n] for n in todo.values()],
                                                [exs[n].continuation for n in todo.values()])
            store.add(list(todo), [r.logprobs for r in scored], time.perf_counter() - t0)
        rows.update((pair, store.get(key)) for pair, key in zip(pairs, keys))
        bar.update(len(pairs))
    bar.close()
    lp_EMT = np.zeros((e, m, max((len(r) for r, _ in rows.values()), default=1)), np.float32)
    n_tok_E = np.zeros(e, np.int64)
    for (i, j), (r, _) in rows.items():
        lp_EMT[i, j, :len(r)] = r
        n_tok_E[i] = len(r)
    seconds = sum(t for _, t in rows.values())
    measured = {"pairs": len(rows)}
    if rows and seconds > 0:
        measured.update(pairs_timed=len(rows), pairs_per_second=round(len(rows) / seconds, 3))
    return lp_EMT, n_tok_E, {**provenance, **measured}
