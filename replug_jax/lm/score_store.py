"""A content-keyed, resumable store of a frozen LM's per-token log-probs.

Each entry is ``log p(continuation | prompt)`` token by token under one LM, keyed by the
SHA-256 of the (prompt, continuation) text itself, not by a position in some list: a pool
rebuilt with other candidates, another split holding the same pair, or a run on a machine
whose index ranks a near tie the other way all find the pairs already scored, and score only
the rest. The LM is frozen (paper §4.2), so a pair's scores never change.

On disk, a folder: ``store.json`` (the format and the LM's name: a store of another LM is
refused) and parts ``part-<digest>.npz`` written atomically, one per scoring call (its keys,
the log-probs flattened with their offsets, and the seconds the call took, so a rate
survives a resume). Parts are small and never rewritten, so a store can be committed or
copied part by part; a part that cannot be read is skipped with a warning and its pairs are
scored again.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import warnings
import zipfile
from typing import Sequence

import numpy as np

from replug_jax.fileio import atomic_path, write_json_atomic

FORMAT = "replug-lm-scores/1"


def pair_key(prompt: str, continuation: str) -> str:
    """The content key of one (prompt, continuation) pair."""
    return hashlib.sha256(json.dumps([prompt, continuation]).encode("utf-8")).hexdigest()


def scorer_identity(scorer) -> str:
    """What a store is kept for: the LM's name and, in process, its dtype (bfloat16 scores
    are not float32's)."""
    place = getattr(scorer, "place", None)
    return scorer.name if place is None else f"{scorer.name} ({place.dtype.name})"


class ScoreStore:
    """``{pair key: (log-probs [T], seconds spent on it)}`` for one LM, on disk."""

    def __init__(self, directory: str | pathlib.Path, lm: str):
        self.directory = pathlib.Path(directory)
        self.lm = lm
        self.directory.mkdir(parents=True, exist_ok=True)
        key_file = self.directory / "store.json"
        header = {"format": FORMAT, "lm": lm}
        if key_file.exists():
            found = json.loads(key_file.read_text())
            if found != header:
                raise ValueError(f"{self.directory}: a store of LM scores for {found}, not "
                                 f"{header}; use another folder")
        else:
            write_json_atomic(header, key_file)
        self._rows: dict[str, tuple[np.ndarray, float]] = {}
        for part in sorted(self.directory.glob("part-*.npz")):
            self._read(part)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def get(self, key: str) -> tuple[np.ndarray, float]:
        """``(log-probs [T], seconds)``: the pair's share of its scoring call's time."""
        return self._rows[key]

    def add(self, keys: Sequence[str], logprobs: Sequence[np.ndarray], seconds: float) -> None:
        """Keep one scoring call's pairs (``seconds``: the call's time, shared evenly) as a
        new part, written atomically."""
        if len(keys) != len(logprobs):
            raise ValueError(f"{len(keys)} keys for {len(logprobs)} log-prob rows")
        if not keys:
            return
        rows = [np.asarray(r, np.float32).reshape(-1) for r in logprobs]
        offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
        digest = hashlib.sha256("".join(keys).encode()).hexdigest()[:16]
        path = self.directory / f"part-{digest}.npz"
        with atomic_path(path) as tmp, open(tmp, "wb") as f:
            np.savez(f, keys=np.array(keys, dtype="<U64"), offsets=offsets,
                     logprobs=np.concatenate(rows), seconds=np.float64(seconds))
        self._read(path)

    def _read(self, path: pathlib.Path) -> None:
        try:
            with np.load(path, allow_pickle=False) as z:
                keys, offsets = z["keys"], z["offsets"]
                flat, seconds = z["logprobs"], float(z["seconds"])
            if offsets.shape != (len(keys) + 1,) or offsets[-1] != len(flat):
                raise ValueError("offsets do not match the log-probs")
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as err:
            warnings.warn(f"{path}: not a readable part of LM scores ({err}); its pairs will "
                          "be scored again", stacklevel=3)
            return
        share = seconds / max(len(keys), 1)
        for i, key in enumerate(keys.tolist()):
            self._rows[key] = (flat[offsets[i]:offsets[i + 1]], share)
