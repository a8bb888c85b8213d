"""The files of one FAISS shard of an index directory (``shard-<s>/``: ``index.faiss``,
``shard.json`` with its range and build key, ``vectors.npy`` for re-ranking) and the
manifest's file table: written atomically, read memory-mapped, refused when they belong to
another build."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np

from replug_jax.fileio import atomic_path, replace_dir, write_json_atomic
from replug_jax.retrieval.embeddings import EmbeddingSource
from replug_jax.retrieval.integrity import IndexLoadError, file_table

ADD_BATCH = 65536  # vectors added to a FAISS index (or written for re-ranking) at a time


def read_faiss(path: pathlib.Path, mmap: bool):
    """Read a FAISS file, memory-mapped when ``mmap``: flat codes through
    ``IO_FLAG_MMAP_IFC``, inverted lists through ``IO_FLAG_MMAP`` (each refuses the other's
    kind, so the first that applies is used)."""
    import faiss

    attempts = [faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY,
                faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY] if mmap else [0]
    error = None
    for flags in attempts:
        try:
            return faiss.read_index(str(path), flags)
        except RuntimeError as err:
            error = err
    raise IndexLoadError(f"{path}: FAISS cannot read it ({str(error).splitlines()[0]})")


def read_shard_info(sd: pathlib.Path) -> dict:
    if not (sd / "shard.json").exists():
        raise IndexLoadError(f"{sd}: missing shard; the index is incomplete (rebuild or copy "
                             "the shard)")
    try:
        return json.loads((sd / "shard.json").read_text())
    except json.JSONDecodeError as err:
        raise IndexLoadError(f"{sd / 'shard.json'}: corrupt ({err})") from err


def shard_key(manifest: dict) -> dict:
    """Every setting that changes a FAISS shard's bytes: a shard whose ``shard.json`` differs
    in any of them belongs to another build. (``nprobe`` is a search setting, applied from the
    manifest at load, so it is not part of the key.)"""
    enc = manifest.get("encoder", {})
    return {"corpus_checksum": manifest["corpus_checksum"], "factory": manifest["factory"],
            "encoder_fingerprint": enc.get("fingerprint"), "similarity": enc.get("similarity"),
            "pooling": enc.get("pooling"), "max_length": enc.get("max_length"),
            "dim": manifest["dim"], "embeddings": manifest.get("embeddings_key"),
            "train_size": manifest.get("train_size"),
            "rerank_vectors": bool(manifest.get("rerank_vectors")),
            "rerank_dtype": manifest.get("rerank_dtype", "float16")}


def check_shard(sd: pathlib.Path, info: dict, spec: dict, manifest: dict) -> None:
    want = {**shard_key(manifest), "lo": spec["lo"], "hi": spec["hi"]}
    for key, value in want.items():
        if info.get(key) != value:
            raise IndexLoadError(f"{sd}: a shard of another index ({key} is {info.get(key)!r}, "
                                 f"this index needs {value!r}); rebuild it")


def _write_vectors(path: pathlib.Path, source: "EmbeddingSource", lo: int, hi: int,
                   dtype: str = "float16", batch: int = ADD_BATCH) -> None:
    """Rows ``lo..hi-1`` of ``source`` as a float16 (or float32) ``.npy`` for re-ranking."""
    with atomic_path(path, suffix=".npy") as tmp, open(tmp, "wb") as f:
        # streamed with write(), not a memory map: written pages never count as ours
        np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(
            np.dtype(dtype)), "fortran_order": False, "shape": (hi - lo, source.dim)})
        for a in range(lo, hi, batch):
            f.write(source.rows(a, min(hi, a + batch)).astype(dtype).tobytes())


def write_shard(sd: pathlib.Path, faiss_index, lo: int, hi: int, manifest: dict,
                source: "EmbeddingSource | None" = None) -> None:
    """Write one FAISS shard atomically (temporary folder, then rename), with its float16
    vectors when the index re-ranks."""
    import faiss

    tmp = sd.with_name(sd.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    faiss.write_index(faiss_index, str(tmp / "index.faiss"))
    if manifest.get("rerank_vectors") and source is not None:
        _write_vectors(tmp / "vectors.npy", source, lo, hi,
                       manifest.get("rerank_dtype", "float16"))
    write_json_atomic({**shard_key(manifest), "lo": lo, "hi": hi,
                       "ntotal": int(faiss_index.ntotal)}, tmp / "shard.json")
    replace_dir(tmp, sd)


def finish_index(d: pathlib.Path, manifest: dict) -> None:
    """Write the manifest with the table of every file's size, mtime and SHA-256."""
    per_shard = ("index.faiss", "shard.json") + (("vectors.npy",) if manifest.get(
        "rerank_vectors") else ())
    names = ["passages.arrow", "passages.json"] + [
        f"{s['dir']}/{f}" for s in manifest["shards"] for f in per_shard]
    files = file_table(d, names)
    write_json_atomic({**manifest, "files": files}, d / "manifest.json")
