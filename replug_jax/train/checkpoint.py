"""LSR checkpoints: the train state (orbax) with JSON metadata, saved and restored.

A corrupt or partial latest checkpoint falls back to the previous one, with a warning. In a
multi-process run every process restores the *same* step: the newest one that every process
can read (their lists of readable steps are gathered and intersected), and if restoring it
fails on any process, all of them fall back together.
"""

from __future__ import annotations

import json
import pathlib
import warnings

import jax
import numpy as np

from replug_jax.train.lsr import TrainState


class Checkpoints:
    """The ``checkpoints/`` folder of a work directory."""

    def __init__(self, directory: str | pathlib.Path, keep: int = 3):
        self.directory = pathlib.Path(directory).resolve()
        self.keep = keep
        self._manager = None

    @property
    def manager(self):
        if self._manager is None:
            import orbax.checkpoint as ocp

            self._manager = ocp.CheckpointManager(
                self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=self.keep,
                                                                     create=True))
        return self._manager

    def save(self, step: int, state: TrainState, meta: dict) -> None:
        import orbax.checkpoint as ocp

        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        self.manager.wait_until_finished()

    def restore(self, like: TrainState, step: int | None = None
                ) -> tuple[int, TrainState | None, dict | None]:
        """``(step, state, meta)`` of the newest readable checkpoint (or of ``step``, which
        must exist and be readable), shaped and sharded like ``like``; ``(0, None, None)``
        when there is none."""
        import orbax.checkpoint as ocp

        steps = sorted(self.manager.all_steps(), reverse=True)
        if step is not None:
            if step not in steps:
                raise ValueError(f"{self.directory}: no checkpoint at step {step} "
                                 f"(saved: {sorted(steps)})")
            steps = [step]
        agreed = newest_common(_gather_steps([s for s in steps if self._meta_readable(s)]))
        for s in steps:  # the newer ones a process cannot read are skipped, saying so
            if agreed and s <= agreed[0]:
                break
            warnings.warn(f"checkpoint at step {s} in {self.directory} is unreadable (its "
                          "metadata does not parse here or on another process); "
                          + (f"falling back to step {agreed[0]}" if agreed
                             else "starting from scratch"), stacklevel=2)
        steps = agreed
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        for i, step in enumerate(steps):
            restored, error = None, None
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
            except Exception as err:  # corrupt or partial: try the previous one
                error = err
            if not _everywhere(error is None):  # every process falls back together
                nxt = steps[i + 1] if i + 1 < len(steps) else None
                why = (f"{type(error).__name__}: {str(error)[:120]}" if error is not None
                       else "another process could not read it")
                warnings.warn(f"checkpoint at step {step} in {self.directory} is unreadable "
                              f"({why}); " + (f"falling back to step {nxt}" if nxt is not None
                                              else "starting from scratch"), stacklevel=2)
                continue
            st = restored["state"]
            return step, TrainState(*st) if not isinstance(st, TrainState) else st, \
                restored["meta"]
        return 0, None, None

    def _meta_readable(self, step: int) -> bool:
        """A cheap local check, before any collective restore: the step's JSON metadata
        parses (a checkpoint cut short, or not visible on this host, fails it)."""
        try:
            json.loads((self.directory / str(step) / "meta" / "metadata").read_text())
            return True
        except (OSError, ValueError, UnicodeDecodeError):
            return False


_MAX_STEPS = 64  # checkpoints compared across processes (far more than any run keeps)


def newest_common(step_lists: list[list[int]]) -> list[int]:
    """The steps every process can read, newest first."""
    common = set(step_lists[0]).intersection(*map(set, step_lists[1:]))
    return sorted(common, reverse=True)


def _gather_steps(steps: list[int]) -> list[list[int]]:
    """Every process's list of readable steps (just this one's with one process)."""
    if jax.process_count() == 1:
        return [steps]
    from jax.experimental import multihost_utils

    mine = np.full(_MAX_STEPS, -1, np.int64)
    mine[:min(len(steps), _MAX_STEPS)] = sorted(steps, reverse=True)[:_MAX_STEPS]
    every = np.asarray(multihost_utils.process_allgather(mine))
    return [[int(x) for x in row if x >= 0] for row in every.reshape(-1, _MAX_STEPS)]


def _everywhere(ok: bool) -> bool:
    """Whether ``ok`` holds on every process."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    every = multihost_utils.process_allgather(np.array([1 if ok else 0], np.int32))
    return bool(np.asarray(every).min() == 1)
