"""What replug_jax/models/loading.py reads beside the weights: a GGUF's own tokenizer (no
torch, no hub) and the pooling a sentence-transformers folder declares."""

import json

import pytest

from replug_jax.models.loading import _sentence_transformers_pooling, gguf_tokenizer
from replug_jax.models.registry import WeightsError

META = {"tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": ["a", "b", "ab", "Ġ", "Ġab", "<|end|>"],
        "tokenizer.ggml.token_type": [1, 1, 1, 1, 1, 3],
        "tokenizer.ggml.merges": ["a b", "Ġ ab"],
        "tokenizer.ggml.eos_token_id": 5}


def test_gguf_byte_level_bpe_merges_and_keeps_special_tokens_whole(tmp_path):
    tok = gguf_tokenizer(tmp_path / "m.gguf", META)
    assert tok.convert_ids_to_tokens(tok("ab ab")["input_ids"]) == ["ab", "Ġab"]
    assert tok("ab<|end|>")["input_ids"] == [2, 5]  # the control token is never split
    assert tok.eos_token == "<|end|>" and tok.eos_token_id == 5
    assert tok.decode([2, 4]) == "ab ab"
    with pytest.raises(WeightsError, match="not supported"):
        gguf_tokenizer(tmp_path / "m.gguf", {**META, "tokenizer.ggml.model": "llama"})


def test_sentence_transformers_folders_declare_pooling_and_normalisation(tmp_path):
    assert _sentence_transformers_pooling(tmp_path) == (None, False)  # a plain HF folder
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (tmp_path / "modules.json").write_text(json.dumps(
        [{"type": "sentence_transformers.models.Transformer"},
         {"type": "sentence_transformers.models.Pooling"},
         {"type": "sentence_transformers.models.Normalize"}]))
    assert _sentence_transformers_pooling(tmp_path) == ("cls", True)
