"""Where the CPU time of the LSR step goes, ours against PyTorch: each stage timed alone
(forward, forward + backward, full step with the optimizer), then the f32 matmul shapes of a
MiniLM layer and its attention, forward and backward forms, in GFLOP/s.

Usage: ``python -m benches.profile_cpu``. Writes ``results/profile_cpu.{json,md}``; the
reading is in ``benches/README.md``.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from benches.bench_lsr import synthetic_batch
from benches.common import best_time, write


def lsr_stages(b: int = 8, k: int = 4, lq: int = 32, ld: int = 128) -> dict:
    import jax
    import torch
    from transformers import BertModel

    from replug_jax.core.losses import lsr_loss
    from replug_jax.models.weights import resolve
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.train.config import LSRConfig
    from replug_jax.train.lsr import init_state, make_optimizer, make_train_step, split_params

    retriever = Retriever.load("minilm")
    cfg = LSRConfig(retriever="minilm", k=k, batch_size=b, total_steps=1000)
    graphdef, template, params = split_params(retriever.model.encoder)
    tx = make_optimizer(cfg)
    step, scores_fn = make_train_step(graphdef, template, cfg, tx, retriever.model.pooling,
                                      retriever.normalize)
    batch = synthetic_batch(b, k, lq, ld, retriever.model.config.vocab_size)
    grad = jax.jit(jax.value_and_grad(lambda p, bt: lsr_loss(
        scores_fn(p, bt), bt["lm_scores"], cfg.gamma, cfg.beta, bt["doc_valid"])))
    state = {"s": init_state(params, tx)}

    def full():
        state["s"], metrics = step(state["s"], batch)
        metrics["loss"].block_until_ready()

    ours = {"forward": best_time(lambda: scores_fn(params, batch).block_until_ready()),
            "gradient": best_time(lambda: jax.block_until_ready(grad(params, batch))),
            "step": best_time(full)}
    model = BertModel.from_pretrained(str(resolve("minilm").path)).train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    t = {key: torch.from_numpy(np.asarray(v)) for key, v in batch.items()}

    def encode(ids, mask):
        hidden = model(input_ids=ids.long(), attention_mask=mask.long()).last_hidden_state
        m = mask.unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)

    def loss():
        q = encode(t["query_ids"], t["query_mask"])
        d = encode(t["doc_ids"].reshape(b * k, ld), t["doc_mask"].reshape(b * k, ld))
        log_p = torch.log_softmax(torch.einsum("bd,bkd->bk", q, d.reshape(b, k, -1))
                                  / cfg.gamma, -1)
        log_q = torch.log_softmax(t["lm_scores"] / cfg.beta, -1)
        return (log_p.exp() * (log_p - log_q)).sum(-1).mean()

    def forward():
        with torch.no_grad():
            loss()

    def gradient():
        opt.zero_grad()
        loss().backward()

    def full_torch():
        gradient()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()

    theirs = {"forward": best_time(forward), "gradient": best_time(gradient),
              "step": best_time(full_torch)}
    return {"ours_s": ours, "torch_s": theirs}


def matmuls() -> dict:
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(0)
    x, dy, w = (rng.standard_normal(s, np.float32)
                for s in ((4352, 384), (4352, 1536), (384, 1536)))
    q, p = (rng.standard_normal(s, np.float32) for s in ((384, 128, 32), (384, 128, 128)))
    dense, attn = 2 * 4352 * 384 * 1536, 2 * 384 * 128 * 128 * 32
    cases = {  # name: (operands, f(a, b), FLOPs); the same expression in both frameworks
        "x·W, 4352×384 · 384×1536": ((x, w), lambda a, c: a @ c, dense),
        "dx = dy·Wᵀ": ((dy, w), lambda a, c: a @ c.T, dense),
        "dW = xᵀ·dy": ((x, dy), lambda a, c: a.T @ c, dense),
        "attention q·kᵀ, 384 × (128×32 · 32×128)": ((q, q), lambda a, c: a @ c.mT, attn),
        "attention p·v": ((p, q), lambda a, c: a @ c, attn),
        "attention backward pᵀ·dv": ((p, q), lambda a, c: a.mT @ c, attn),
    }
    out = {}
    for name, ((a, c), f, flops) in cases.items():
        fj = jax.jit(f)
        ja, jc = jnp.asarray(a), jnp.asarray(c)
        ta, tc = torch.from_numpy(a), torch.from_numpy(c)
        t_ours = best_time(lambda: fj(ja, jc).block_until_ready(), 5)
        t_ref = best_time(lambda: f(ta, tc), 5)
        out[name] = {"ours_gflops": flops / t_ours / 1e9, "torch_gflops": flops / t_ref / 1e9}
    return out


def main(argv=None):
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    import torch

    import replug_jax  # noqa: F401  (its XLA:CPU defaults, before JAX starts)

    torch.set_num_threads(os.cpu_count())
    result = {"lsr_step": lsr_stages(), "matmuls": matmuls(),
              "xla_flags": os.environ.get("XLA_FLAGS", "")}
    ours, theirs = result["lsr_step"]["ours_s"], result["lsr_step"]["torch_s"]
    rows = []
    for stage, a, b in (("LSR forward", ours["forward"], theirs["forward"]),
                        ("LSR backward", ours["gradient"] - ours["forward"],
                         theirs["gradient"] - theirs["forward"]),
                        ("LSR optimizer (step − gradient)", ours["step"] - ours["gradient"],
                         theirs["step"] - theirs["gradient"])):
        rows.append((stage, f"{a:.3f} s", f"{b:.3f} s", f"{b / a:.2f}x" if a > 0.05 else ""))
    for name, r in result["matmuls"].items():
        rows.append((f"{name} (GFLOP/s)", f"{r['ours_gflops']:.0f}", f"{r['torch_gflops']:.0f}",
                     f"{r['ours_gflops'] / r['torch_gflops']:.2f}x"))
    write("profile_cpu", result, rows, ("what", "ours", "PyTorch", "ours / PyTorch"))


if __name__ == "__main__":
    main()
