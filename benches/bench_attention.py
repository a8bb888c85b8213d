"""cuDNN's fused causal attention against the attention the decoder falls back to (query rows
in chunks bounded in bytes), on the same bf16 inputs, in one run: time per call, the largest
difference, and the bytes of float32 logits the fallback holds per chunk.

On a GPU the fused kernel is ``jax.nn.dot_product_attention(implementation="cudnn")``; on
other backends the same call's XLA implementation stands in (so the script runs anywhere, but
the ratio means something only on a GPU). Shapes: a 4096-token context, 32 query heads over 8
KV heads of width 128 (Llama-3-8B's attention), batch 2.

Usage: ``python -m benches.bench_attention [--context 4096] [--batch 2]``.
"""

from __future__ import annotations

import argparse

import numpy as np

from benches.common import best_times, write


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=4096, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=2, help="sequences")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from replug_jax.models.layers import ACCEL_BLOCK_BYTES, _query_chunked, flash_attention

    b, length, h, j, d = args.batch, args.context, 32, 8, 128
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(b, length, n, d)), jnp.bfloat16) for n in (h, j, j))
    lengths = jnp.asarray([length, length * 3 // 4][:b] + [length] * max(0, b - 2), jnp.int32)
    impl = "cudnn" if jax.default_backend() == "gpu" else "xla"
    fused = jax.jit(lambda q, k, v, n: flash_attention(q, k, v, n, impl))
    r = h // j
    pos = jnp.where(jnp.arange(length)[None] < lengths[:, None], jnp.arange(length)[None], -1)
    mask = (pos[:, None, :] >= 0) & (pos[:, None, :] <= pos[:, :, None])
    mask = jnp.broadcast_to(mask[:, None, None], (b, 1, r, length, length)).reshape(
        b, 1, r * length, length)

    @jax.jit
    def chunked(q, k, v, mask):
        q_BJMD = q.reshape(b, length, j, r, d).transpose(0, 2, 3, 1, 4).reshape(b, j, -1, d)
        out = _query_chunked(q_BJMD, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask,
                             ACCEL_BLOCK_BYTES)
        return out.reshape(b, j, r, length, d).transpose(0, 3, 1, 2, 4).reshape(b, length, h, d)

    a = np.asarray(fused(q, k, v, lengths), np.float32)
    c = np.asarray(chunked(q, k, v, mask), np.float32)
    valid = np.arange(length)[None, :] < np.asarray(lengths)[:, None]
    err = float(np.abs(a - c)[valid].max())
    times = best_times({"fused": lambda: fused(q, k, v, lengths).block_until_ready(),
                        "chunked": lambda: chunked(q, k, v, mask).block_until_ready()},
                       repeats=3)
    out = {"backend": jax.default_backend(), "fused_implementation": impl, "batch": b,
           "context": length, "heads": h, "kv_heads": j, "head_dim": d, "seconds": times,
           "fused_speedup": times["chunked"] / times["fused"], "max_abs_diff": err,
           "chunk_logits_budget_bytes": ACCEL_BLOCK_BYTES}
    rows = [(f"{impl} fused, causal + lengths", f"{times['fused'] * 1e3:.2f}",
             f"{out['fused_speedup']:.2f}x"),
            ("query-chunked fallback", f"{times['chunked'] * 1e3:.2f}", "1.00x"),
            ("max |difference| (bf16)", f"{err:.4f}", "")]
    write("attention", out, rows, ("attention", "ms per call", "ratio"))


if __name__ == "__main__":
    main()
