"""A content-keyed, resumable store of a frozen LM's per-token log-probs.

Each entry is ``log p(continuation | prompt)`` token by token under one LM, keyed by the
SHA-256 of the (prompt, continuation) text itself, not by a position in some list: a pool
rebuilt with other candidates, another split holding the same pair, or a run on a machine
whose index ranks a near tie the other way all find the pairs already scored, and score only
the rest. The LM is frozen (paper §4.2), so a pair's scores never change.

On disk, a folder: ``store.json`` (the format and the LM's name: a store of another LM is
refused) and parts ``part-<digest>.npz`` written atomically, one per scoring call (its keys,
the log-probs flattened with their offsets, and the seconds the call took, so a rate
survives a resume; :class:`StoredLM`'s parts also hold the tokens and prompt lengths). Parts
are small and never rewritten, so a store can be committed or copied part by part; a part
that cannot be read is skipped with a warning and its pairs are scored again.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time
import warnings
import zipfile
from typing import Sequence

import numpy as np

from replug_jax.fileio import atomic_path, write_json_atomic
from replug_jax.lm.scorer import ContinuationScore

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
        self._tokens: dict[str, tuple[np.ndarray, list[str], int]] = {}  # add_scores' pairs
        for part in sorted(self.directory.glob("part-*.npz")):
            self._read(part)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def get(self, key: str) -> tuple[np.ndarray, float]:
        """``(log-probs [T], seconds)``: the pair's share of its scoring call's time."""
        return self._rows[key]

    def continuation(self, key: str) -> ContinuationScore | None:
        """The whole :class:`ContinuationScore` of a pair stored with its tokens
        (:meth:`add_scores`); None when it is absent or was stored as log-probs only."""
        if key not in self._tokens:
            return None
        token_ids, tokens, prompt_tokens = self._tokens[key]
        return ContinuationScore(token_ids, tokens, self._rows[key][0], prompt_tokens)

    def add(self, keys: Sequence[str], logprobs: Sequence[np.ndarray], seconds: float) -> None:
        """Keep one scoring call's pairs (``seconds``: the call's time, shared evenly) as a
        new part, written atomically."""
        self._write(keys, logprobs, seconds)

    def add_scores(self, keys: Sequence[str], scores: Sequence[ContinuationScore],
                   seconds: float) -> None:
        """As :meth:`add`, keeping each pair's token ids, token strings and prompt length too,
        so that :meth:`continuation` gives back what the LM returned."""
        if not keys and not scores:
            return
        tokens = [str(t) for s in scores for t in s.tokens]
        if len(tokens) != sum(len(s.logprobs) for s in scores):
            raise ValueError("a continuation's tokens do not match its log-probs")
        self._write(keys, [s.logprobs for s in scores], seconds, extra={
            "token_ids": np.concatenate([np.asarray(s.token_ids, np.int64).reshape(-1)
                                         for s in scores]),
            "tokens": np.array(tokens, dtype=str) if tokens else np.zeros(0, "<U1"),
            "prompt_tokens": np.array([s.prompt_tokens for s in scores], np.int64)})

    def _write(self, keys, logprobs, seconds: float, extra: dict | None = None) -> None:
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
                     logprobs=np.concatenate(rows), seconds=np.float64(seconds), **(extra or {}))
        self._read(path)

    def _read(self, path: pathlib.Path) -> None:
        try:
            with np.load(path, allow_pickle=False) as z:
                keys, offsets = z["keys"], z["offsets"]
                flat, seconds = z["logprobs"], float(z["seconds"])
                extra = ({name: z[name] for name in ("token_ids", "tokens", "prompt_tokens")}
                         if "tokens" in z.files else None)
            if offsets.shape != (len(keys) + 1,) or offsets[-1] != len(flat):
                raise ValueError("offsets do not match the log-probs")
            if extra is not None and not (len(extra["token_ids"]) == len(extra["tokens"])
                                          == len(flat) == offsets[-1]
                                          and len(extra["prompt_tokens"]) == len(keys)):
                raise ValueError("the tokens do not match the log-probs")
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as err:
            warnings.warn(f"{path}: not a readable part of LM scores ({err}); its pairs will "
                          "be scored again", stacklevel=3)
            return
        share = seconds / max(len(keys), 1)
        for i, key in enumerate(keys.tolist()):
            lo, hi = offsets[i], offsets[i + 1]
            self._rows[key] = (flat[lo:hi], share)
            if extra is not None:
                self._tokens[key] = (extra["token_ids"][lo:hi], extra["tokens"][lo:hi].tolist(),
                                     int(extra["prompt_tokens"][i]))


class StoredLM:
    """An LM scorer whose continuation scores come from a :class:`ScoreStore` where it has
    them and from the LM where it does not (those then added, one part per call): a pipeline
    over it scores each (prompt, continuation) pair once across runs, configurations and
    resumes. Everything else is the LM's own (its name, capabilities, cost meter, tokenizer):
    a pair read from the store costs no LM call."""

    def __init__(self, lm, store: ScoreStore):
        # names of their own, so that the LM's attributes (its ``lm``, its ``store``) show
        self._inner, self._store = lm, store

    def __getattr__(self, name):
        if name in ("_inner", "_store"):  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self._inner, name)

    def score_continuations(self, prompts: Sequence[str], continuations: Sequence[str]
                            ) -> list[ContinuationScore]:
        keys = [pair_key(p, c) for p, c in zip(prompts, continuations, strict=True)]
        todo = {}  # each pair the store lacks, once, in order of first appearance
        for i, key in enumerate(keys):
            if key not in todo and self._store.continuation(key) is None:
                todo[key] = i
        if todo:
            t0 = time.perf_counter()
            scored = self._inner.score_continuations([prompts[i] for i in todo.values()],
                                                 [continuations[i] for i in todo.values()])
            self._store.add_scores(list(todo), scored, time.perf_counter() - t0)
        return [self._store.continuation(key) for key in keys]
