"""Remote sources (replug_jax/remote.py): an index and a retriever kept in a bucket load as
their local originals do, through etils.epath and fsspec (the bucket here: a local folder
behind a stand-in "gcs" filesystem), copied once and copied again when the remote changes."""

import importlib
import shutil

import numpy as np
import pytest

fsspec = pytest.importorskip("fsspec")


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """``gs://bucket/...`` served from ``tmp_path/bucket``; the copies go to ``tmp_path``."""
    from fsspec.implementations.local import LocalFileSystem

    root = tmp_path / "gcs"

    class StandInGCS(LocalFileSystem):
        protocol = ("gcs", "gs")

        @classmethod
        def _strip_protocol(cls, path):
            path = str(path)
            for prefix in ("gs://", "gcs://"):
                if path.startswith(prefix):
                    path = str(root / path[len(prefix):])
            return super()._strip_protocol(path)

    registry = importlib.import_module("fsspec.registry")  # the module, not its mapping
    monkeypatch.setitem(registry._registry, "gcs", StandInGCS)
    from etils.epath import backend  # it keeps the filesystem of a scheme once made

    backend.fsspec_backend._get_filesystem.cache_clear()
    bucket_dir = root / "bucket"
    monkeypatch.setenv("REPLUG_REMOTE_CACHE", str(tmp_path / "cache"))
    bucket_dir.mkdir(parents=True)
    yield bucket_dir
    backend.fsspec_backend._get_filesystem.cache_clear()


def test_an_index_in_a_bucket_loads_and_searches_as_the_local_one(bucket, monkeypatch):
    from replug_jax import remote
    from replug_jax.retrieval import Index
    from replug_jax.retrieval.corpus import Passage

    rng = np.random.default_rng(0)
    emb = rng.normal(size=(40, 8)).astype(np.float32)
    local = Index.build(emb, [Passage(i, f"passage {i}") for i in range(40)])
    local.save(bucket / "idx")
    q = rng.normal(size=(3, 8)).astype(np.float32)
    got = Index.load("gs://bucket/idx").search(q, 5)
    want = local.search(q, 5)
    np.testing.assert_array_equal(got.ids, want.ids)
    assert [p.text for p in got.passages[0]] == [p.text for p in want.passages[0]]
    assert Index.info("gs://bucket/idx/")["n"] == 40
    # a second load reads the copy; a changed remote is copied again
    opened = []
    real_open = open
    monkeypatch.setattr(remote, "open", lambda *a, **k: opened.append(a[0]) or real_open(*a, **k),
                        raising=False)
    Index.load("gs://bucket/idx")
    assert opened == []
    Index.build(emb[:30], [Passage(i, f"other {i}") for i in range(30)]).save(bucket / "idx")
    assert len(Index.load("gs://bucket/idx")) == 30 and opened


def test_a_retriever_in_a_bucket_encodes_as_the_packaged_one(bucket):
    from replug_jax.models.weights import packaged_path
    from replug_jax.retrieval.encoder import Retriever

    shutil.copytree(packaged_path("minilm"), bucket / "minilm")
    texts = ["Where is the Eiffel tower?", "A river runs through the city."]
    np.testing.assert_allclose(Retriever.load("gs://bucket/minilm").encode_queries(texts),
                               Retriever.load("minilm").encode_queries(texts), atol=1e-6)


def test_a_missing_remote_path_is_one_clear_error(bucket):
    from replug_jax.remote import local_copy

    with pytest.raises(FileNotFoundError, match="gs://bucket/nothing: no such remote"):
        local_copy("gs://bucket/nothing")
    assert local_copy("some/local/path").as_posix() == "some/local/path"
    (bucket / "empty").mkdir()
    copy = local_copy("gs://bucket/empty")
    assert copy.is_dir() and not any(copy.iterdir())


def test_a_remote_work_directory_is_refused_not_made_locally(tmp_path, monkeypatch):
    """pathlib would turn gs://bucket/run into a local folder gs:/bucket/run."""
    from replug_jax.train.loop import LSRTrainer
    from tests.helpers import BASE, PASSAGES, TRAIN
    from tests._models import tiny_lm, tiny_retriever

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="gs://bucket/run: a work directory must be on a local"):
        LSRTrainer(BASE, "gs://bucket/run", retriever=tiny_retriever(0), lm_scorer=tiny_lm(0),
                   passages=PASSAGES, train=TRAIN, progress=False)
    assert not (tmp_path / "gs:").exists()


def test_the_cli_takes_a_remote_index(bucket, capsys):
    """``replug index info gs://...`` reads the copy (pathlib alone turns gs:// into gs:/)."""
    from replug_jax.cli import main
    from replug_jax.retrieval import Index
    from replug_jax.retrieval.corpus import Passage

    emb = np.random.default_rng(0).normal(size=(12, 8)).astype(np.float32)
    Index.build(emb, [Passage(i, f"p {i}") for i in range(12)]).save(bucket / "idx")
    assert main(["index", "info", "gs://bucket/idx"]) == 0
    assert "12 passages × 8" in capsys.readouterr().out
    assert main(["index", "info", "gs://bucket/none"]) == 2
    assert "gs://bucket/none: no such remote" in capsys.readouterr().err
