"""Dense index over FAISS (host) with an exact JAX top-k oracle (device).

The :class:`Index` stores vectors in FAISS — exact inner product by default (cosine, since
the retriever normalises embeddings), or any ``faiss.index_factory`` string (``IVF1024,Flat``,
``HNSW32``, ``IVF256,PQ16``) for scale; it moves to the GPUs when FAISS sees any. An index
directory holds ``index.faiss`` (FAISS's own format, no pickle), ``ids.npy``,
``passages.jsonl`` and ``manifest.json``; it is written to a temporary folder and renamed, and
loading checks checksums and refuses an index built by another encoder or from another corpus.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import shutil
import warnings
from typing import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from replug_jax.retrieval.corpus import Passage, corpus_checksum, read_passages, write_passages

INDEX_VERSION = 1


class IndexLoadError(ValueError):
    """A missing, corrupt or mismatched index directory."""


@dataclasses.dataclass
class SearchResult:
    ids: np.ndarray  # [B, k] int64 passage ids, -1 where fewer than k exist
    scores: np.ndarray  # [B, k] float32 similarities, -inf where missing
    passages: list[list[Passage]]  # [B][<=k]

    @property
    def valid(self) -> np.ndarray:
        return self.ids >= 0


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def exact_topk(queries_BD, corpus_ND, k: int, block: int = 65536):
    """Exact maximum-inner-product top-k in JAX: the oracle FAISS is tested against.

    The corpus is scanned in blocks of ``block`` rows (``lax.map``), each block's top-k kept,
    then merged, so memory is ``O(B·block)``; on a mesh, shard ``corpus_ND`` along N and jit
    distributes the blocks. Returns ``(scores [B, k], ids [B, k])``.
    """
    q = jnp.asarray(queries_BD, jnp.float32)
    c = jnp.asarray(corpus_ND, jnp.float32)
    n = c.shape[0]
    k = min(k, n)
    block = min(block, n)
    n_blocks = -(-n // block)
    pad = n_blocks * block - n
    c_blocks = jnp.pad(c, ((0, pad), (0, 0))).reshape(n_blocks, block, -1)
    offsets = jnp.arange(n_blocks) * block
    kb = min(k, block)

    def one_block(args):
        cb, off = args
        s = q @ cb.T
        s = jnp.where(off + jnp.arange(block)[None, :] < n, s, -jnp.inf)
        vals, idx = jax.lax.top_k(s, kb)
        return vals, idx + off

    vals, idx = jax.lax.map(one_block, (c_blocks, offsets))  # [nb, B, kb]
    vals = jnp.moveaxis(vals, 0, 1).reshape(q.shape[0], -1)
    idx = jnp.moveaxis(idx, 0, 1).reshape(q.shape[0], -1)
    top_vals, pos = jax.lax.top_k(vals, k)
    return top_vals, jnp.take_along_axis(idx, pos, axis=1)


def per_query_exclusions(exclude_ids, num_queries: int) -> list[set[int]]:
    """``exclude_ids`` as one set per query: ``None``, one collection of ids for every query,
    or ``num_queries`` collections (one per query)."""
    if exclude_ids is None:
        return [set() for _ in range(num_queries)]
    items = list(exclude_ids)
    if items and len(items) == num_queries and all(
            isinstance(e, (set, list, tuple, np.ndarray, frozenset)) for e in items):
        return [set(int(i) for i in e) for e in items]
    shared = set(int(i) for i in items)
    return [shared] * num_queries


class Index:
    """FAISS vectors + integer ids + passages + a manifest describing how they were made."""

    def __init__(self, faiss_index, ids: np.ndarray, passages: list[Passage], manifest: dict):
        self._index = faiss_index
        self.ids = np.asarray(ids, np.int64)
        self.passages = passages
        self._by_id = {p.id: p for p in passages}
        self.manifest = manifest
        self._search_index = self._to_gpu(faiss_index)

    def __len__(self) -> int:
        return int(self._index.ntotal)

    @staticmethod
    def _to_gpu(index):
        import faiss

        if faiss.get_num_gpus() > 0:
            return faiss.index_cpu_to_all_gpus(index)
        return index

    @classmethod
    def build(cls, embeddings_ND: np.ndarray, passages: list[Passage], *,
              factory: str = "Flat", encoder: dict | None = None, nprobe: int = 16,
              extra: dict | None = None) -> "Index":
        """Index ``embeddings_ND`` (row i is ``passages[i]``) with ``faiss.index_factory``."""
        import faiss

        emb = np.ascontiguousarray(np.asarray(embeddings_ND, np.float32))
        if emb.ndim != 2 or emb.shape[0] == 0:
            raise ValueError(f"need a non-empty [N, D] embedding matrix, got {emb.shape}")
        if emb.shape[0] != len(passages):
            raise ValueError(f"{emb.shape[0]} embeddings for {len(passages)} passages")
        if not np.isfinite(emb).all():
            raise ValueError("embeddings contain NaN or inf; refusing to index them")
        ids = np.array([p.id for p in passages], np.int64)
        base = faiss.index_factory(emb.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
        if not base.is_trained:
            base.train(emb)
        if hasattr(base, "nprobe"):
            base.nprobe = nprobe
        index = faiss.IndexIDMap2(base)
        index.add_with_ids(emb, ids)
        manifest = {"version": INDEX_VERSION, "factory": factory, "metric": "inner_product",
                    "dim": int(emb.shape[1]), "n": int(emb.shape[0]), "nprobe": nprobe,
                    "encoder": encoder or {}, "corpus_checksum": corpus_checksum(passages),
                    **(extra or {})}
        return cls(index, ids, passages, manifest)

    def search(self, queries_BD: np.ndarray, k: int,
               exclude_ids: Sequence[Iterable[int]] | Iterable[int] | None = None
               ) -> SearchResult:
        """Top-``k`` passages per query, skipping ``exclude_ids`` (the leakage filter).

        ``exclude_ids`` is one collection for all queries or one per query. When fewer than
        ``k`` passages are available, the missing slots have id -1 and a warning says so.
        """
        q = np.ascontiguousarray(np.asarray(queries_BD, np.float32))
        if q.ndim != 2 or q.shape[1] != self.manifest["dim"]:
            raise ValueError(f"queries must be [B, {self.manifest['dim']}], got {q.shape}")
        if k <= 0:
            raise ValueError(f"k must be positive, got {k}")
        b = q.shape[0]
        excl = per_query_exclusions(exclude_ids, b)
        fetch = min(len(self), k + max((len(e) for e in excl), default=0))
        scores, ids = self._search_index.search(q, fetch)
        out_ids = np.full((b, k), -1, np.int64)
        out_scores = np.full((b, k), -np.inf, np.float32)
        passages: list[list[Passage]] = []
        short = 0
        for i in range(b):
            keep = [(s, j) for s, j in zip(scores[i], ids[i]) if j >= 0 and int(j) not in excl[i]]
            keep = keep[:k]
            short += len(keep) < k
            for r, (s, j) in enumerate(keep):
                out_ids[i, r], out_scores[i, r] = j, s
            passages.append([self._by_id[int(j)] for _, j in keep])
        if short:
            warnings.warn(f"asked for k={k} but only {len(self)} passages exist (after "
                          f"exclusions) for {short} of {b} queries; returning what exists",
                          stacklevel=2)
        return SearchResult(out_ids, out_scores, passages)

    def reconstruct_all(self) -> np.ndarray:
        """``[N, D]`` stored vectors in passage order (exact for Flat indexes)."""
        return np.stack([self._index.reconstruct(int(i)) for i in self.ids])

    def save(self, directory: str | pathlib.Path) -> pathlib.Path:
        """Atomically write the index directory (temporary folder, then rename)."""
        import faiss

        out = pathlib.Path(directory)
        tmp = out.with_name(out.name + ".saving")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        faiss.write_index(self._index, str(tmp / "index.faiss"))
        np.save(tmp / "ids.npy", self.ids)
        write_passages(self.passages, tmp / "passages.jsonl")
        manifest = dict(self.manifest)
        manifest["checksums"] = {name: _sha256(tmp / name)
                                 for name in ("index.faiss", "ids.npy", "passages.jsonl")}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
        if out.exists():
            old = out.with_name(out.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
        return out

    @classmethod
    def load(cls, directory: str | pathlib.Path, *, expect_encoder: dict | None = None,
             expect_corpus_checksum: str | None = None) -> "Index":
        """Load and verify an index directory; refuse a mismatched encoder or corpus."""
        import faiss

        d = pathlib.Path(directory)
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
        for name, digest in manifest.get("checksums", {}).items():
            if not (d / name).exists():
                raise IndexLoadError(f"{d / name}: missing; the index directory is incomplete")
            if _sha256(d / name) != digest:
                raise IndexLoadError(f"{d / name}: checksum mismatch, the file is corrupt")
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
        index = faiss.read_index(str(d / "index.faiss"))
        ids = np.load(d / "ids.npy", allow_pickle=False)
        passages = read_passages(d / "passages.jsonl")
        if index.ntotal != len(ids) or len(ids) != len(passages):
            raise IndexLoadError(f"{d}: {index.ntotal} vectors, {len(ids)} ids and "
                                 f"{len(passages)} passages do not agree")
        return cls(index, ids, passages, manifest)


def build_index(passages: list[Passage], retriever, out_dir: str | pathlib.Path, *,
                factory: str = "Flat", block_size: int = 1024, progress: bool = True,
                extra: dict | None = None) -> Index:
    """Encode ``passages`` (resumably) and save a FAISS index to ``out_dir``.

    Embeddings are written to ``<out_dir>.partial/embeddings.npy``; an interrupted build
    resumes from there, and only a finished build appears at ``out_dir``.
    """
    if not passages:
        raise ValueError("cannot build an index from an empty corpus")
    out = pathlib.Path(out_dir)
    work = out.with_name(out.name + ".partial")
    work.mkdir(parents=True, exist_ok=True)
    before = retriever.truncated
    texts = [corpus_text(p) for p in passages]
    emb = retriever.encode_to_file(texts, work / "embeddings.npy", block_size=block_size,
                                   progress=progress)
    index = Index.build(np.asarray(emb), passages, factory=factory, encoder=retriever.identity,
                        extra={"truncated_passages": retriever.truncated - before,
                               **(extra or {})})
    index.save(out)
    shutil.rmtree(work, ignore_errors=True)
    return index


def corpus_text(passage: Passage) -> str:
    """The text the retriever embeds for a passage (title prepended, as in DPR/Contriever)."""
    if passage.title and not passage.text.startswith(passage.title):
        return f"{passage.title}. {passage.text}"
    return passage.text
