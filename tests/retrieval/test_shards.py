"""One FAISS shard's files (replug_jax/retrieval/shards.py): written whole, read back
memory-mapped, with the re-ranking vectors, and refused when they belong to another build."""

import dataclasses

import numpy as np
import pytest

from replug_jax.retrieval.integrity import IndexLoadError
from replug_jax.retrieval.shards import check_shard, read_faiss, read_shard_info, write_shard

MANIFEST = {"corpus_checksum": "c0ffee", "factory": "Flat", "dim": 8, "rerank_vectors": True,
            "encoder": {"fingerprint": "f", "similarity": "cosine", "pooling": "mean",
                        "max_length": 128}}


@dataclasses.dataclass
class Rows:
    """The embedding source a build streams rows from."""
    vectors: np.ndarray

    @property
    def dim(self) -> int:
        return self.vectors.shape[1]

    def rows(self, lo: int, hi: int) -> np.ndarray:
        return self.vectors[lo:hi]


def test_a_shard_round_trips_and_refuses_another_build(tmp_path):
    import faiss

    vectors = np.random.default_rng(0).normal(size=(40, 8)).astype(np.float32)
    index = faiss.IndexFlatIP(8)
    index.add(vectors[10:30])
    shard = tmp_path / "shard-0"
    write_shard(shard, index, 10, 30, MANIFEST, Rows(vectors))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-0"]  # no staging left
    np.testing.assert_array_equal(np.load(shard / "vectors.npy"),
                                  vectors[10:30].astype(np.float16))
    info = read_shard_info(shard)
    assert (info["lo"], info["hi"], info["ntotal"]) == (10, 30, 20)
    check_shard(shard, info, {"lo": 10, "hi": 30}, MANIFEST)
    _, ids = read_faiss(shard / "index.faiss", mmap=True).search(vectors[12:13], 1)
    assert ids[0, 0] == 2  # row 12 of the corpus is the shard's third
    for spec, manifest, what in (({"lo": 0, "hi": 20}, MANIFEST, "lo"),
                                 ({"lo": 10, "hi": 30}, {**MANIFEST, "factory": "HNSW32"},
                                  "factory"),
                                 ({"lo": 10, "hi": 30}, {**MANIFEST, "encoder": {
                                     **MANIFEST["encoder"], "max_length": 512}},
                                  "max_length")):
        with pytest.raises(IndexLoadError, match=f"another index \\({what} is"):
            check_shard(shard, info, spec, manifest)


def test_a_missing_or_corrupt_shard_is_named(tmp_path):
    with pytest.raises(IndexLoadError, match="missing shard"):
        read_shard_info(tmp_path)
    (tmp_path / "shard.json").write_text("{")
    with pytest.raises(IndexLoadError, match="corrupt"):
        read_shard_info(tmp_path)
    (tmp_path / "index.faiss").write_bytes(b"not faiss")
    with pytest.raises(IndexLoadError, match="FAISS cannot read it"):
        read_faiss(tmp_path / "index.faiss", mmap=True)
