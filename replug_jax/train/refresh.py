"""Index versions and their refresh during LSR (paper §4.4), deterministic so that runs
resume exactly: a refresh *starts* at every multiple of ``refresh_every`` from a snapshot of the
parameters (written to disk first) and is *swapped in* exactly ``lag`` steps later
(``refresh_mode="sync"``: lag 0; ``"background"``: the corpus is re-embedded in a thread while
training goes on, and the swap waits only if the new index is not ready). Every version lives
under ``workdir/index/v<N>``; the current and previous versions are kept.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import threading
import time
from typing import Callable

import jax.numpy as jnp
import numpy as np

from replug_jax.fileio import atomic_path
from replug_jax.retrieval.index import DeviceIndex, Index, corpus_rows
from replug_jax.retrieval.store import PassageStore, PassageTexts


@dataclasses.dataclass
class _Refresh:
    version: int
    start_step: int
    thread: threading.Thread | None = None
    index: Index | DeviceIndex | None = None
    error: BaseException | None = None
    seconds: float = 0.0


def flatten_params(params: dict, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_params(value, name + "/"))
        else:
            out[name] = np.asarray(value)
    return out


def unflatten_params(flat: dict[str, np.ndarray], like: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in like.items():
        name = f"{prefix}{key}"
        out[key] = (unflatten_params(flat, value, name + "/") if isinstance(value, dict)
                    else flat[name])
    return out


class IndexRefresher:
    """The index in use, its version, and the refresh in flight.

    ``params_now()`` returns the current parameters on the host (what a refresh snapshots).
    """

    def __init__(self, workdir: pathlib.Path, cfg, retriever, store: PassageStore, mesh,
                 params_now: Callable[[], dict], process_index: int = 0,
                 process_count: int = 1):
        self.workdir, self.cfg, self.retriever = workdir, cfg, retriever
        self.store, self.mesh = store, mesh
        self.params_now = params_now
        self.pid, self.pcount = process_index, process_count
        self.index: Index | DeviceIndex | None = None
        self.version = 0
        self.pending: _Refresh | None = None

    def version_dir(self, version: int) -> pathlib.Path:
        return self.workdir / "index" / f"v{version}"

    def snapshot(self, version: int) -> dict:
        from safetensors.numpy import save_file

        d = self.version_dir(version)
        d.mkdir(parents=True, exist_ok=True)
        params = self.params_now()
        if self.pid == 0:
            with atomic_path(d / "params.safetensors") as tmp:
                save_file(flatten_params(params), str(tmp))
        return params

    def load_snapshot(self, version: int, like: dict) -> dict:
        from safetensors.numpy import load_file

        flat = load_file(str(self.version_dir(version) / "params.safetensors"))
        return unflatten_params(flat, like)  # only the nesting of ``like`` is read

    def build(self, version: int, params: dict | None) -> Index | DeviceIndex:
        """Index version ``version``: re-embed the corpus with ``params`` (resumably), then a
        FAISS index saved under the version folder, or (``index_backend="jax"``) the
        embeddings kept as ``emb.npy`` and placed on the mesh as a sharded array. With
        ``params=None`` only what is saved is loaded."""
        out = self.version_dir(version) / "index"
        # per-process embeddings are named by the process count too: a resume on another
        # count re-embeds instead of reading rows that are not its own
        suffix = "" if self.pcount == 1 else f".p{self.pid}of{self.pcount}"
        emb_path = self.version_dir(version) / f"emb{suffix}.npy"
        encoder = dict(self.retriever.identity, params_version=version)
        if params is None and not (out.exists() or emb_path.exists()):
            raise RuntimeError(f"index version {version} is missing from {self.workdir}; "
                               "start a new --workdir")
        done = emb_path.exists() and not emb_path.with_name(
            emb_path.name + ".progress.json").exists()
        if self.cfg.index_backend == "jax":
            # each process embeds only the corpus rows its devices hold
            rows = corpus_rows(len(self.store), self.mesh)
            if not done:
                self.retriever.encode_to_file(PassageTexts(self.store, rows.start, rows.stop),
                                              emb_path, params=params, progress=False)
            return DeviceIndex(np.load(emb_path), self.store, self.mesh, local=True,
                               dtype=None if self.cfg.index_dtype == "auto" else
                               jnp.dtype(self.cfg.index_dtype), encoder=encoder)
        try:
            return Index.load(out)
        except ValueError:
            pass
        emb = self.retriever.encode_to_file(PassageTexts(self.store), emb_path, params=params,
                                            progress=False)
        index = Index.build(np.asarray(emb), self.store, factory=self.cfg.index_factory,
                            encoder=encoder)
        if self.pid == 0:  # every process holds the same index; one writes it
            index.save(out)
        emb_path.unlink(missing_ok=True)
        return index

    def resume(self, meta: dict | None, params) -> None:
        """Open the index a run starts from: version 0 built from ``params`` for a new run
        (``meta`` None), else the version a checkpoint's ``meta`` recorded, with the refresh
        it had in flight restarted."""
        if meta is None:
            self.version = 0
            self.index = self.build(0, self.snapshot(0))
            return
        self.version = meta["index_version"]
        if meta.get("process_count", self.pcount) == self.pcount:
            self.index = self.build(self.version, None)  # loads what is saved
        else:  # saved per process by another count: re-embedded from the version's snapshot
            self.index = self.build(self.version, self.load_snapshot(self.version, params))
        if meta.get("pending"):
            p = meta["pending"]
            self.start(p["version"], p["start_step"], self.load_snapshot(p["version"], params))

    def start(self, version: int, start_step: int, params: dict | None = None) -> None:
        params = self.snapshot(version) if params is None else params
        job = _Refresh(version, start_step)

        def run():
            t0 = time.perf_counter()
            try:
                job.index = self.build(version, params)
            except BaseException as err:  # surfaced at the swap
                job.error = err
            job.seconds = time.perf_counter() - t0

        if self.cfg.lag == 0:
            run()
        else:
            job.thread = threading.Thread(target=run, name=f"index-refresh-v{version}",
                                          daemon=True)
            job.thread.start()
        self.pending = job

    def finish(self) -> float:
        """Swap the pending refresh in; returns the seconds spent waiting for it."""
        job = self.pending
        t0 = time.perf_counter()
        if job.thread is not None:
            job.thread.join()
        waited = time.perf_counter() - t0
        if job.error is not None:
            raise RuntimeError(f"index refresh v{job.version} failed") from job.error
        self.index, self.version, self.pending = job.index, job.version, None
        old = self.version_dir(job.version - 2)
        if old.exists():  # keep the current and previous versions only
            shutil.rmtree(old, ignore_errors=True)
        return waited

    def step(self, step: int) -> float:
        """Swap in a refresh that is due, start one at a refresh step; returns the wait."""
        cfg = self.cfg
        waited = 0.0
        if self.pending is not None and step >= self.pending.start_step + cfg.lag:
            waited = self.finish()
        if step > 0 and step % cfg.refresh_every == 0 and self.pending is None:
            t0 = time.perf_counter()
            self.start(self.version + 1, step)
            if cfg.lag == 0:
                self.finish()
            waited += time.perf_counter() - t0 if cfg.lag == 0 else 0.0
        return waited
