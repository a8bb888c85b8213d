"""FAISS indexes over a memory-mapped passage store, in shards.

An index directory::

    manifest.json            encoder, factory, dim, n, corpus checksum, shards, file table
    passages.arrow/.json     the passage store (memory-mapped, see retrieval/store.py)
    shard-00000/index.faiss  FAISS index of rows lo..hi-1 (labels are rows - lo)
    shard-00000/shard.json   its range and build key, so a stray shard is refused
    shard-00000/vectors.npy  with re-ranking: the vectors, to re-score candidates exactly

Every FAISS shard covers a contiguous range of store rows and is built, trained and saved on
its own (on any host); a search queries every shard and merges their top-k exactly. FAISS is
exact inner product by default (cosine, since the retriever normalises embeddings) or any
``faiss.index_factory`` string (``IVF4096,Flat``, ``IVF4096,PQ48``, ``OPQ48,IVF4096,PQ48``):
quantizers are trained on a seeded sample sized from ``nlist`` and vectors are added in
batches read from memmaps, so peak memory is about the index's own bytes plus one batch.
Loading memory-maps the FAISS files and the store and checks them
(:mod:`replug_jax.retrieval.integrity`).
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
from typing import Iterable, Sequence

import numpy as np

from replug_jax.fileio import replace_dir
from replug_jax.remote import local_copy
from replug_jax.retrieval.corpus import Passage
from replug_jax.retrieval.embeddings import EmbeddingSource, NpyRows
from replug_jax.retrieval.integrity import IndexLoadError, check_files
from replug_jax.retrieval.search import (
    SearchResult,
    assemble,
    checked_queries,
    per_query_exclusions,
)
from replug_jax.retrieval.shards import (
    ADD_BATCH,
    check_shard,
    finish_index,
    read_faiss,
    read_shard_info,
    write_shard,
)
from replug_jax.retrieval.store import PassageStore


INDEX_VERSION = 3  # 3: build key with every shard setting, sampled hashes


STORE = "passages.arrow"


def set_nprobe_of(index, nprobe: int) -> bool:
    """Set the IVF lists searched per query through FAISS's parameter space (which reaches
    inside pre-transforms, shards and replicas; ``GpuParameterSpace`` for GPU indexes, which
    ``extract_index_ivf`` does not accept); False for an index without inverted lists."""
    import faiss

    gpu = faiss.get_num_gpus() > 0 and hasattr(faiss, "GpuParameterSpace")
    space = faiss.GpuParameterSpace() if gpu else faiss.ParameterSpace()
    try:
        space.set_index_parameter(index, "nprobe", int(nprobe))
    except RuntimeError:
        return False
    return True


def train_size_for(base, n: int) -> int:
    """Training vectors for a FAISS index: 64 per IVF list (FAISS warns below 39) and at least
    16384 (PQ's 256 centroids per sub-quantizer), capped at ``n``."""
    import faiss

    try:
        nlist = faiss.extract_index_ivf(base).nlist
    except RuntimeError:
        nlist = 0
    return int(min(n, max(64 * nlist, 16384)))


def check_factory(factory: str, dim: int, rows_per_shard: int | None = None) -> None:
    """Refuse, before any work, a FAISS factory string FAISS cannot build, or one whose
    training needs more vectors than a shard has (k-means needs at least ``nlist`` points, a
    PQ codebook ``2^nbits``), in one line each."""
    import faiss

    try:
        base = faiss.index_factory(int(dim), factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else "unknown"
        raise ValueError(f"--factory {factory!r}: FAISS cannot build it for {dim}-d vectors "
                         f"({reason[:200]}); e.g. Flat, IVF4096,Flat, IVF4096,PQ64") from None
    if rows_per_shard is None or base.is_trained:
        return
    need = 1
    ivf = faiss.try_extract_index_ivf(base)
    if ivf is not None:
        need = max(need, int(ivf.nlist))
    for m in re.finditer(r"PQ(\d+)(?:x(\d+))?", factory):
        need = max(need, 1 << int(m.group(2) or 8))
    if rows_per_shard < need:
        raise ValueError(f"--factory {factory!r} needs at least {need} vectors to train, but a "
                         f"shard holds {rows_per_shard}; use Flat, fewer IVF lists or fewer "
                         "shards for this corpus")


def build_faiss(source: EmbeddingSource, lo: int, hi: int, factory: str = "Flat", *,
                nprobe: int = 16, train_size: int | None = None, add_batch: int = ADD_BATCH,
                seed: int = 0, progress: bool = False):
    """A FAISS index of rows ``lo..hi-1`` of ``source``: trained on a seeded sample, filled in
    batches of ``add_batch`` rows (labels ``0..hi-lo-1``)."""
    import faiss
    from tqdm.auto import tqdm

    n = hi - lo
    base = faiss.index_factory(source.dim, factory, faiss.METRIC_INNER_PRODUCT)
    if not base.is_trained:
        size = train_size or train_size_for(base, n)
        rows = np.sort(np.random.default_rng(seed).choice(n, size=min(size, n), replace=False))
        base.train(source.take(rows + lo))
    set_nprobe_of(base, nprobe)
    bar = tqdm(total=n, desc=f"adding to {factory}", unit="vector", mininterval=0.5,
               disable=not progress or n <= add_batch)
    flat = faiss.downcast_index(base)
    if type(flat) in (faiss.IndexFlatIP, faiss.IndexFlat) and n > 0:
        # Size the flat storage once and fill it in place: growing it by ``add`` would
        # reallocate and copy (peak up to twice the index); this way it is the index + a batch.
        flat.codes.resize(n * flat.code_size)
        view = faiss.rev_swig_ptr(flat.codes.data(), n * flat.code_size)
        rows_ND = view.view(np.float32).reshape(n, source.dim)
        for a in range(lo, hi, add_batch):
            x = source.rows(a, min(hi, a + add_batch))
            rows_ND[a - lo:a - lo + len(x)] = x
            bar.update(len(x))
        flat.ntotal = n
    else:
        for a in range(lo, hi, add_batch):
            x = source.rows(a, min(hi, a + add_batch))
            base.add(x)
            bar.update(len(x))
    bar.close()
    return base


def gpu_placement(index_bytes: int, free_bytes: Sequence[int] | None, mode: str = "auto"
                  ) -> tuple[str, str]:
    """``(placement, report)``: where a FAISS index of ``index_bytes`` (``ntotal ×
    code_size``) goes on GPUs with ``free_bytes`` free each (None: unknown). ``auto``
    replicates only what takes at most half of the smallest free memory, shards across the
    GPUs (FAISS ``IndexShards``) what fits at 80 % of it per GPU, and keeps the rest on the
    CPU; an unknown free memory shards. ``replicate``/``shard`` are obeyed. The report states
    the numbers behind the choice."""
    gib = 1 << 30
    if free_bytes is None:
        return ("shard" if mode == "auto" else mode,
                f"index {index_bytes / gib:.2f} GiB; free GPU memory unknown (no pynvml): "
                + ("sharded across the GPUs" if mode == "auto" else mode))
    n, least = len(free_bytes), min(free_bytes)
    per_shard = -(-index_bytes // n)
    where = (f"index {index_bytes / gib:.2f} GiB ({per_shard / gib:.2f} per GPU sharded); "
             f"{n} GPU(s), least free {least / gib:.2f} GiB")
    if mode != "auto":
        return mode, f"{where}: {mode} as asked"
    if index_bytes <= 0.5 * least:
        return "replicate", f"{where}: replicated on every GPU"
    if per_shard <= 0.8 * least:
        return "shard", f"{where}: sharded across the GPUs"
    return "cpu", f"{where}: does not fit the GPUs, searched on the CPU"


def _free_gpu_bytes() -> list[int] | None:
    """Free memory of each GPU as the driver reports it (what JAX's preallocation left), or
    None without ``pynvml`` (nvidia-ml-py)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return [int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).free)
                for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # noqa: BLE001 — no module, no driver, no permission: unknown
        return None


def _gpu_clone(index, mode: str):
    """Move a FAISS index to the GPUs when FAISS sees any (:func:`gpu_placement` chooses
    replicated, sharded or kept on the CPU from its size and the GPUs' free memory, and says
    why once)."""
    import faiss

    if mode == "cpu" or faiss.get_num_gpus() == 0:
        return index
    size = int(index.ntotal) * int(index.sa_code_size())
    free = _free_gpu_bytes()
    if free is not None:
        free = free[:faiss.get_num_gpus()]
    mode, report = gpu_placement(size, free, mode)
    import warnings

    warnings.warn(f"FAISS on GPUs: {report}", stacklevel=3)
    if mode == "cpu":
        return index
    co = faiss.GpuMultipleClonerOptions()
    co.shard = mode == "shard"
    return faiss.index_cpu_to_all_gpus(index, co)


class Index:
    """FAISS shards + the passage store + a manifest describing how they were made.

    ``shards`` is a list of ``(faiss_index, lo)``: shard labels are store rows minus ``lo``.
    """

    def __init__(self, shards: list[tuple[object, int]], store: PassageStore, manifest: dict,
                 gpu: str = "auto"):
        self.shards = shards
        self.store = store
        self.manifest = manifest
        total = sum(int(ix.ntotal) for ix, _ in shards)
        if total != len(store):
            raise IndexLoadError(f"{total} vectors for {len(store)} passages")
        self._search = [(_gpu_clone(ix, gpu), lo) for ix, lo in shards]
        self._vectors: list[NpyRows | None] = [None] * len(shards)

    def __len__(self) -> int:
        return len(self.store)

    @property
    def has_vectors(self) -> bool:
        """Whether the vectors are stored with the index (re-ranking is possible)."""
        return all(v is not None for v in self._vectors)

    @property
    def passages(self) -> PassageStore:
        """The passages, by id (``index.passages[id]``) or in order (iteration)."""
        return self.store

    @classmethod
    def build(cls, embeddings_ND: np.ndarray | Sequence[np.ndarray],
              passages: Sequence[Passage] | PassageStore, *, factory: str = "Flat",
              encoder: dict | None = None, nprobe: int = 16, extra: dict | None = None
              ) -> "Index":
        """An in-memory, one-shard index of ``embeddings_ND`` (row i is the i-th passage): one
        ``[N, D]`` array, or a list of consecutive ``[N_i, D]`` parts (memmaps included) read
        block by block, never concatenated."""
        parts = [np.asarray(p) for p in (embeddings_ND if isinstance(embeddings_ND, (list, tuple))
                                         else [embeddings_ND])]
        if not parts or any(p.ndim != 2 for p in parts) or sum(map(len, parts)) == 0:
            raise ValueError("need a non-empty [N, D] embedding matrix, got shapes "
                             f"{[p.shape for p in parts]}")
        store = passages if isinstance(passages, PassageStore) else \
            PassageStore.from_passages(passages)
        # Finiteness is checked block by block as the rows are added (EmbeddingSource.rows):
        # a whole-array check would hold an N x D temporary beside the index at 21M passages.
        source = EmbeddingSource(parts)
        if source.n != len(store):
            raise ValueError(f"{source.n} embeddings for {len(store)} passages")
        faiss_index = build_faiss(source, 0, len(store), factory, nprobe=nprobe)
        manifest = {"version": INDEX_VERSION, "factory": factory, "metric": "inner_product",
                    "dim": source.dim, "n": len(store), "nprobe": nprobe,
                    "encoder": encoder or {}, "corpus_checksum": store.checksum,
                    "shards": [{"dir": "shard-00000", "lo": 0, "hi": len(store)}],
                    **(extra or {})}
        return cls([(faiss_index, 0)], store, manifest)

    def search(self, queries_BD: np.ndarray, k: int,
               exclude_ids: Sequence[Iterable[int]] | Iterable[int] | None = None, *,
               nprobe: int | None = None, rerank: int | None = None) -> SearchResult:
        """Top-``k`` passages per query over every shard (exact merge), skipping
        ``exclude_ids`` (the leakage filter): one collection for all queries or one per query.
        When fewer than ``k`` passages are available, the missing slots have id -1 and a
        warning says so.

        ``nprobe`` (IVF lists searched) and ``rerank`` (re-score ``rerank × k`` candidates
        exactly from the stored vectors; 0: the approximate scores as they are) override the
        manifest's defaults for this call; re-ranking needs an index built with stored vectors
        (``--rerank`` or ``--target-recall``)."""
        q = checked_queries(queries_BD, self.manifest["dim"], k)
        b = q.shape[0]
        excl = per_query_exclusions(exclude_ids, b)
        fetch = k + max((len(e) for e in excl), default=0)
        factor = self.manifest.get("rerank_factor", 0) if rerank is None else int(rerank)
        if factor < 0:
            raise ValueError(f"rerank must be >= 0, got {factor}")
        if factor and not self.has_vectors:
            raise ValueError("re-ranking needs the vectors stored with the index; rebuild it "
                             "with --rerank F or --target-recall R")
        if nprobe is not None and nprobe <= 0:
            raise ValueError(f"nprobe must be positive, got {nprobe}")
        default_nprobe = self.manifest.get("nprobe", 16)
        scores, rows = [], []
        for (ix, lo), vectors in zip(self._search, self._vectors):
            if nprobe is not None:
                set_nprobe_of(ix, nprobe)
            try:
                s, r = ix.search(q, min(fetch * max(factor, 1), int(ix.ntotal)))
            finally:
                if nprobe is not None:
                    set_nprobe_of(ix, default_nprobe)
            if factor and vectors is not None:  # exact inner products of the candidates
                s = _exact_scores(q, vectors, r)
            scores.append(np.where(r >= 0, s, -np.inf).astype(np.float32))
            rows.append(np.where(r >= 0, r + lo, -1))
        scores_all, rows_all = np.concatenate(scores, 1), np.concatenate(rows, 1)
        order = np.lexsort((rows_all, -scores_all), axis=1)  # score desc, then row
        scores_all = np.take_along_axis(scores_all, order, 1)
        rows_all = np.take_along_axis(rows_all, order, 1)
        return assemble(self.store, scores_all, rows_all, excl, k)

    def set_nprobe(self, nprobe: int) -> None:
        """IVF lists searched per query from now on (recall against speed); no-op for
        indexes without inverted lists."""
        if all([set_nprobe_of(ix, nprobe) for ix, _ in self._search]):
            self.manifest["nprobe"] = nprobe

    def reconstruct_all(self) -> np.ndarray:
        """``[N, D]`` stored vectors in passage order (exact for Flat indexes)."""
        return np.concatenate([ix.reconstruct_n(0, int(ix.ntotal)) for ix, _ in self.shards])

    def save(self, directory: str | pathlib.Path) -> pathlib.Path:
        """Atomically write the index directory (temporary folder, then rename)."""
        out = pathlib.Path(directory)
        tmp = out.with_name(out.name + ".saving")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        self.store.write(tmp / STORE)
        for (ix, lo), spec in zip(self.shards, self.manifest["shards"]):
            write_shard(tmp / spec["dir"], ix, spec["lo"], spec["hi"], self.manifest)
        for spec, vectors in zip(self.manifest["shards"], self._vectors):
            if vectors is not None:  # the re-ranking vectors travel with the index
                shutil.copyfile(vectors.path, tmp / spec["dir"] / "vectors.npy")
        finish_index(tmp, self.manifest)
        replace_dir(tmp, out)
        return out

    @staticmethod
    def _read_manifest(d: pathlib.Path) -> dict:
        manifest_path = d / "manifest.json"
        if not d.is_dir():
            raise IndexLoadError(f"{d}: no such index directory")
        if not manifest_path.exists():
            raise IndexLoadError(f"{d}: no manifest.json, so this is not a complete index "
                                 "(an interrupted build?); rebuild it")
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise IndexLoadError(f"{manifest_path}: corrupt manifest ({err})") from err
        if manifest.get("version") != INDEX_VERSION:
            raise IndexLoadError(f"{d}: index version {manifest.get('version')} is not "
                                 f"{INDEX_VERSION}; rebuild it")
        return manifest

    @classmethod
    def verify(cls, directory: str | pathlib.Path) -> dict:
        """Hash every file of an index directory against its manifest (``replug index
        verify``); raises :class:`IndexLoadError` on the first problem."""
        d = local_copy(directory)
        manifest = cls._read_manifest(d)
        check_files(d, manifest.get("files", {}), full=True)
        return {"files": len(manifest.get("files", {})),
                "bytes": sum(f["size"] for f in manifest.get("files", {}).values())}

    @classmethod
    def info(cls, directory: str | pathlib.Path) -> dict:
        """What an index's manifest records, without loading it: size, factory, shards,
        bytes, search defaults, encoder, corpus, the recall measured at build or tuning."""
        m = cls._read_manifest(local_copy(directory))
        return {"index": str(directory), "n": m["n"], "dim": m["dim"], "factory": m["factory"],
                "shards": len(m["shards"]),
                "bytes": sum(f["size"] for f in m.get("files", {}).values()),
                "nprobe": m.get("nprobe"), "rerank_factor": m.get("rerank_factor", 0),
                "rerank_vectors": m.get("rerank_vectors", False),
                "encoder": m.get("encoder", {}), "recall": m.get("recall"),
                "build_seconds": m.get("build_seconds"), "corpus": m.get("corpus"),
                "corpus_checksum": m.get("corpus_checksum")}

    @classmethod
    def load(cls, directory: str | pathlib.Path, *, expect_encoder: dict | None = None,
             expect_corpus_checksum: str | None = None, mmap: bool = True,
             gpu: str = "auto") -> "Index":
        """Load and check an index directory; refuse a mismatched encoder or corpus, a
        missing, truncated or corrupt file, or a shard of another index. A remote folder
        (``gs://``...) is copied to local disk once (:mod:`replug_jax.remote`)."""
        d = local_copy(directory)
        manifest = cls._read_manifest(d)
        if expect_encoder is not None:
            got = manifest.get("encoder", {})
            for key in ("fingerprint", "pooling", "similarity"):
                if key in expect_encoder and got.get(key) != expect_encoder[key]:
                    raise IndexLoadError(
                        f"{d}: built with encoder {got.get('source')!r} ({key}="
                        f"{got.get(key)!r}) but the current retriever is "
                        f"{expect_encoder.get('source')!r} ({key}={expect_encoder[key]!r}); "
                        "rebuild the index with this retriever")
        if expect_corpus_checksum is not None and \
                manifest.get("corpus_checksum") != expect_corpus_checksum:
            raise IndexLoadError(f"{d}: built from a different corpus (checksum "
                                 f"{manifest.get('corpus_checksum', '?')[:12]} vs "
                                 f"{expect_corpus_checksum[:12]}); rebuild it")
        for spec in manifest["shards"]:  # cheap checks first: a shard missing or stray
            check_shard(d / spec["dir"], read_shard_info(d / spec["dir"]), spec, manifest)
        check_files(d, manifest.get("files", {}), full=False)
        return cls._open(d, manifest, mmap=mmap, gpu=gpu)

    @classmethod
    def _open(cls, d: pathlib.Path, manifest: dict, *, mmap: bool = True,
              gpu: str = "auto") -> "Index":
        """The index of directory ``d`` described by ``manifest`` (its files already
        checked): the store, the FAISS shards, the re-ranking vectors, the manifest's
        nprobe."""
        try:
            store = PassageStore.open(d / STORE)
        except ValueError as err:
            raise IndexLoadError(str(err)) from err
        shards = []
        for spec in manifest["shards"]:
            sd = d / spec["dir"]
            ix = read_faiss(sd / "index.faiss", mmap)
            if ix.ntotal != spec["hi"] - spec["lo"]:
                raise IndexLoadError(f"{sd}: {ix.ntotal} vectors for rows {spec['lo']}.."
                                     f"{spec['hi'] - 1}")
            shards.append((ix, spec["lo"]))
        if store.checksum != manifest["corpus_checksum"]:
            raise IndexLoadError(f"{d / STORE}: passages of another corpus than the manifest's")
        index = cls(shards, store, manifest, gpu=gpu)
        index.set_nprobe(manifest.get("nprobe", 16))  # the manifest's, not the file's own
        if manifest.get("rerank_vectors"):
            index._vectors = [NpyRows(d / spec["dir"] / "vectors.npy",
                                      n=spec["hi"] - spec["lo"], dim=manifest["dim"])
                              for spec in manifest["shards"]]
        return index


def _exact_scores(q_BD: np.ndarray, vectors: "NpyRows", rows_BF: np.ndarray) -> np.ndarray:
    """Inner products of each query with its candidate rows, read from ``vectors``."""
    flat = np.unique(rows_BF[rows_BF >= 0])
    if not len(flat):
        return np.full(rows_BF.shape, -np.inf, np.float32)
    cand_CD = vectors.take(flat).astype(np.float32)
    pos_BF = np.searchsorted(flat, np.maximum(rows_BF, 0))
    return np.einsum("bd,bfd->bf", q_BD, cand_CD[pos_BF])
