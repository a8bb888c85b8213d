"""Shared layer helpers for the model ports."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx


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


def linear(x_BLD, layer: nnx.Linear):
    """``layer(x_BLD)`` through :func:`dense` (its serialised backward)."""
    return fused_linear(x_BLD, layer)[0]
