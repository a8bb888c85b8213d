"""Shared layer helpers for the model ports."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
from flax import nnx


def fused_linear(x_BLD, *linears: nnx.Linear, min_tokens: int = 0):
    """``[lin(x_BLD) for lin in linears]`` computed as one matmul against the concatenated
    kernels (same values up to float32 rounding); with fewer than ``min_tokens`` tokens in
    ``x_BLD`` (a static shape), layer by layer.

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
    y_BLE = jnp.matmul(x_BLD.astype(dtype), kernel_DE, precision=linears[0].precision)
    if all(lin.bias is not None for lin in linears):
        y_BLE = y_BLE + jnp.concatenate([lin.bias[...] for lin in linears]).astype(dtype)
    elif any(lin.bias is not None for lin in linears):
        raise ValueError("fused_linear needs all or none of the layers to have a bias")
    sizes = [lin.kernel.shape[1] for lin in linears]
    return jnp.split(y_BLE, list(itertools.accumulate(sizes[:-1])), axis=-1)
