"""The decoder families' checkpoint maps (replug_jax/models/{gpt2,llama,opt}.py) and the
lazy tensors and transforms they use (replug_jax/models/tensors.py): every tensor of a
transformers checkpoint lands on exactly one parameter of ours, or is named as ignored, with
the shape that parameter has; llama.cpp's Q/K row order is undone exactly."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from replug_jax.models import gpt2, llama, opt
from replug_jax.models.registry import WeightsError
from replug_jax.models.tensors import column_block, lazy_safetensors, transposed, unchanged
from tests._models import torch_or_skip


def _hf_model(family):
    torch_or_skip()
    import transformers as tf

    small = dict(vocab_size=128, max_position_embeddings=32)
    if family is gpt2:
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=128, n_embd=16, n_layer=2,
                                                n_head=2, n_positions=32))
    if family is opt:
        return tf.OPTForCausalLM(tf.OPTConfig(hidden_size=16, num_hidden_layers=2, ffn_dim=24,
                                              num_attention_heads=2, word_embed_proj_dim=16,
                                              **small))
    return tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=16, intermediate_size=24,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, tie_word_embeddings=False,
                                              **small))


@pytest.mark.torch
@pytest.mark.parametrize("family", [gpt2, opt, llama], ids=lambda f: f.__name__.split(".")[-1])
def test_every_checkpoint_tensor_maps_onto_one_parameter_of_its_shape(family):
    ref = _hf_model(family)
    shapes = family.hf_tensors({k: tuple(v.shape) for k, v in ref.state_dict().items()})
    cfg = family.config_from_hf(ref.config.to_dict(), set(shapes))
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size) == (2, 16, 128)
    names = family.hf_name_map(cfg)
    ours = {tuple(path): v.shape for path, v in
            nnx.state(family.build(cfg, jnp.float32, nnx.Rngs(0)), nnx.Param).flat_state()}
    stacked = {}  # the layers are one scanned stack: [num_layers, ...] per parameter
    for path, (name, transform) in names.items():
        assert name in shapes, f"{path} reads {name}, which the checkpoint lacks"
        shape = transform.shape(shapes[name])
        if path[0] == "layers":
            stacked.setdefault(("layers", *path[2:]), set()).add((path[1], shape))
        else:
            assert ours[path] == shape, path
    for path, layers in stacked.items():
        assert {i for i, _ in layers} == set(range(cfg.num_layers))
        assert {(cfg.num_layers, *s) for _, s in layers} == {ours[path]}, path
    assert set(ours) == {p for p in ours if p[0] != "layers"} | set(stacked)
    assert set(ours) - set(stacked) == {p for p in names if p[0] != "layers"}
    unread = {n for n in shapes if n not in {name for name, _ in names.values()}}
    assert all(family.hf_ignored(n, cfg) for n in unread), unread


def test_llama_cpp_rope_rows_are_undone():
    """llama.cpp's converter permutes Q/K rows per head as ``reshape(heads, 2, d/2, in)
    .swapaxes(1, 2)`` (interleaved RoPE); ours restores HF's rotate-half order."""
    rng = np.random.default_rng(0)
    for heads in (1, 2, 4):
        w = rng.normal(size=(heads * 8, 5)).astype(np.float32)
        gguf = w.reshape(heads, 2, 4, 5).swapaxes(1, 2).reshape(w.shape)
        assert not np.array_equal(gguf, w)
        np.testing.assert_array_equal(llama.unpermute_rope_rows(gguf, heads), w)


def test_lazy_blocks_equal_the_whole_and_transforms_take_the_right_block(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1)
    fused = rng.normal(size=(6, 12)).astype(np.float32)  # GPT-2's c_attn: q | k | v columns
    save_file({"c_attn": fused, "w": fused.T.copy()}, str(tmp_path / "m.safetensors"))
    lazy = lazy_safetensors(tmp_path / "m.safetensors")
    assert lazy["c_attn"].shape == (6, 12)
    np.testing.assert_array_equal(lazy["c_attn"](), fused)
    np.testing.assert_array_equal(lazy["c_attn"][1:3, 4:], fused[1:3, 4:])
    k = column_block(1, 4)
    assert k.shape((6, 12)) == (6, 4)
    np.testing.assert_array_equal(k(fused), fused[:, 4:8])
    block = (slice(2, 5), slice(1, 3))  # rows 2..4, columns 1..2 of the k block
    np.testing.assert_array_equal(k.block(lazy["c_attn"][k.source_index(block, (6, 4))]),
                                  fused[:, 4:8][block])
    np.testing.assert_array_equal(transposed.block(lazy["w"][transposed.source_index(
        block, (6, 12))]), fused[block])
    assert transposed.shape((12, 6)) == (6, 12) and unchanged.shape((3,)) == (3,)
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00")
    with pytest.raises(WeightsError, match="truncated or corrupt"):
        lazy_safetensors(tmp_path / "bad.safetensors")
