"""OPT decoder (Zhang et al. 2022; one of the paper's LM families): learned positions with an
offset of 2, LayerNorm before each sub-block (after it in OPT-350m), ReLU MLP, biased
projections, tied head, and in OPT-350m a projection between its 512-wide embedding and the
1024-wide model.

The module is :class:`replug_jax.models.decoder.CausalLM` configured for OPT; this file maps
Hugging Face ``OPTForCausalLM`` configs and checkpoints onto it.
"""

from __future__ import annotations

from flax import nnx

from replug_jax.models.decoder import CausalLM, DecoderConfig
from replug_jax.models.weights import transposed, unchanged

__all__ = ["CausalLM", "config_from_hf", "hf_name_map", "hf_tensors", "hf_ignored", "build"]

# OPTLearnedPositionalEmbedding: position p is row p + 2 (rows 0 and 1 were fairseq's padding).
POSITION_OFFSET = 2


def config_from_hf(hf: dict, tensor_names: set[str] = frozenset()) -> DecoderConfig:
    act = hf.get("activation_function", "relu")
    if act != "relu":
        raise ValueError(f"unsupported OPT activation_function {act!r} (supported: 'relu')")
    if not hf.get("layer_norm_elementwise_affine", True):
        raise ValueError("OPT with layer_norm_elementwise_affine=false is not supported")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    embed_dim = hf.get("word_embed_proj_dim") or d
    pre = bool(hf.get("do_layer_norm_before", True))
    bias = bool(hf.get("enable_bias", True))
    return DecoderConfig(
        vocab_size=hf["vocab_size"], hidden_size=d, intermediate_size=hf["ffn_dim"],
        num_layers=hf["num_hidden_layers"], num_heads=heads, num_kv_heads=heads,
        head_dim=d // heads, max_position=hf["max_position_embeddings"], norm="layer",
        norm_eps=1e-5, norm_position="pre" if pre else "post",
        final_norm=pre and not hf.get("_remove_final_layer_norm", False), mlp="relu",
        position="learned", position_offset=POSITION_OFFSET,
        embed_dim=embed_dim if embed_dim != d else None, attn_bias=bias, mlp_bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)), family="opt",
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"))


def hf_name_map(cfg: DecoderConfig) -> dict:
    """Our parameter path -> (HF tensor name without the ``model.`` prefix, transform)."""
    p0 = "decoder."
    m = {("embed", "embedding"): (p0 + "embed_tokens.weight", unchanged),
         ("pos_embed", "embedding"): (p0 + "embed_positions.weight", unchanged)}
    if cfg.final_norm:
        m[("final_norm", "scale")] = (p0 + "final_layer_norm.weight", unchanged)
        m[("final_norm", "bias")] = (p0 + "final_layer_norm.bias", unchanged)
    if cfg.embed_dim:
        m[("project_in", "kernel")] = (p0 + "project_in.weight", transposed)
        m[("project_out", "kernel")] = (p0 + "project_out.weight", transposed)
    if not cfg.tie_embeddings:
        m[("lm_head", "kernel")] = ("lm_head.weight", transposed)
    for i in range(cfg.num_layers):
        p = f"{p0}layers.{i}."
        L = ("layers", i)
        for ours, theirs in (("attn_norm", "self_attn_layer_norm"),
                             ("mlp_norm", "final_layer_norm")):
            m[L + (ours, "scale")] = (p + f"{theirs}.weight", unchanged)
            m[L + (ours, "bias")] = (p + f"{theirs}.bias", unchanged)
        for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "out_proj")):
            m[L + ("attn", ours, "kernel")] = (p + f"self_attn.{theirs}.weight", transposed)
            if cfg.attn_bias:
                m[L + ("attn", ours, "bias")] = (p + f"self_attn.{theirs}.bias", unchanged)
        for ours, theirs in (("up", "fc1"), ("down", "fc2")):
            m[L + ("mlp", ours, "kernel")] = (p + f"{theirs}.weight", transposed)
            if cfg.mlp_bias:
                m[L + ("mlp", ours, "bias")] = (p + f"{theirs}.bias", unchanged)
    return m


def hf_tensors(tensors: dict) -> dict:
    """Names without ``OPTForCausalLM``'s ``model.`` prefix (``OPTModel`` files have none)."""
    return {k[len("model."):] if k.startswith("model.") else k: v for k, v in tensors.items()}


def hf_ignored(name: str, cfg: DecoderConfig) -> bool:
    """The tied head's saved copy of the embedding."""
    return cfg.tie_embeddings and name == "lm_head.weight"


def build(cfg: DecoderConfig, dtype, rngs: nnx.Rngs) -> CausalLM:
    return CausalLM(cfg, dtype=dtype, rngs=rngs)
