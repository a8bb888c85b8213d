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


_TOKENIZERS: dict = {}


def cached_tokenizer(name: str):
    """Packaged tokenizers, loaded once per test session (the GGUF one takes seconds)."""
    from replug_jax.models import load_tokenizer

    packaged_or_skip(name)
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = load_tokenizer(name)
    return _TOKENIZERS[name]


def tiny_retriever(seed: int = 0, similarity: str = "cosine"):
    """A random 2-layer BERT (hidden 32) with the MiniLM tokenizer, built in memory."""
    from flax import nnx

    from replug_jax.models import RetrieverModel
    from replug_jax.models.bert import BertConfig, BertEncoder
    from replug_jax.retrieval.encoder import Retriever

    cfg = BertConfig(hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                     max_position=64, has_pooler=False)
    model = RetrieverModel(BertEncoder(cfg, rngs=nnx.Rngs(seed)), cached_tokenizer("minilm"),
                           cfg, "mean", False, f"tiny-bert-{seed}", f"tiny-bert-{seed}")
    return Retriever(model, similarity=similarity, max_length=64, batch_size=8)


def tiny_lm(seed: int = 0, max_context: int = 256):
    """A random 2-layer Llama (hidden 32) with the SmolLM2 tokenizer, as a FlaxLM."""
    from flax import nnx

    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.models import CausalLM, DecoderConfig, LanguageModel

    cfg = DecoderConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=8, max_position=512,
                        eos_token_id=2, pad_token_id=2)
    lm = LanguageModel(CausalLM(cfg, rngs=nnx.Rngs(seed)), cached_tokenizer("smollm2"), cfg,
                       f"tiny-llama-{seed}", f"tiny-llama-{seed}")
    return FlaxLM(lm, max_context=max_context, batch_size=8)
