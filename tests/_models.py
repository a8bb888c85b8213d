"""Shared helpers for model tests: tiny random HF checkpoints written with transformers."""

from __future__ import annotations

import pathlib

import numpy as np


def packaged_or_skip(name: str) -> pathlib.Path:
    import pytest

    from replug_jax.models.weights import WeightsError, packaged_path

    try:
        return packaged_path(name)
    except WeightsError as err:
        pytest.skip(str(err))


def torch_or_skip():
    import pytest

    return pytest.importorskip("torch", reason="PyTorch parity tests need the torch-test extra")


def save_tiny_bert(directory: pathlib.Path, seed: int = 0) -> pathlib.Path:
    """A random BertModel in HF layout, with the packaged MiniLM tokenizer (vocab 30522)."""
    torch = torch_or_skip()
    from transformers import AutoTokenizer, BertConfig, BertModel

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    BertModel(cfg).eval().save_pretrained(directory)
    AutoTokenizer.from_pretrained(str(packaged_or_skip("minilm"))).save_pretrained(directory)
    return directory


def write_smollm_tokenizer(directory: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    gguf = packaged_or_skip("smollm2")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(
        directory)


def random_ids(rng: np.random.Generator, shape, vocab: int) -> np.ndarray:
    return rng.integers(3, vocab, size=shape).astype(np.int32)
