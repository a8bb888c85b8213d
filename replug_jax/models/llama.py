"""Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, optional tied head).

The module itself is :class:`replug_jax.models.decoder.CausalLM`; this file maps Hugging Face
``LlamaForCausalLM`` configs and checkpoints, and llama.cpp GGUF files, onto it.
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from replug_jax.models.decoder import CausalLM, DecoderConfig
from replug_jax.models.weights import WeightsError, transposed, unchanged

__all__ = ["CausalLM", "config_from_hf", "config_from_gguf", "hf_name_map", "gguf_name_map",
           "hf_tensors", "hf_ignored", "check_gguf", "build"]


def _rope(hf: dict) -> tuple[float, tuple | None]:
    """(theta, Llama 3 scaling or None) from ``rope_parameters`` / ``rope_scaling``."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("default", None):
        return theta, None
    if rope_type == "llama3":
        return theta, (float(params["factor"]), float(params["low_freq_factor"]),
                       float(params["high_freq_factor"]),
                       int(params["original_max_position_embeddings"]))
    raise ValueError(f"RoPE scaling {rope_type!r} is not supported (supported: plain RoPE, "
                     "'llama3')")


def config_from_hf(hf: dict, tensor_names: set[str] = frozenset()) -> DecoderConfig:
    """From an HF ``config.json`` of a Llama-family causal LM."""
    heads = hf["num_attention_heads"]
    theta, llama3 = _rope(hf)
    return DecoderConfig(
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
        num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        max_position=hf.get("max_position_embeddings", 2048), norm="rms",
        norm_eps=hf.get("rms_norm_eps", 1e-6), mlp="swiglu", position="rope",
        rope_theta=theta, rope_llama3=llama3, attn_bias=bool(hf.get("attention_bias", False))
        or hf.get("model_type") == "qwen2", mlp_bias=bool(hf.get("mlp_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), family="llama",
        bos_token_id=hf.get("bos_token_id"), eos_token_id=_first(hf.get("eos_token_id")),
        pad_token_id=hf.get("pad_token_id"))


def _first(x):
    return x[0] if isinstance(x, list) else x


def config_from_gguf(meta: dict, tensor_names: set[str]) -> DecoderConfig:
    """From GGUF metadata (``llama.*`` keys and ``tokenizer.ggml.*`` ids)."""
    a = "llama"
    heads = int(meta[f"{a}.attention.head_count"])
    d = int(meta[f"{a}.embedding_length"])
    return DecoderConfig(
        vocab_size=int(meta.get(f"{a}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        hidden_size=d, intermediate_size=int(meta[f"{a}.feed_forward_length"]),
        num_layers=int(meta[f"{a}.block_count"]), num_heads=heads,
        num_kv_heads=int(meta.get(f"{a}.attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{a}.attention.key_length", d // heads)),
        max_position=int(meta.get(f"{a}.context_length", 2048)), norm="rms",
        norm_eps=float(meta[f"{a}.attention.layer_norm_rms_epsilon"]), mlp="swiglu",
        position="rope", rope_theta=float(meta.get(f"{a}.rope.freq_base", 10000.0)),
        tie_embeddings="output.weight" not in tensor_names, family="llama",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))


def hf_name_map(cfg: DecoderConfig) -> dict:
    """Our parameter path -> (HF tensor name, transform). PyTorch Linear is ``[out, in]``."""
    m = {("embed", "embedding"): ("model.embed_tokens.weight", unchanged),
         ("final_norm", "scale"): ("model.norm.weight", unchanged)}
    if not cfg.tie_embeddings:
        m[("lm_head", "kernel")] = ("lm_head.weight", transposed)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        L = ("layers", i)
        m[L + ("attn_norm", "scale")] = (p + "input_layernorm.weight", unchanged)
        m[L + ("mlp_norm", "scale")] = (p + "post_attention_layernorm.weight", unchanged)
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
            m[L + ("attn", ours, "kernel")] = (p + f"self_attn.{theirs}.weight", transposed)
            if cfg.attn_bias and ours != "o":
                m[L + ("attn", ours, "bias")] = (p + f"self_attn.{theirs}.bias", unchanged)
        for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            m[L + ("mlp", ours, "kernel")] = (p + f"mlp.{theirs}.weight", transposed)
    return m


def unpermute_rope_rows(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE) back to HF's rotate-half rows."""
    out = w_out_in.shape[0]
    return (w_out_in.reshape(n_heads, out // n_heads // 2, 2, *w_out_in.shape[1:])
            .swapaxes(1, 2).reshape(w_out_in.shape))


def gguf_name_map(cfg: DecoderConfig) -> dict:
    """Our parameter path -> (GGUF tensor name, transform on the dequantised ``[out, in]``)."""
    m = {("embed", "embedding"): ("token_embd.weight", unchanged),
         ("final_norm", "scale"): ("output_norm.weight", unchanged)}
    if not cfg.tie_embeddings:
        m[("lm_head", "kernel")] = ("output.weight", transposed)
    for i in range(cfg.num_layers):
        p = f"blk.{i}."
        L = ("layers", i)
        m[L + ("attn_norm", "scale")] = (p + "attn_norm.weight", unchanged)
        m[L + ("mlp_norm", "scale")] = (p + "ffn_norm.weight", unchanged)
        m[L + ("attn", "q", "kernel")] = (
            p + "attn_q.weight", lambda w: transposed(unpermute_rope_rows(w, cfg.num_heads)))
        m[L + ("attn", "k", "kernel")] = (
            p + "attn_k.weight", lambda w: transposed(unpermute_rope_rows(w, cfg.num_kv_heads)))
        m[L + ("attn", "v", "kernel")] = (p + "attn_v.weight", transposed)
        m[L + ("attn", "o", "kernel")] = (p + "attn_output.weight", transposed)
        for ours, theirs in (("gate", "ffn_gate"), ("up", "ffn_up"), ("down", "ffn_down")):
            m[L + ("mlp", ours, "kernel")] = (p + f"{theirs}.weight", transposed)
    return m


def hf_tensors(tensors: dict) -> dict:
    return tensors


def hf_ignored(name: str, cfg: DecoderConfig) -> bool:
    """RoPE's cached inverse frequencies, and a tied head's saved copy of the embedding."""
    return name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and
                                                    name == "lm_head.weight")


def check_gguf(meta: dict, tensor_names: set[str], path) -> None:
    if "rope_freqs.weight" in tensor_names:
        raise WeightsError(f"{path}: per-frequency RoPE factors (rope_freqs, as in Llama 3.1+ "
                           "GGUF files) are not supported; load the Hugging Face folder "
                           "instead, whose 'llama3' RoPE scaling is")


def build(cfg: DecoderConfig, dtype, rngs: nnx.Rngs) -> CausalLM:
    return CausalLM(cfg, dtype=dtype, rngs=rngs)
