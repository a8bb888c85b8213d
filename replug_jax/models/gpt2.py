"""GPT-2 decoder (learned positions, pre-LN, GELU-tanh MLP, tied head).

The module is :class:`replug_jax.models.decoder.CausalLM` configured for GPT-2; this file maps
Hugging Face ``GPT2LMHeadModel`` configs and checkpoints onto it. HF's GPT-2 uses ``Conv1D``
(weights stored ``[in, out]``) and a fused ``c_attn`` that we split into q, k, v.
"""

from __future__ import annotations

from flax import nnx

from replug_jax.models.decoder import CausalLM, DecoderConfig
from replug_jax.models.weights import column_block, unchanged

__all__ = ["CausalLM", "config_from_hf", "hf_name_map", "hf_tensors", "hf_ignored", "build"]

# Causal-mask buffers that old GPT-2 checkpoints saved as tensors; they hold no weights.
IGNORED_HF_TENSORS = (".attn.bias", ".attn.masked_bias")


def config_from_hf(hf: dict, tensor_names: set[str] = frozenset()) -> DecoderConfig:
    act = hf.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        raise ValueError(f"unsupported GPT-2 activation_function {act!r}")
    d, heads = hf["n_embd"], hf["n_head"]
    return DecoderConfig(
        vocab_size=hf["vocab_size"], hidden_size=d, intermediate_size=hf.get("n_inner") or 4 * d,
        num_layers=hf["n_layer"], num_heads=heads, num_kv_heads=heads, head_dim=d // heads,
        max_position=hf["n_positions"], norm="layer",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5), mlp="gelu_tanh", position="learned",
        attn_bias=True, mlp_bias=True, tie_embeddings=True, family="gpt2",
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf.get("eos_token_id"),
        pad_token_id=hf.get("pad_token_id"))


def hf_name_map(cfg: DecoderConfig) -> dict:
    """Our parameter path -> (HF tensor name without the ``transformer.`` prefix, transform)."""
    d = cfg.hidden_size
    m = {("embed", "embedding"): ("wte.weight", unchanged),
         ("pos_embed", "embedding"): ("wpe.weight", unchanged),
         ("final_norm", "scale"): ("ln_f.weight", unchanged),
         ("final_norm", "bias"): ("ln_f.bias", unchanged)}
    for i in range(cfg.num_layers):
        p = f"h.{i}."
        L = ("layers", i)
        for norm, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
            m[L + (norm, "scale")] = (p + f"{theirs}.weight", unchanged)
            m[L + (norm, "bias")] = (p + f"{theirs}.bias", unchanged)
        for j, name in enumerate(("q", "k", "v")):
            m[L + ("attn", name, "kernel")] = (p + "attn.c_attn.weight", column_block(j, d))
            m[L + ("attn", name, "bias")] = (p + "attn.c_attn.bias", column_block(j, d))
        m[L + ("attn", "o", "kernel")] = (p + "attn.c_proj.weight", unchanged)
        m[L + ("attn", "o", "bias")] = (p + "attn.c_proj.bias", unchanged)
        m[L + ("mlp", "up", "kernel")] = (p + "mlp.c_fc.weight", unchanged)
        m[L + ("mlp", "up", "bias")] = (p + "mlp.c_fc.bias", unchanged)
        m[L + ("mlp", "down", "kernel")] = (p + "mlp.c_proj.weight", unchanged)
        m[L + ("mlp", "down", "bias")] = (p + "mlp.c_proj.bias", unchanged)
    return m


def hf_tensors(tensors: dict) -> dict:
    """Names without ``GPT2LMHeadModel``'s ``transformer.`` prefix."""
    return {k[len("transformer."):] if k.startswith("transformer.") else k: v
            for k, v in tensors.items()}


def hf_ignored(name: str, cfg: DecoderConfig) -> bool:
    """Old causal-mask buffers, and the tied head's saved copy of the embedding."""
    return name.endswith(IGNORED_HF_TENSORS) or name == "lm_head.weight"


def build(cfg: DecoderConfig, dtype, rngs: nnx.Rngs) -> CausalLM:
    return CausalLM(cfg, dtype=dtype, rngs=rngs)
