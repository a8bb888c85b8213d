"""The integrity of an index directory: every file's size, SHA-256 and sampled blocks.

A manifest's file table records each file's size, modification time and SHA-256, and for a
large file the SHA-256 of a few blocks at fixed offsets. Loading checks every size, hashes the
small files, hashes a large one whole only when its size or mtime changed and otherwise its
sampled blocks (a few MiB: a corrupted ``passages.arrow`` or FAISS file is caught without
reading it whole); ``replug index verify`` hashes everything.
"""

from __future__ import annotations

import hashlib
import pathlib
from typing import Iterable, Sequence

import numpy as np

SMALL_FILE_BYTES = 64 << 20  # always hashed on load
SAMPLE_BYTES = 1 << 20  # one sampled block of a large file


class IndexLoadError(ValueError):
    """A missing, corrupt or mismatched index directory or embeddings file."""


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def sample_offsets(size: int, count: int = 4) -> list[int]:
    """``count`` block offsets spread evenly over a file of ``size`` bytes (first and last
    block included): where a large file is sampled at every load."""
    last = max(0, size - SAMPLE_BYTES)
    return sorted({int(x) for x in np.linspace(0, last, count)})


def sample_sha256(path: pathlib.Path, offsets: Sequence[int]) -> str:
    """SHA-256 of the ``SAMPLE_BYTES`` blocks of ``path`` at ``offsets``."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for offset in offsets:
            f.seek(offset)
            h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest()


def file_table(d: pathlib.Path, names: Iterable[str]) -> dict:
    """``{name: {size, mtime_ns, sha256[, sample_offsets, sample_sha256]}}`` of files in ``d``."""
    files = {}
    for name in names:
        st = (d / name).stat()
        files[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
                       "sha256": sha256_file(d / name)}
        if st.st_size > SMALL_FILE_BYTES:  # sampled at every load, hashed whole by verify
            offsets = sample_offsets(st.st_size)
            files[name].update(sample_offsets=offsets,
                               sample_sha256=sample_sha256(d / name, offsets))
    return files


def check_files(d: pathlib.Path, files: dict, full: bool) -> None:
    """Check the files of ``d`` against a :func:`file_table`: sizes always; SHA-256 of small,
    modified or (``full``) all files; sampled blocks of the others."""
    for name, info in files.items():
        path = d / name
        if not path.exists():
            raise IndexLoadError(f"{path}: missing; the index directory is incomplete")
        st = path.stat()
        if st.st_size != info["size"]:
            raise IndexLoadError(f"{path}: {st.st_size} bytes where the manifest records "
                                 f"{info['size']}: the file is truncated or was replaced")
        if full or st.st_size <= SMALL_FILE_BYTES or st.st_mtime_ns != info["mtime_ns"]:
            if sha256_file(path) != info["sha256"]:
                raise IndexLoadError(f"{path}: checksum mismatch, the file is corrupt")
        elif "sample_offsets" in info and sample_sha256(
                path, info["sample_offsets"]) != info["sample_sha256"]:
            raise IndexLoadError(f"{path}: sampled blocks differ from the manifest's "
                                 "hashes, the file is corrupt (replug index verify "
                                 "checks it whole)")
