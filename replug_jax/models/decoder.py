"""A causal decoder parametrised to cover the Llama family, GPT-2 and OPT, with a KV cache.

One module tree, configured by :class:`DecoderConfig`: RMSNorm or LayerNorm before (or, OPT-350m,
after) each sub-block, RoPE or learned positions (OPT's with an offset), SwiGLU, GELU or ReLU
MLP, grouped-query attention (``num_kv_heads <= num_heads``), tied or separate output head, an
optional projection between a narrower embedding and the model width. Family-specific config
parsing and weight-name maps live in ``llama.py``, ``gpt2.py`` and ``opt.py``.

The blocks are one :class:`Block` whose parameters are stacked along a leading ``layers`` axis,
and the forward pass is a ``lax.scan`` over it: XLA compiles one layer whatever the depth
(SmolLM2's 30 layers: 3.7–4.1 s → 1.3–1.5 s per scoring program on 2 CPU cores; Llama-2-7B's
scoring compiled for ``v5e:2x4``: 102 → 22 s). Name maps still list tensors per layer
(``layers/3/attn/q/kernel``); the loader stacks them.

Every parameter declares its logical axes (:func:`replug_jax.sharding.axes`), which
``sharding.LOGICAL_RULES`` maps onto a device mesh: the model is sharded by those rules, not by
code here. Parameters and activations are in the model's dtype; the output head's logits are
accumulated in float32 and everything after them (log-softmax, mixtures, losses) is float32.

Calling convention (both families)::

    logits_BLV, cache = model(tokens_BL, positions_BL, cache=None)

``positions_BL`` are absolute positions; **-1 marks padding**: a padded token is never
attended to, so left or right padding never changes a real token's result. Padded query rows
produce finite values that callers ignore. With a cache (:func:`init_cache`), the new tokens
are written at slots ``[end, end + L)`` and attend to everything cached before them.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import spmd

from replug_jax.models.layers import attention, flash_attention, flash_supported, fused_linear
from replug_jax.sharding import axes, platform

# Projections of one input are fused into one matmul from this many tokens per call on
# (prefill, scoring); decoding steps keep one matmul per weight (see fused_linear).
_FUSE_MIN_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    norm: Literal["rms", "layer"] = "rms"
    norm_eps: float = 1e-5
    norm_position: Literal["pre", "post"] = "pre"  # post: OPT-350m (norm after the residual)
    final_norm: bool = True  # a norm after the last block (OPT-350m has none)
    mlp: Literal["swiglu", "gelu_tanh", "relu"] = "swiglu"
    position: Literal["rope", "learned"] = "rope"
    position_offset: int = 0  # learned positions: row of position p is p + offset (OPT: 2)
    embed_dim: int | None = None  # OPT's word_embed_proj_dim when it differs from the width
    rope_theta: float = 10000.0
    # Llama 3 RoPE frequency scaling: (factor, low_freq_factor, high_freq_factor,
    # original_max_position), or None for plain RoPE.
    rope_llama3: tuple[float, float, float, int] | None = None
    attn_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = True
    family: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    def flops_per_token(self, context: int) -> float:
        """Forward FLOPs per token: 2·(matmul params) + attention over ``context`` keys."""
        d, f, h = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = d * f * (3 if self.mlp == "swiglu" else 2)
        per_layer = 2 * (attn + mlp) + 4 * self.num_heads * h * context
        return self.num_layers * per_layer + 2 * (self.embed_dim or d) * self.vocab_size


def _norm(cfg: DecoderConfig, dtype, rngs):
    kw = dict(epsilon=cfg.norm_eps, dtype=dtype, param_dtype=dtype, rngs=rngs,
              scale_metadata=axes("norm"))
    if cfg.norm == "rms":
        return nnx.RMSNorm(cfg.hidden_size, **kw)
    return nnx.LayerNorm(cfg.hidden_size, bias_metadata=axes("norm"), **kw)


def _linear(n_in: int, n_out: int, logical: tuple[str, str], bias: bool, dtype, rngs):
    """A dense layer whose kernel has ``logical`` (input, output) axes; its bias takes the
    output's."""
    return nnx.Linear(n_in, n_out, use_bias=bias, dtype=dtype, param_dtype=dtype, rngs=rngs,
                      kernel_metadata=axes(*logical), bias_metadata=axes(logical[1]))


def rope_inv_freq(head_dim: int, theta: float, llama3=None):
    """RoPE inverse frequencies ``[head_dim / 2]``; with ``llama3`` = (factor, low_freq_factor,
    high_freq_factor, original_max_position), Llama 3.1/3.2's scaling: wavelengths longer than
    ``original / low_freq_factor`` are divided by ``factor``, those shorter than
    ``original / high_freq_factor`` are kept, and the band between is interpolated smoothly."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if llama3 is None:
        return inv_freq
    factor, low, high, original = llama3
    wavelen = 2 * jnp.pi / inv_freq
    scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def rope(x_BLHD, positions_BL, theta: float, llama3=None):
    """Rotary embedding in the Hugging Face (rotate-half) convention."""
    inv_freq = rope_inv_freq(x_BLHD.shape[-1], theta, llama3)
    angles_BLF = jnp.maximum(positions_BL, 0).astype(jnp.float32)[..., None] * inv_freq
    cos = jnp.cos(angles_BLF)[:, :, None, :]
    sin = jnp.sin(angles_BLF)[:, :, None, :]
    x1, x2 = jnp.split(x_BLHD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BLHD.dtype)


def attention_mask(q_pos_BL, k_pos_BS):
    """``[B, L, S]``: key s is visible to query l iff it is real and not in the future."""
    return (k_pos_BS[:, None, :] >= 0) & (k_pos_BS[:, None, :] <= q_pos_BL[:, :, None])


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, dtype, rngs: nnx.Rngs):
        self.cfg = cfg
        self.fuse_min_tokens = _FUSE_MIN_TOKENS
        d, h, bias = cfg.hidden_size, cfg.head_dim, cfg.attn_bias
        # Megatron: q/k/v column-parallel (heads on the model axis), o row-parallel.
        self.q = _linear(d, cfg.num_heads * h, ("embed", "heads"), bias, dtype, rngs)
        self.k = _linear(d, cfg.num_kv_heads * h, ("embed", "kv_heads"), bias, dtype, rngs)
        self.v = _linear(d, cfg.num_kv_heads * h, ("embed", "kv_heads"), bias, dtype, rngs)
        self.o = _linear(cfg.num_heads * h, d, ("heads", "embed"), bias, dtype, rngs)
        self.fused_ok = True  # cleared by configure_attention where shardings disagree

    def __call__(self, x_BLD, q_pos_BL, kv_cache, lengths_B=None):
        """``lengths_B``: set when there is no cache and each row holds one sequence at
        positions ``0..length-1`` followed by padding; a GPU then runs cuDNN's fused causal
        attention (no ``[B, H, L, L]`` logits in memory) where the shapes allow."""
        cfg = self.cfg
        b, length, _ = x_BLD.shape
        q_BLE, k_BLE, v_BLE = fused_linear(x_BLD, self.q, self.k, self.v,
                                           min_tokens=self.fuse_min_tokens)
        q_BLHD = q_BLE.reshape(b, length, cfg.num_heads, cfg.head_dim)
        k_BLJD = k_BLE.reshape(b, length, cfg.num_kv_heads, cfg.head_dim)
        v_BLJD = v_BLE.reshape(b, length, cfg.num_kv_heads, cfg.head_dim)
        if cfg.position == "rope":
            q_BLHD = rope(q_BLHD, q_pos_BL, cfg.rope_theta, cfg.rope_llama3)
            k_BLJD = rope(k_BLJD, q_pos_BL, cfg.rope_theta, cfg.rope_llama3)
        if (kv_cache is None and lengths_B is not None and self.fused_ok
                and flash_supported(q_BLHD)):
            try:  # cuDNN checks its own limits (lengths, layouts) as the call is traced
                out_BLHD = flash_attention(q_BLHD, k_BLJD, v_BLJD, lengths_B, "cudnn")
                return self.o(out_BLHD.reshape(b, length, -1)), None
            except (NotImplementedError, ValueError, RuntimeError):
                pass  # shapes it does not take: the chunked attention below
        # Head-major layout: every attention matmul is batched over (B, J) with no relayout
        # inside it; the R query heads sharing a KV head are stacked along the rows.
        k_BJLD = k_BLJD.transpose(0, 2, 1, 3)
        v_BJLD = v_BLJD.transpose(0, 2, 1, 3)
        if kv_cache is None:
            k_BJSD, v_BJSD, k_pos_BS = k_BJLD, v_BJLD, q_pos_BL
            new_kv = None
        else:
            # The cache of every layer is one [layers, B, J, S, D] buffer, carried through the
            # scan over layers; the new keys and values are written into it in place (no
            # per-step copy of the whole cache).
            k_all, v_all, k_pos_BS, end, layer = kv_cache
            at = (layer, 0, 0, end, 0)
            k_all = jax.lax.dynamic_update_slice(k_all, k_BJLD[None].astype(k_all.dtype), at)
            v_all = jax.lax.dynamic_update_slice(v_all, v_BJLD[None].astype(v_all.dtype), at)
            k_BJSD, v_BJSD = k_all[layer], v_all[layer]
            new_kv = (k_all, v_all)
        j, r, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
        q_BJMD = (q_BLHD.reshape(b, length, j, r, hd).transpose(0, 2, 3, 1, 4)
                  .reshape(b, j, r * length, hd))  # M = R·L rows per KV head (GQA)
        mask_BLS = attention_mask(q_pos_BL, k_pos_BS)
        mask_B1MS = jnp.broadcast_to(mask_BLS[:, None, None], (b, 1, r, length, k_pos_BS.shape[1]))
        out_BJMD = attention(q_BJMD, k_BJSD, v_BJSD, mask_B1MS.reshape(b, 1, r * length, -1))
        out_BLJRD = out_BJMD.reshape(b, j, r, length, hd).transpose(0, 3, 1, 2, 4)
        return self.o(out_BLJRD.reshape(b, length, cfg.num_heads * cfg.head_dim)), new_kv


def fused_attention_agrees(num_kv_heads: int, model_axis: int) -> bool:
    """Whether q, k and v are sharded alike over a mesh's model axis, which cuDNN's fused
    attention needs (its partitioner refuses, at compile time, q split over heads while k
    and v are replicated because the axis does not divide the kv heads)."""
    return model_axis <= 1 or num_kv_heads % model_axis == 0


def configure_attention(model: nnx.Module, model_axis: int) -> bool:
    """Allow fused attention in every attention layer of ``model`` only where the shardings
    agree on a model axis of ``model_axis`` devices (call before splitting the module);
    returns whether it stays allowed, and says once when it does not."""
    import warnings

    ok = fused_attention_agrees(model.cfg.num_kv_heads, model_axis)
    for _, module in nnx.iter_modules(model):
        if isinstance(module, Attention):
            module.fused_ok = ok
    if not ok and platform() == "gpu":
        warnings.warn(f"model axis {model_axis} does not divide the {model.cfg.num_kv_heads} "
                      "kv heads (replicated): attention runs XLA's kernels, not cuDNN's fused "
                      "one", stacklevel=2)
    return ok


class MLP(nnx.Module):
    def __init__(self, cfg: DecoderConfig, dtype, rngs: nnx.Rngs):
        self.kind = cfg.mlp
        self.fuse_min_tokens = _FUSE_MIN_TOKENS
        d, f, bias = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        if cfg.mlp == "swiglu":
            self.gate = _linear(d, f, ("embed", "mlp"), bias, dtype, rngs)
        self.up = _linear(d, f, ("embed", "mlp"), bias, dtype, rngs)
        self.down = _linear(f, d, ("mlp", "embed"), bias, dtype, rngs)

    def __call__(self, x_BLD):
        if self.kind == "swiglu":
            gate_BLF, up_BLF = fused_linear(x_BLD, self.gate, self.up,
                                            min_tokens=self.fuse_min_tokens)
            return self.down(jax.nn.silu(gate_BLF) * up_BLF)
        if self.kind == "relu":
            return self.down(jax.nn.relu(self.up(x_BLD)))
        return self.down(jax.nn.gelu(self.up(x_BLD), approximate=True))


class Block(nnx.Module):
    """Residual block, pre-norm (Llama, GPT-2, OPT) or post-norm (OPT-350m: each norm
    after its residual sum)."""

    def __init__(self, cfg: DecoderConfig, dtype, rngs: nnx.Rngs):
        self.post = cfg.norm_position == "post"
        self.attn_norm = _norm(cfg, dtype, rngs)
        self.attn = Attention(cfg, dtype, rngs)
        self.mlp_norm = _norm(cfg, dtype, rngs)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x_BLD, pos_BL, kv_cache, lengths_B=None):
        if self.post:
            attn_out, new_kv = self.attn(x_BLD, pos_BL, kv_cache, lengths_B)
            x_BLD = self.attn_norm(x_BLD + attn_out)
            return self.mlp_norm(x_BLD + self.mlp(x_BLD)), new_kv
        attn_out, new_kv = self.attn(self.attn_norm(x_BLD), pos_BL, kv_cache, lengths_B)
        x_BLD = x_BLD + attn_out
        return x_BLD + self.mlp(self.mlp_norm(x_BLD)), new_kv


def _stacked_blocks(cfg: DecoderConfig, dtype, rngs: nnx.Rngs) -> Block:
    """The ``num_layers`` residual blocks as one :class:`Block` whose parameters carry a
    leading ``layers`` axis (logical axis "layers" in the rules table). The forward pass scans
    over it, so XLA compiles one layer, not ``num_layers`` copies: compile time no longer grows
    with depth (MaxText's ``scan_layers``). The blocks are initialised one after another, as
    separate modules would be, so a seed gives the same random weights as before stacking."""
    blocks = [Block(cfg, dtype, rngs) for _ in range(cfg.num_layers)]
    graphdef = nnx.graphdef(blocks[0])
    states = [nnx.state(block) for block in blocks]
    stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *states)
    return nnx.merge(graphdef, spmd.add_axis(stacked, 0, {nnx.PARTITION_NAME: "layers"}))


class CausalLM(nnx.Module):
    """Decoder-only LM: ``(tokens_BL, positions_BL, cache) -> (logits_BLV float32, cache)``."""

    # the layers as straight-line code instead of a loop (for XLA's cost analysis, which
    # counts a loop's body once: replug_jax.compile_check.layer_costs)
    unroll_layers: bool = False

    def __init__(self, cfg: DecoderConfig, *, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = dtype
        d, e = cfg.hidden_size, cfg.embed_dim or cfg.hidden_size
        self.embed = nnx.Embed(cfg.vocab_size, e, dtype=dtype, param_dtype=dtype, rngs=rngs,
                               embedding_metadata=axes("vocab", "embed"))
        if cfg.embed_dim:
            self.project_in = _linear(e, d, ("embed", "embed"), False, dtype, rngs)
            self.project_out = _linear(d, e, ("embed", "embed"), False, dtype, rngs)
        if cfg.position == "learned":
            self.pos_embed = nnx.Embed(cfg.max_position + cfg.position_offset, d, dtype=dtype,
                                       param_dtype=dtype, rngs=rngs,
                                       embedding_metadata=axes("positions", "embed"))
        self.layers = _stacked_blocks(cfg, dtype, rngs)
        if cfg.final_norm:
            self.final_norm = _norm(cfg, dtype, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _linear(e, cfg.vocab_size, ("embed", "vocab"), False, dtype, rngs)

    def __call__(self, tokens_BL, positions_BL, cache=None, *, right_padded: bool = False):
        x_BLD, cache = self.hidden(tokens_BL, positions_BL, cache, right_padded=right_padded)
        return self.project(x_BLD), cache

    def hidden(self, tokens_BL, positions_BL, cache=None, *, right_padded: bool = False):
        """``(final hidden states [B, L, D], cache)``: the forward pass before the output
        projection (see :func:`target_logprobs`). ``right_padded``: without a cache, the
        caller promises each row is one sequence at positions ``0..n-1`` then padding (what
        lets a GPU use fused causal attention)."""
        x_BLD = self.embed(tokens_BL)
        if self.cfg.embed_dim:
            x_BLD = self.project_in(x_BLD)
        if self.cfg.position == "learned":
            x_BLD = x_BLD + self.pos_embed(jnp.maximum(positions_BL, 0)
                                           + self.cfg.position_offset)
        lengths_B = (jnp.sum(positions_BL >= 0, axis=1, dtype=jnp.int32)
                     if right_padded and cache is None else None)
        if cache is not None:
            new_tokens = tokens_BL.shape[1]
            k_pos_BS = jax.lax.dynamic_update_slice_in_dim(
                cache["pos"], positions_BL.astype(cache["pos"].dtype), cache["end"], axis=1)
        k_all = v_all = None
        if cache is not None:
            k_all, v_all = cache["k"], cache["v"]
        graphdef, blocks_state = nnx.split(self.layers)

        def layer_step(carry, layer_in):
            x_BLD, k_all, v_all = carry
            block_state, i = layer_in
            kv = None if cache is None else (k_all, v_all, k_pos_BS, cache["end"], i)
            x_BLD, new_kv = nnx.merge(graphdef, block_state)(x_BLD, positions_BL, kv, lengths_B)
            return (x_BLD, *(new_kv or (k_all, v_all))), None

        layer_ids = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        (x_BLD, k_all, v_all), _ = jax.lax.scan(
            layer_step, (x_BLD, k_all, v_all), (blocks_state, layer_ids),
            unroll=self.cfg.num_layers if self.unroll_layers else 1)
        if cache is not None:
            cache = {"k": k_all, "v": v_all, "pos": k_pos_BS,
                     "end": cache["end"] + new_tokens}
        return (self.final_norm(x_BLD) if self.cfg.final_norm else x_BLD), cache

    def project(self, x_BLD):
        """Hidden states → float32 logits ``[..., V]``: the head's matmul accumulates in
        float32 whatever the parameters' dtype (as MaxText's ``logits_dot_in_fp32``)."""
        if self.cfg.embed_dim:
            x_BLD = self.project_out(x_BLD)
        if self.cfg.tie_embeddings:
            w_VE = self.embed.embedding[...]
            return jnp.einsum("...e,ve->...v", x_BLD.astype(w_VE.dtype), w_VE,
                              preferred_element_type=jnp.float32)
        w_EV = self.lm_head.kernel[...]
        return jnp.matmul(x_BLD.astype(w_EV.dtype), w_EV, preferred_element_type=jnp.float32)


def target_logprobs(model: CausalLM, x_BLD, targets_BL, rows: int = 1):
    """``log p(targets)`` ``[B, L]`` from hidden states, projecting ``rows`` sequences at a
    time: the ``[rows, L, V]`` logits of one slice stay in cache instead of a ``[B, L, V]``
    array (250 MB for 10 × 128 tokens of a 49k vocabulary) going through memory twice.
    Same values as ``token_logprobs(model.project(x_BLD), targets_BL)``."""

    def one(args):
        x_RLD, t_RL = args
        logits_RLV = model.project(x_RLD)
        picked_RL = jnp.take_along_axis(logits_RLV, t_RL[..., None], axis=-1)[..., 0]
        return picked_RL - jax.nn.logsumexp(logits_RLV, axis=-1)

    b = x_BLD.shape[0]
    if b % rows:
        rows = 1
    split = lambda a: a.reshape(b // rows, rows, *a.shape[1:])  # noqa: E731
    return jax.lax.map(one, (split(x_BLD), split(targets_BL))).reshape(targets_BL.shape)


def init_cache(cfg: DecoderConfig, batch: int, max_len: int, dtype=jnp.float32):
    """An empty KV cache for ``batch`` sequences of up to ``max_len`` tokens in total."""
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
            "pos": jnp.full((batch, max_len), -1, jnp.int32), "end": jnp.zeros((), jnp.int32)}


def token_logprobs(logits_BLV, targets_BL):
    """``log p(targets)`` per position from float32 logits: ``[B, L]``."""
    logp = jax.nn.log_softmax(logits_BLV.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets_BL[..., None], axis=-1)[..., 0]


def functional(model: nnx.Module):
    """``(apply, state)``: a jitted pure ``apply(state, *args)`` over ``nnx.split(model)``.

    Jitting a closure over a module would bake the weights in as constants; splitting keeps
    them as arguments (and is faster per call than ``nnx.jit``).
    """
    graphdef, state = nnx.split(model)

    @jax.jit
    def apply(state, *args, **kwargs):
        return nnx.merge(graphdef, state)(*args, **kwargs)

    return apply, state
