"""replug_jax/train/refresh.py: parameter snapshots (flat .npz names) round-trip, and a process
waiting for another's embeddings gives up with a message naming the file."""

import numpy as np
import pytest

from replug_jax.train.refresh import flatten_params, unflatten_params, wait_for_embeddings


def test_a_parameter_tree_round_trips_through_its_flat_names():
    tree = {"emb": {"w": np.arange(6.0).reshape(2, 3)}, "ln": {"b": np.ones(3), "g": {"x": 2.0}}}
    flat = flatten_params(tree)
    assert sorted(flat) == ["emb/w", "ln/b", "ln/g/x"]
    back = unflatten_params(flat, tree)
    np.testing.assert_array_equal(back["emb"]["w"], tree["emb"]["w"])
    assert float(back["ln"]["g"]["x"]) == 2.0
    with pytest.raises(KeyError):
        unflatten_params({"emb/w": flat["emb/w"]}, tree)


def test_embeddings_are_read_once_complete_and_waiting_has_a_limit(tmp_path):
    path = tmp_path / "emb.npy"
    np.save(path, np.ones((2, 3), np.float32))
    (tmp_path / "emb.npy.progress.json").write_text("{}")  # still being written
    with pytest.raises(TimeoutError, match="emb.npy was not complete after 0 s"):
        wait_for_embeddings(path, timeout=0.05, poll=0.01)
    (tmp_path / "emb.npy.progress.json").unlink()
    assert wait_for_embeddings(path, timeout=0.05).shape == (2, 3)
