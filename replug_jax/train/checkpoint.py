"""LSR checkpoints: the train state (orbax) with JSON metadata, saved and restored.

A corrupt or partial latest checkpoint falls back to the previous one, with a warning.
"""

from __future__ import annotations

import pathlib
import warnings

import jax

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
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        for i, step in enumerate(steps):
            try:
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
            except Exception as err:  # corrupt or partial: try the previous one
                nxt = steps[i + 1] if i + 1 < len(steps) else None
                warnings.warn(f"checkpoint at step {step} in {self.directory} is unreadable "
                              f"({type(err).__name__}: {str(err)[:120]}); "
                              + (f"falling back to step {nxt}" if nxt is not None
                                 else "starting from scratch"), stacklevel=2)
                continue
            st = restored["state"]
            return step, TrainState(*st) if not isinstance(st, TrainState) else st, \
                restored["meta"]
        return 0, None, None
