"""LM scoring of the next LSR step's pairs while the current step trains (off the critical
path), with the same scores and the same updates as scoring them in the step.

The retrieved documents of step ``s + 1`` depend on the parameters after step ``s``, which do
not exist while step ``s`` runs. So the prefetcher *predicts* them: as soon as step ``s``'s
batch is built, a worker thread retrieves step ``s + 1``'s examples with step ``s``'s
parameters (a copy: the step donates its buffers) and scores the pairs the LM-score cache
lacks, while the device runs step ``s``. Step ``s + 1`` then retrieves with its own parameters
as always and reads its scores from the cache; the few pairs the prediction missed (one update
rarely changes a top-k much) are scored in the step. The LM is frozen, so a cached score is
the score the step would have computed, up to float rounding: a prefetched pair is scored in
another batch (other padding and shared-prefix groups). Prefetching changes when scores are
paid for, not what they are (tested: the parameters of the synchronous path). One step ahead
at most (a queue of one); the LM is used by one thread at a time.

With a served LM (``lm_api_base``) the prefetch overlaps the server's work with training; with
an in-process LM on the same devices as the retriever, the two share them.
"""

from __future__ import annotations

import concurrent.futures
import threading
import warnings

import jax
import jax.numpy as jnp

from replug_jax.sharding import host_copy


class Prefetcher:
    """One step of LM scoring ahead of the trainer (see the module docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.lm_lock = threading.Lock()  # the LM (and its caches) is used by one thread
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lm-prefetch")
        self._future: concurrent.futures.Future | None = None
        self._step: int | None = None

    def enabled(self) -> bool:
        """Off where the prediction's retrieval would be a collective (a JAX index sharded
        over several processes: a worker thread must not join collectives the main thread
        runs); with a FAISS index every process predicts its own rows locally."""
        from replug_jax.retrieval import DeviceIndex

        t = self.trainer
        return t.cfg.lm.prefetch and not (t.pcount > 1 and isinstance(t.index, DeviceIndex))

    def start(self, step: int, params) -> None:
        """Predict and score step ``step``'s pairs in the background from ``params`` (the
        parameters the current step retrieved with)."""
        self.wait(None)
        snapshot = (jax.tree.map(jnp.copy, params) if self.trainer.pcount == 1
                    else host_copy(params))  # a process-local copy of the global state
        self._step = step
        self._future = self._pool.submit(self._work, step, snapshot)

    def _work(self, step: int, params) -> set:
        t = self.trainer
        _, examples = t.step_examples(step)
        queries = t.retriever.encode_queries([e.query for e in examples], params=params)
        hits = t.index.search(queries, t.cfg.k, t._excluded(examples))
        keys = t.pair_keys(examples, hits.ids)
        with self.lm_lock:  # what was stored before, read as the step scoring beside it sees it
            before = {key for key in keys if key in t.cache}
            t.score_pairs(examples, hits.ids)
        return keys - before

    def wait(self, step: int | None) -> set:
        """Let the prefetch in flight finish; the pairs it newly scored when it was for
        ``step`` (an empty set otherwise, or when it failed: the step then scores them)."""
        future, planned = self._future, self._step
        self._future = self._step = None
        if future is None:
            return set()
        try:
            scored = future.result()
        except Exception as err:  # the step scores what the prefetch could not
            warnings.warn(f"LM prefetch for step {planned} failed ({type(err).__name__}: "
                          f"{err}); that step scores its pairs itself", stacklevel=2)
            return set()
        return scored if planned == step else set()

    def close(self) -> None:
        self.wait(None)
        self._pool.shutdown(wait=True)
