"""Shared layer helpers for the model ports."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from flax import nnx

from replug_jax.sharding import platform


@jax.custom_vjp
def dense(x_NI, w_IO, b_O=None):
    """``x_NI @ w_IO (+ b_O)``, with a backward that computes ``dx``, ``dW`` and ``db`` one
    after another, ``db`` as a matmul with a ones vector.

    Autodiff's backward leaves ``dx`` and ``dW`` independent, and XLA:CPU runs independent
    matmuls concurrently on the same cores, each slower than alone (a MiniLM LSR step's
    backward matmuls ran at 60-70 GFLOP/s against 125-150 alone); its ``db`` is a reduction
    that XLA:CPU splits into a slow reduce-window. Same values up to float32 rounding.
    """
    y_NO = x_NI @ w_IO
    return y_NO if b_O is None else y_NO + b_O


def _dense_fwd(x_NI, w_IO, b_O):
    return dense(x_NI, w_IO, b_O), (x_NI, w_IO, b_O)


def _dense_bwd(res, g_NO):
    x_NI, w_IO, b_O = res
    dx_NI = g_NO @ w_IO.T
    # Data dependencies that serialise dx -> dW -> db -> (everything downstream of dx).
    dx_NI, g_NO = jax.lax.optimization_barrier((dx_NI, g_NO))
    dw_IO = x_NI.T @ g_NO
    if b_O is None:
        dx_NI, dw_IO = jax.lax.optimization_barrier((dx_NI, dw_IO))
        return dx_NI, dw_IO, None
    dw_IO, g_NO = jax.lax.optimization_barrier((dw_IO, g_NO))
    db_O = jnp.ones((g_NO.shape[0],), g_NO.dtype) @ g_NO
    dx_NI, dw_IO, db_O = jax.lax.optimization_barrier((dx_NI, dw_IO, db_O))
    return dx_NI, dw_IO, db_O


dense.defvjp(_dense_fwd, _dense_bwd)


def fused_linear(x_BLD, *linears: nnx.Linear, min_tokens: int = 0):
    """``[lin(x_BLD) for lin in linears]`` computed as one :func:`dense` against the
    concatenated kernels (same values up to float32 rounding); with fewer than ``min_tokens``
    tokens in ``x_BLD`` (a static shape), layer by layer.

    Projections of one input (attention's Q, K, V; SwiGLU's gate and up) are independent, so
    XLA:CPU runs them as concurrent matmuls that compete for the same cores; one wider matmul
    runs at the machine's matmul rate instead (``benches/README.md``). The parameters stay
    separate, so weight maps, exports and checkpoints are unchanged. Concatenating the kernels
    copies them once per call: worth it when many tokens share them (encoding, scoring,
    training), not for one-token decoding steps, which read every weight once anyway.
    """
    if x_BLD.size // x_BLD.shape[-1] < min_tokens:
        return [lin(x_BLD) for lin in linears]
    dtype = linears[0].dtype or x_BLD.dtype
    kernel_DE = jnp.concatenate([lin.kernel[...] for lin in linears], axis=1).astype(dtype)
    bias_E = None
    if all(lin.bias is not None for lin in linears):
        bias_E = jnp.concatenate([lin.bias[...] for lin in linears]).astype(dtype)
    elif any(lin.bias is not None for lin in linears):
        raise ValueError("fused_linear needs all or none of the layers to have a bias")
    x_ND = x_BLD.reshape(-1, x_BLD.shape[-1]).astype(dtype)
    y_BLE = dense(x_ND, kernel_DE, bias_E).reshape(*x_BLD.shape[:-1], -1)
    sizes = [lin.kernel.shape[1] for lin in linears]
    return jnp.split(y_BLE, list(itertools.accumulate(sizes[:-1])), axis=-1)


def disable_fusion(module: nnx.Module) -> None:
    """Compute every projection on its own in ``module`` (set before ``nnx.split``): on a
    model sharded over a ``model`` axis, concatenating column-sharded kernels would make XLA
    gather and re-shard them at every call."""
    for _, sub in nnx.iter_graph(module):
        if isinstance(sub, nnx.Module) and hasattr(sub, "fuse_min_tokens"):
            sub.fuse_min_tokens = 1 << 62


def linear(x_BLD, layer: nnx.Linear):
    """``layer(x_BLD)`` through :func:`dense` (its serialised backward)."""
    return fused_linear(x_BLD, layer)[0]


MASKED = -1e30  # the logit of a masked key: exp(MASKED - max) underflows to exactly 0
# Largest [rows, H, M, S] float32 block of attention logits computed at once on a CPU: blocks
# that stay in cache ran attention 2x faster than one [B, H, M, S] pass through memory
# (benches/README.md); 4 MiB holds four MiniLM sequences of 128 tokens.
_CPU_BLOCK_BYTES = 4 << 20
# On an accelerator, where attention is not one fused kernel (TPU, float32 on a GPU, a KV
# cache), query rows are taken in chunks whose [B, H, chunk, S] float32 logits stay under
# this: a 4096-token context never builds all of its [B, H, 4096, 4096] logits at once.
ACCEL_BLOCK_BYTES = 256 << 20


def flash_supported(q_BLHD) -> bool:
    """Whether cuDNN's fused attention takes these queries: a GPU, 16-bit floats, a head
    width that is a multiple of 8 up to 128 (static: decided at trace time)."""
    return (platform() == "gpu" and q_BLHD.dtype in (jnp.bfloat16, jnp.float16)
            and q_BLHD.shape[-1] % 8 == 0 and q_BLHD.shape[-1] <= 128)


def flash_attention(q_BLHD, k_BLJD, v_BLJD, lengths_B, implementation: str = "cudnn"):
    """Causal attention over right-padded rows (row b holds ``lengths_B[b]`` tokens at
    positions ``0..n-1``) with grouped KV heads, through ``jax.nn.dot_product_attention``:
    ``"cudnn"`` is the fused flash kernel (GPU, 16-bit), ``"xla"`` the reference it is
    checked against. Padded query rows are ignored by callers."""
    return jax.nn.dot_product_attention(q_BLHD, k_BLJD, v_BLJD, is_causal=True,
                                        query_seq_lengths=lengths_B,
                                        key_value_seq_lengths=lengths_B,
                                        implementation=implementation)


def attention(q_BHMD, k_BHSD, v_BHSD, mask_BXMS):
    """Scaled dot-product attention, ``softmax(q·kᵀ/√D) · v`` over the keys where
    ``mask_BXMS`` (broadcastable to ``[B, H, M, S]``, with its batch dimension) is True; a row
    with no visible key attends uniformly, as a softmax over all-``MASKED`` logits does.

    Logits and softmax in float32, ``p·v`` in ``v``'s dtype. On a CPU the batch is processed a
    few sequences at a time so that each block's logits stay in cache, forward and backward
    (a custom VJP that recomputes the probabilities from the saved row maxima and sums, as
    FlashAttention does, instead of saving them); elsewhere in one pass that XLA fuses.
    """
    if platform() != "cpu":
        return _query_chunked(q_BHMD, k_BHSD, v_BHSD, mask_BXMS, ACCEL_BLOCK_BYTES)
    b, h, m, _ = q_BHMD.shape
    per_row = h * m * k_BHSD.shape[2] * 4
    fits = [n for n in range(2, b + 1) if b % n == 0 and n * per_row <= _CPU_BLOCK_BYTES]
    rows = max(fits, default=1)
    return _blocked_attention(q_BHMD, k_BHSD, v_BHSD, mask_BXMS, rows)


def _query_chunked(q_BHMD, k_BHSD, v_BHSD, mask_BXMS, max_bytes: int):
    """Attention with the query rows in the fewest chunks whose float32 logits fit
    ``max_bytes`` (one pass, which XLA fuses, when they all fit). Exact: rows are
    independent."""
    b, h, m, _ = q_BHMD.shape
    per_row = b * h * k_BHSD.shape[2] * 4
    if m * per_row <= max_bytes:
        return _attention_block(q_BHMD, k_BHSD, v_BHSD, mask_BXMS)[0]
    chunk = max([c for c in range(1, m + 1) if m % c == 0 and c * per_row <= max_bytes],
                default=1)
    mask_BXMS = jnp.broadcast_to(mask_BXMS, (mask_BXMS.shape[0], mask_BXMS.shape[1], m,
                                             mask_BXMS.shape[3]))

    def split(x):  # [B, X, M, ...] -> [M / chunk, B, X, chunk, ...]
        return jnp.moveaxis(x.reshape(x.shape[0], x.shape[1], m // chunk, chunk,
                                      *x.shape[3:]), 2, 0)

    out_NBHCD = jax.lax.map(lambda a: _attention_block(a[0], k_BHSD, v_BHSD, a[1])[0],
                            (split(q_BHMD), split(mask_BXMS)))
    return jnp.moveaxis(out_NBHCD, 0, 2).reshape(q_BHMD.shape)


def _logits(q_BHMD, k_BHSD, mask_BXMS):
    scale = jnp.asarray(q_BHMD.shape[-1] ** -0.5, jnp.float32)
    logits_BHMS = jnp.matmul(q_BHMD, k_BHSD.swapaxes(-1, -2),
                             preferred_element_type=jnp.float32) * scale
    return jnp.where(mask_BXMS, logits_BHMS, MASKED)


def _attention_block(q_BHMD, k_BHSD, v_BHSD, mask_BXMS):
    """``(out_BHMD, (max_BHM, 1/sum_BHM))``. In float32 the softmax is normalised after
    ``p·v``, on the [M, D] output instead of the [M, S] probabilities. The maximum and the sum
    are kept apart (one log-sum-exp would lose ``log(sum)`` next to a ``MASKED`` maximum)."""
    logits_BHMS = _logits(q_BHMD, k_BHSD, mask_BXMS)
    max_BHM1 = jnp.max(logits_BHMS, axis=-1, keepdims=True)
    e_BHMS = jnp.exp(logits_BHMS - max_BHM1)
    sum_BHM1 = jnp.sum(e_BHMS, axis=-1, keepdims=True)
    if v_BHSD.dtype == jnp.float32:
        out_BHMD = jnp.matmul(e_BHMS, v_BHSD) / sum_BHM1
    else:  # normalised before rounding to v's dtype: the bf16 contract was measured so
        probs_BHMS = (e_BHMS / sum_BHM1).astype(v_BHSD.dtype)
        out_BHMD = jnp.matmul(probs_BHMS, v_BHSD, preferred_element_type=jnp.float32)
    return out_BHMD.astype(v_BHSD.dtype), (max_BHM1[..., 0], 1.0 / sum_BHM1[..., 0])


def _blocks(x, rows):
    return x.reshape(x.shape[0] // rows, rows, *x.shape[1:])


def _unblock(x):
    return x.reshape(-1, *x.shape[2:])


def _map_blocks(fn, rows, *xs):
    if rows == xs[0].shape[0]:
        return fn(*xs)
    blocks = jax.tree.map(lambda x: _blocks(x, rows), xs)
    return jax.tree.map(_unblock, jax.lax.map(lambda a: fn(*a), blocks))


def _blocked_attention_fwd(q_BHMD, k_BHSD, v_BHSD, mask_BXMS, rows):
    out_BHMD, stats = _map_blocks(_attention_block, rows, q_BHMD, k_BHSD, v_BHSD, mask_BXMS)
    return out_BHMD, (q_BHMD, k_BHSD, v_BHSD, mask_BXMS, out_BHMD, stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _blocked_attention(q_BHMD, k_BHSD, v_BHSD, mask_BXMS, rows):
    return _blocked_attention_fwd(q_BHMD, k_BHSD, v_BHSD, mask_BXMS, rows)[0]


def _attention_block_bwd(q_BHMD, k_BHSD, v_BHSD, mask_BXMS, g_BHMD, stats, delta_BHM):
    """The gradients of one block, computed on transposed [S, M] probabilities so that no
    matmul has a transposed left operand, XLA:CPU's slowest form (the gradient of a MiniLM
    layer's attention: 78 -> 57 ms against the same blocks in [M, S])."""
    f32 = jnp.float32
    max_BHM, inv_sum_BHM = stats
    p_BHSM = jnp.exp(jnp.swapaxes(_logits(q_BHMD, k_BHSD, mask_BXMS), -1, -2)
                     - max_BHM[..., None, :]) * inv_sum_BHM[..., None, :]
    dv_BHSD = jnp.matmul(p_BHSM.astype(g_BHMD.dtype), g_BHMD, preferred_element_type=f32)
    dp_BHSM = jnp.matmul(v_BHSD, g_BHMD.swapaxes(-1, -2), preferred_element_type=f32)
    # Masked logits are constants: no gradient reaches q or k through them (this matters for
    # rows with no visible key, whose probabilities are uniform, not 0).
    ds_BHSM = jnp.where(jnp.swapaxes(mask_BXMS, -1, -2),
                        p_BHSM * (dp_BHSM - delta_BHM[..., None, :]) * q_BHMD.shape[-1] ** -0.5,
                        0.0)
    dk_BHSD = jnp.matmul(ds_BHSM.astype(q_BHMD.dtype), q_BHMD, preferred_element_type=f32)
    ds_BHMS = jax.lax.optimization_barrier(jnp.swapaxes(ds_BHSM, -1, -2))
    dq_BHMD = jnp.matmul(ds_BHMS.astype(k_BHSD.dtype), k_BHSD, preferred_element_type=f32)
    return (dq_BHMD.astype(q_BHMD.dtype), dk_BHSD.astype(k_BHSD.dtype),
            dv_BHSD.astype(v_BHSD.dtype))


def _blocked_attention_bwd(rows, res, g_BHMD):
    q_BHMD, k_BHSD, v_BHSD, mask_BXMS, out_BHMD, stats = res
    delta_BHM = jnp.sum(g_BHMD.astype(jnp.float32) * out_BHMD.astype(jnp.float32), axis=-1)
    dq, dk, dv = _map_blocks(_attention_block_bwd, rows, q_BHMD, k_BHSD, v_BHSD, mask_BXMS,
                             g_BHMD, stats, delta_BHM)
    return dq, dk, dv, None


_blocked_attention.defvjp(_blocked_attention_fwd, _blocked_attention_bwd)
