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

import jax
import jax.numpy as jnp
import numpy as np

from replug_jax.fileio import atomic_path
from replug_jax.retrieval import DeviceIndex, Index, corpus_rows
from replug_jax.retrieval.store import PassageStore, PassageTexts


@dataclasses.dataclass
class _Refresh:
    version: int
    start_step: int
    thread: threading.Thread | None = None
    index: Index | DeviceIndex | None = None
    error: BaseException | None = None
    seconds: float = 0.0


SHARE_WAIT_SECONDS = 6 * 3600  # how long a process waits for the others' embedding shares


def wait_for_embeddings(path: pathlib.Path, timeout: float = SHARE_WAIT_SECONDS,
                        poll: float = 0.5) -> np.ndarray:
    """The ``.npy`` embeddings another process writes at ``path``, memory-mapped, once they
    are complete (the file exists and its ``.progress.json`` sidecar, created before it and
    removed after its last block, is gone)."""
    progress = path.with_name(path.name + ".progress.json")
    t0 = time.monotonic()
    while not path.exists() or progress.exists():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{path} was not complete after {timeout:.0f} s: did the process "
                               "writing it stop? (multi-process refreshes need the work "
                               "directory on a filesystem every process shares)")
        time.sleep(poll)
    return np.load(path, mmap_mode="r")


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
    """The index in use, its version, and the refresh in flight, as ``retrieval`` (the
    config's :class:`~replug_jax.train.config.RetrievalConfig`) says.

    ``params_now()`` returns the current parameters on the host (what a refresh snapshots).
    """

    def __init__(self, workdir: pathlib.Path, retrieval, retriever, store: PassageStore, mesh,
                 params_now: Callable[[], dict], process_index: int = 0,
                 process_count: int = 1):
        self.workdir, self.retrieval, self.retriever = workdir, retrieval, retriever
        self.store, self.mesh = store, mesh
        # the refresh's encoder: the retriever's own devices, or the last `refresh_devices`
        # of this process's (a share set apart from training's)
        n = retrieval.refresh_devices
        if n > len(jax.local_devices()):
            raise ValueError(f"refresh_devices={n} but this process has "
                             f"{len(jax.local_devices())} devices")
        self.encoder = retriever.on_devices(jax.local_devices()[-n:]) if n else retriever
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
        embeddings kept as ``emb.npy`` and placed on the mesh as a sharded array. On several
        processes each embeds only its share of the rows (``emb.p<i>of<n>.npy``): the JAX
        index keeps each share on its process's devices; the FAISS index is built by every
        process from all the shares. With ``params=None`` only what is saved is loaded."""
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
        if self.retrieval.resolved_backend() == "jax":
            # each process embeds only the corpus rows its devices hold
            rows = corpus_rows(len(self.store), self.mesh)
            if not done:
                self.encoder.encode_to_file(PassageTexts(self.store, rows.start, rows.stop),
                                            emb_path, params=params, progress=False)
            return DeviceIndex(np.load(emb_path), self.store, self.mesh, local=True,
                               dtype=None if self.retrieval.index_dtype == "auto" else
                               jnp.dtype(self.retrieval.index_dtype), encoder=encoder)
        try:
            return Index.load(out)
        except ValueError:
            pass
        if self.pcount == 1:
            emb = self.encoder.encode_to_file(PassageTexts(self.store), emb_path, params=params,
                                              progress=False)
            index = Index.build(np.asarray(emb), self.store, factory=self.retrieval.index_factory,
                                encoder=encoder)
            index.save(out)
            emb_path.unlink(missing_ok=True)
            return index
        # several processes: each embeds its contiguous share of the rows, then every process
        # builds the same index from all the shares (the work directory is shared). The shares
        # stay until the version folder is removed, two refreshes later: a slower process may
        # still be reading them.
        bounds = np.linspace(0, len(self.store), self.pcount + 1).astype(int)
        lo, hi = int(bounds[self.pid]), int(bounds[self.pid + 1])
        if not done:
            if hi > lo:
                self.encoder.encode_to_file(PassageTexts(self.store, lo, hi), emb_path,
                                            params=params, progress=False)
            else:  # more processes than passages
                with atomic_path(emb_path) as tmp:
                    np.save(tmp, np.zeros((0, self.encoder.dim), np.float32))
        shares = [wait_for_embeddings(self.version_dir(version) / f"emb.p{j}of{self.pcount}.npy")
                  for j in range(self.pcount)]
        index = Index.build(shares, self.store,  # read share by share, not concatenated
                            factory=self.retrieval.index_factory, encoder=encoder)
        if self.pid == 0:  # every process holds the same index; one writes it
            index.save(out)
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

        if self.retrieval.lag == 0:
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
        cfg = self.retrieval  # the config's RetrievalConfig
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
