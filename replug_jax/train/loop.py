"""The LSR trainer, the one every LSR run goes through (``replug train-lsr`` and the studies):
batches, the step, metrics, checkpoints, the dev curve and the step it keeps.

Its supervision is one of two sources (``cfg.supervision.kind``): ``"online"``, retrieval from
the index and LM scores of the pairs it brings (scored as needed, kept in a store); or
``"pool"``, pre-scored pools re-ranked by the current retriever
(:class:`~replug_jax.train.pool_source.PoolSource`), with the query tower alone or both
towers learning, a dev curve and a selected step (:mod:`replug_jax.train.selection`).

The pieces it uses: the pure step (:mod:`replug_jax.train.lsr`), index versions and their
refresh (:mod:`replug_jax.train.refresh`; the index searched at step ``s`` is always version
``max(0, ⌊(s − lag) / refresh_every⌋ + 1)`` if ``s >= lag`` after the first refresh, never more
than one refresh period behind), checkpoints (:mod:`replug_jax.train.checkpoint`) and export
(:mod:`replug_jax.train.export`).

Checkpoints (orbax) hold the parameters, optimizer state and step, plus JSON metadata: the
config fingerprint, the index version in use and any refresh in flight. The metrics log
(``metrics.jsonl``) is cut back to the restored step on resume, so no step is duplicated or
missing. A corrupt latest checkpoint falls back to the previous one, with a warning.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import time
import warnings
from typing import Callable

import jax

from replug_jax.config import dotted
from replug_jax.fileio import write_json_atomic, write_text_atomic
from replug_jax.lm.score_store import scorer_identity
from replug_jax.models.params import split_params, to_module
from replug_jax.remote import is_remote
from replug_jax.retrieval import DeviceIndex, Index
from replug_jax.retrieval.corpus import Passage, leakage_exclusions
from replug_jax.retrieval.encoder import Retriever
from replug_jax.retrieval.store import PassageStore
from replug_jax.sharding import host_copy, make_mesh, replicate, shard_batch
from replug_jax.train.checkpoint import Checkpoints
from replug_jax.train.config import LSRConfig
from replug_jax.train.data import Example, resolve_gold
from replug_jax.train.lsr import (
    build_tx,
    encoder_params,
    init_state,
    learned_gamma,
    make_query_step,
    make_train_step,
    trainable,
)
from replug_jax.train.online import OnlineSupervision
from replug_jax.train.pool_source import PoolSource
from replug_jax.train.prefetch import Prefetcher
from replug_jax.train.refresh import IndexRefresher
from replug_jax.train.selection import Curve, Selection, read_jsonl
from replug_jax.train.supervision import LMScoreCache


@dataclasses.dataclass
class Hook:
    """``fn(step, record)`` after every ``every``-th step (and after the last step of a call
    to :meth:`LSRTrainer.run` if ``at_end``); ``record`` is the step's metrics."""

    fn: Callable[[int, dict], None]
    every: int = 1
    at_end: bool = False

    def due(self, done: int, end: int) -> bool:
        return done % self.every == 0 or (self.at_end and done == end)


def _scalars_to(writer) -> Callable[[int, dict], None]:
    """A hook writing a record's numbers to a TensorBoard writer."""
    def write(step: int, record: dict) -> None:
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                writer.add_scalar(key, value, step)

    return write


def end_step(cfg: LSRConfig, start: int, stop_after: int | None) -> int:
    return cfg.total_steps if stop_after is None else min(cfg.total_steps, start + stop_after)


class CheckpointMismatch(ValueError):
    """The work directory holds a run with a different config."""


class LSRTrainer(OnlineSupervision):
    """Runs REPLUG LSR in ``workdir``, resuming automatically from its latest checkpoint."""

    def __init__(self, cfg: LSRConfig, workdir: str | pathlib.Path, *, retriever: Retriever,
                 lm_scorer, passages: list[Passage] | PassageStore, train: list[Example],
                 dev: list[Example] = (), progress: bool = True, pools=None,
                 frozen_docs: dict | None = None, dev_recall=None):
        """``passages``: the retrieval corpus, a list or (at scale) the memory-mapped passage
        store an index build writes (``PassageStore.open(idx / "passages.arrow")``): the
        trainer reads passages by id from it and never holds the corpus (with pool
        supervision: at least every pool candidate). ``pools``: ``(train pool, dev pool or
        None)``, the :class:`~replug_jax.train.pool.ScoredPool` s of ``train`` and ``dev``
        (``supervision.kind="pool"``; no LM needed); ``frozen_docs`` and ``dev_recall``: see
        :class:`~replug_jax.train.pool_source.PoolSource`."""
        if not len(passages):
            raise ValueError("the retrieval corpus is empty")
        if not train:
            raise ValueError("no training examples")
        if retriever.query_tower is not None:
            raise ValueError("this retriever has two towers (a query encoder of its own); the "
                             "trainer trains one shared encoder: start from one of its "
                             "folders (the query tower, or passage_encoder/)")
        if (cfg.supervision.kind == "pool") != (pools is not None):
            raise ValueError("supervision.kind='pool' trains from pools (give the train and dev "
                             "pools), 'online' from the LM (give no pools)")
        if pools is not None and jax.process_count() > 1:
            raise ValueError("pool supervision runs in one process (the pools are read whole); "
                             "use one host, or supervision.kind='online'")
        self.cfg = cfg
        if is_remote(workdir):  # pathlib would make a local folder named "gs:"
            raise ValueError(f"--workdir {workdir}: a work directory must be on a local or "
                             "mounted filesystem (index versions and LM scores are memory-"
                             "mapped); sources may be remote (gs://...)")
        self.workdir = pathlib.Path(workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.retriever = retriever
        self.lm = lm_scorer
        self.store = (passages if isinstance(passages, PassageStore)
                      else PassageStore.from_passages(passages))
        self.by_id = self.store  # passages by id, read from the store when asked for
        # gold passages count in online recall; pools carry their own supervision
        self.train, self.dev = ((list(train), list(dev)) if pools is not None else
                                (resolve_gold(train, self.store), resolve_gold(dev, self.store)))
        # The leakage filter: passages an example must never retrieve (its own window).
        spanned = [e for e in self.train + self.dev if e.span is not None]
        self.exclusions = {e.id: ex for e, ex in zip(
            spanned, leakage_exclusions(spanned, self.store, cfg.data.leakage)) if ex}
        self.progress = progress
        self.mesh = make_mesh(cfg.num_devices or None)
        if cfg.batch_size % self.mesh.devices.size:
            raise ValueError(f"batch_size {cfg.batch_size} is not divisible by the "
                             f"{self.mesh.devices.size} devices of the mesh")
        self._check_workdir()
        if retriever.similarity != cfg.retriever.similarity:
            raise ValueError(f"the retriever uses {retriever.similarity!r} similarity but the "
                             f"config says {cfg.retriever.similarity!r}")
        lengths = (retriever.query_max_length, retriever.max_length)
        if pools is not None and lengths != (cfg.retriever.query_max_length,
                                             cfg.retriever.doc_max_length):
            # pools are encoded at the retriever's lengths; the export states the config's
            raise ValueError(f"the retriever cuts queries at {lengths[0]} and passages at "
                             f"{lengths[1]} tokens but the config says retriever."
                             f"query_max_length={cfg.retriever.query_max_length}, "
                             f"doc_max_length={cfg.retriever.doc_max_length}: make them agree")
        self.graphdef, self.template, params = split_params(retriever.model.encoder)
        self.pool = None if pools is None else PoolSource(
            cfg, retriever, pools[0], self.train, pools[1], self.dev, self.by_id,
            frozen_docs=frozen_docs, dev_recall=dev_recall)
        # γ and β as the step uses them (named ones fitted from the base on the dev pool)
        self.objective = (cfg.objective if self.pool is None
                          else self.pool.resolve(cfg.objective))
        self.tx = build_tx(cfg.optim, self.objective, cfg.total_steps)
        schedule = cfg.optim.schedule(cfg.total_steps)
        if self.pool is None:
            self.train_step, self.scores_fn = make_train_step(
                self.graphdef, self.template, self.objective, self.tx,
                retriever.model.pooling, retriever.normalize, schedule=schedule,
                remat=cfg.remat)
        else:
            self.train_step = make_query_step(
                self.graphdef, self.template, self.objective, self.tx,
                retriever.model.pooling, retriever.normalize, cfg.k, schedule=schedule)
        self.state = replicate(init_state(trainable(params, self.objective), self.tx),
                               self.mesh)
        self.curve = Curve(self.workdir, Selection(cfg.selection.metric, cfg.selection.patience))
        self.versions_used: dict[int, int] = {}  # step -> index version (for tests/metrics)
        self._end = 0  # the step this run stops at (no prefetch beyond it)
        self.pid, self.pcount = jax.process_index(), jax.process_count()
        self.checkpoints = Checkpoints(self.workdir / "checkpoints", cfg.keep_checkpoints)
        if self.pool is not None:
            self.lm = None
            return
        # one score store per process: each scores only its own rows of every batch
        store = pathlib.Path(cfg.supervision.lm_scores or self.workdir / "lm_scores")
        if self.pcount > 1:
            store = store.with_name(f"{store.name}.p{self.pid}")
        if store.with_name(f"{store.name}.sqlite").exists():
            warnings.warn(f"{store}.sqlite: an older release's LM-score cache, not read; its "
                          f"pairs are scored again into {store}/", stacklevel=2)
        self.cache = LMScoreCache(store, scorer_identity(lm_scorer)
                                  if hasattr(lm_scorer, "name") else cfg.lm.name)
        self.refresher = IndexRefresher(self.workdir, cfg.retrieval, retriever, self.store,
                                        self.mesh,
                                        lambda: self.encoder_params, self.pid, self.pcount)
        self.prefetcher = Prefetcher(self)

    @property
    def encoder_params(self):
        """The retriever encoder's current parameters, on the host."""
        return encoder_params(host_copy(self.state.params))

    @property
    def temperatures(self) -> dict:
        """γ and β the run trains with (γ now, where it is learned), and the base's fitted τ
        and β on the dev pool where they were fitted: stated in every result and card."""
        given = self.cfg.objective
        out = {"gamma": given.gamma, "beta": given.beta, "lm_score": given.lm_score,
               "gamma_used": float(self.objective.gamma), "beta_used": float(self.objective.beta)}
        if self.objective.learns_gamma:
            out["gamma_now"] = learned_gamma(host_copy(self.state.params))
        if self.pool is not None and self.pool.base_fit is not None:
            out["base_fitted"] = dict(self.pool.base_fit)
        return out

    @property
    def index(self) -> Index | DeviceIndex | None:
        """The index the current step retrieves from."""
        return self.refresher.index

    @property
    def index_version(self) -> int:
        return self.refresher.version

    # -- workdir and checkpoints -----------------------------------------------------------

    def _check_workdir(self) -> None:
        path = self.workdir / "config.json"
        mine = {"fingerprint": self.cfg.fingerprint(), "config": self.cfg.to_json()}
        if path.exists():
            theirs = json.loads(path.read_text())
            if theirs.get("fingerprint") != mine["fingerprint"]:
                mine_json = dotted(json.loads(json.dumps(self.cfg.to_json())))  # tuples: lists
                try:  # a record of the flat form earlier releases wrote reads as the tree
                    stored = dotted(json.loads(json.dumps(
                        LSRConfig.from_record(theirs.get("config", {})).to_json())))
                except ValueError:
                    stored = {}
                diff = sorted(k for k, v in mine_json.items() if stored.get(k) != v)
                raise CheckpointMismatch(
                    f"{self.workdir} holds a run with a different config (differs in: "
                    f"{', '.join(diff)}); use a new --workdir or the same config")
        if jax.process_index() == 0:
            write_json_atomic(mine, path)

    def _save(self, step: int) -> None:
        pending = None if self.pool is not None else self.refresher.pending
        meta = {"step": step, "index_version": 0 if self.pool is not None else
                self.index_version,
                "pending": None if pending is None else {
                    "version": pending.version, "start_step": pending.start_step},
                "config_fingerprint": self.cfg.fingerprint(),
                "process_count": self.pcount}
        self.checkpoints.save(step, self.state, meta)

    def restore(self) -> tuple[int, dict | None]:
        """Load the newest readable checkpoint into the trainer: ``(step, metadata)``, or
        ``(0, None)`` for a new run."""
        step, state, meta = self.checkpoints.restore(self.state)
        if state is not None:
            self.state = replicate(state, self.mesh)
        return step, meta

    # -- the run ------------------------------------------------------------------------------

    def _metrics_log(self, resume_step: int) -> pathlib.Path:
        path = self.workdir / "metrics.jsonl"
        # drop the steps after the restored checkpoint (they are redone); one process writes
        if path.exists() and self.pid == 0:
            kept = [r for r in read_jsonl(path) if r["step"] < resume_step]
            write_text_atomic("".join(json.dumps(r) + "\n" for r in kept), path)
        return path

    def step(self, step: int) -> dict:
        """One LSR step at ``step``: the index refresh due, the batch (retrieval, LM scores),
        the jitted update. Returns the step's metrics record."""
        t0 = time.perf_counter()
        if self.pool is not None:
            self.pool.refresh(step, self.encoder_params, self.workdir)
            self.state, metrics = self.train_step(
                self.state, shard_batch(self.pool.batch(step), self.mesh))
            return {"step": step, **{k: float(v) for k, v in host_copy(metrics).items()},
                    "step_seconds": round(time.perf_counter() - t0, 4)}
        refresh_wait = self.refresher.step(step)
        self.versions_used[step] = self.index_version
        batch, info = self._batch(step)
        if step + 1 < self._end and self.prefetcher.enabled():
            self.prefetcher.start(step + 1, encoder_params(self.state.params))  # before the
            # step donates them
        self.state, metrics = self.train_step(self.state, shard_batch(batch, self.mesh))
        record = {"step": step, **{k: float(v) for k, v in host_copy(metrics).items()},
                  "index_version": self.index_version,
                  "refresh_wait_seconds": round(refresh_wait, 4),
                  "lm_new_pairs": info["lm_new_pairs"], "lm_seconds": round(info["lm_seconds"], 4),
                  "step_seconds": round(time.perf_counter() - t0, 4)}
        if info["gold_in_topk"] is not None:
            record["gold_in_topk"] = info["gold_in_topk"]
        return record

    def _tensorboard(self, log_path: pathlib.Path):
        """A TensorBoard writer (process 0, when ``tensorboardX`` is installed), else None."""
        if self.pid != 0:
            return None
        if importlib.util.find_spec("tensorboardX") is None:
            if self.progress:
                print("note: TensorBoard logging is off (pip install 'replug-jax[tensorboard]'); "
                      f"metrics still go to {log_path}")
            return None
        from tensorboardX import SummaryWriter

        return SummaryWriter(str(self.workdir / "tb"))

    def run(self, stop_after: int | None = None, on_step=None) -> dict:
        """Train to ``cfg.total_steps`` (or ``stop_after`` steps from the start of this call),
        or, with pool supervision, until the selection's patience is spent.

        After each step the hooks run in order: the metrics log, TensorBoard, the checkpoint
        (every ``checkpoint_every`` steps and at the end), then ``on_step(step, record)``;
        with pool supervision the dev curve is read every ``selection.every`` steps (and at the
        last), and the selected step's parameters kept (:mod:`replug_jax.train.selection`)."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        start, meta = self.restore()
        if self.pool is None:
            self.refresher.resume(meta, self.encoder_params)
        end = self._end = end_step(cfg, start, stop_after)
        ended = self.curve.ended() if self.pool is not None else None
        if ended is not None:  # a finished pool run: nothing left to train
            end = self._end = start
        if self.pool is None and cfg.supervision.prescore_pool and start < end:
            self.prescore(start, end)
        if self.pool is not None:
            self.curve.resume(start)
            if not self.curve.points:  # step 0: the base retriever, the curve's reference
                self.curve.add({"step": 0, **self.pool.evaluate(self.encoder_params)},
                               host_copy(self.state.params))
        elif self.dev and "initial" not in self._dev_metrics():
            # The untrained retriever on dev, once per work directory (the model card's baseline).
            self._write_once({"initial": self.evaluate(self.dev)} if start == 0 else
                             {"initial": None, "note": "resumed before a baseline was taken"},
                             self.workdir / "dev_metrics.json")
        log_path = self._metrics_log(start)
        bar = tqdm(range(start, end), initial=start, total=cfg.total_steps, desc="LSR",
                   disable=not self.progress or self.pid != 0)
        last, stopped = {}, False
        with open(log_path if self.pid == 0 else os.devnull, "a") as log:
            writer = self._tensorboard(log_path)
            hooks = [Hook(lambda step, record: (log.write(json.dumps(record) + "\n"),
                                                log.flush())),
                     *([Hook(_scalars_to(writer))] if writer is not None else []),
                     Hook(lambda step, record: bar.set_postfix(
                         loss=f"{record['loss']:.4f}", v=record.get("index_version", 0))),
                     Hook(lambda step, record: self._save(step + 1), cfg.checkpoint_every,
                          at_end=True),
                     *([Hook(on_step)] if on_step is not None else [])]
            try:
                for step in bar:
                    last = self.step(step)
                    for hook in hooks:
                        if hook.due(step + 1, end):
                            hook.fn(step, last)
                    if self.pool is not None and self._curve_point(step + 1, last):
                        stopped = True
                        break
            finally:
                if self.pool is None:
                    self.prefetcher.wait(None)  # nothing runs past the last step
                if writer is not None:
                    writer.close()
        if stopped and (step + 1) % cfg.checkpoint_every and step + 1 != end:
            self._save(step + 1)  # the hook has not saved this step
        done = step + 1 if stopped else end
        if self.pid == 0:  # what the export card states
            write_json_atomic(self.temperatures, self.workdir / "temperatures.json")
        if self.pool is not None:
            if ended is None and (stopped or done == cfg.total_steps):
                self.curve.finish(done, stopped)
            best, _ = self.curve.best(host_copy(self.state.params))
            return {"step": done, "last": last, "curve": self.curve.points,
                    "best_step": best["step"], "best": best,
                    "stopped_early": bool(stopped or (ended or {}).get("stopped_early")),
                    "temperatures": self.temperatures}
        result = {"step": end, "last": last, "lm_cache_hits": self.cache.hits,
                  "lm_cache_misses": self.cache.misses}
        if self.dev and end == cfg.total_steps:
            result["dev"] = self.evaluate(self.dev)
            dev = self._dev_metrics()
            dev.update(final=result["dev"], final_step=end)
            self._write_once(dev, self.workdir / "dev_metrics.json")
            result["dev_initial"] = dev.get("initial")
        return result

    def _curve_point(self, done: int, record: dict) -> bool:
        """Read the dev curve after step ``done`` when due; True when the run stops here."""
        if done % max(self.cfg.selection.every, 1) and done != self.cfg.total_steps:
            return False
        entry = {"step": done, **self.pool.evaluate(self.encoder_params),
                 **{k: v for k, v in record.items() if k != "step"}}
        return self.curve.add(entry, host_copy(self.state.params))

    def best_params(self) -> tuple[dict, dict]:
        """The selected curve point and the encoder parameters kept for it (pool
        supervision)."""
        entry, params = self.curve.best(host_copy(self.state.params))
        return entry, encoder_params(params)

    def _write_once(self, obj, path: pathlib.Path) -> None:
        if self.pid == 0:
            write_json_atomic(obj, path)

    def _dev_metrics(self) -> dict:
        path = self.workdir / "dev_metrics.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def export(self, out_dir: str | pathlib.Path, step: int | None = None, *,
               dtype: str = "float16", comparison: str | pathlib.Path | None = None
               ) -> pathlib.Path:
        """The current parameters as a retriever folder in ``dtype``, with its card (see
        :func:`replug_jax.train.export.write_retriever`; ``comparison``: ``replug eval``'s
        results.json of that folder against its base)."""
        from replug_jax.train.export import write_retriever

        encoder = to_module(self.graphdef, self.template, self.encoder_params)
        return write_retriever(self.retriever.model, encoder, out_dir, self.cfg,
                               int(host_copy(self.state.step)) if step is None else step,
                               self.workdir, dtype=dtype, comparison=comparison)[0]
