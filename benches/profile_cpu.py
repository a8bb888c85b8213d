"""Where the CPU time of the LSR step goes, ours against PyTorch: each stage timed alone
(forward, forward + backward, full step with the optimizer), then the f32 matmul shapes of a
MiniLM layer and its attention, forward and backward forms, in GFLOP/s, and a chain of
MiniLM-shaped feed-forward blocks written in plain JAX and plain PyTorch (no project code): the
ratio the two frameworks' CPU kernels allow.

With ``--trace``, ours alone, op by op: one LSR gradient under ``jax.profiler``, each XLA
thunk's time summed by kind (forward or backward, the fusion's kind and the JAX op it came
from), and every matmul shape's time and GFLOP/s in the step. Matmuls that XLA:CPU hands to
Eigen (``dot.N`` thunks, e.g. the weight gradients) run asynchronously and their recorded time
is only their launch; YNNPACK matmuls (``ynn_fusion.N``) are timed whole.

Usage: ``python -m benches.profile_cpu [--trace]``. Writes ``results/profile_cpu.{json,md}``
(``profile_cpu_trace.{json,md}`` with ``--trace``); the reading is in ``benches/README.md``.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import math
import os
import pathlib
import re
import tempfile

import numpy as np

from benches.bench_lsr import lsr_setup
from benches.common import best_time, best_times, write


def lsr_stages(b: int = 8, k: int = 4, lq: int = 32, ld: int = 128) -> dict:
    import jax
    import torch
    from transformers import BertModel

    from replug_jax.models.weights import resolve
    from replug_jax.train.lsr import init_state

    s = lsr_setup(b, k, lq, ld)
    cfg, step, scores_fn, grad, params, batch = (s.cfg, s.step, s.scores_fn, s.grad, s.params,
                                                 s.batch)
    state = {"s": init_state(params, s.tx)}

    def full():
        state["s"], metrics = step(state["s"], batch)
        metrics["loss"].block_until_ready()

    ours = {"forward": lambda: scores_fn(params, batch).block_until_ready(),
            "gradient": lambda: jax.block_until_ready(grad(params, batch)),
            "step": full}
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

    theirs = {"forward": forward, "gradient": gradient, "step": full_torch}
    t = best_times({(who, stage): fns[stage] for stage in ours
                    for who, fns in (("ours", ours), ("torch", theirs))}, repeats=5)
    return {f"{who}_s": {stage: t[(who, stage)] for stage in ours} for who in ("ours", "torch")}


def trace_ops(runs: int = 2) -> dict:
    """One LSR gradient op by op (module docstring): thunk time by kind, matmuls by shape."""
    import jax

    s = lsr_setup()
    params, batch = s.params, s.batch
    grad = s.grad.lower(params, batch).compile()  # one compile: timed, traced and read
    wall = best_time(lambda: jax.block_until_ready(grad(params, batch)))
    hlo = grad.as_text()
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(runs):
                jax.block_until_ready(grad(params, batch))
        trace_file = next(pathlib.Path(tmp).rglob("*.trace.json.gz"))
        events = json.loads(gzip.decompress(trace_file.read_bytes()))["traceEvents"]
    instructions = {m.group(1): m.group(0) for m in re.finditer(
        r"^\s+%(\S+) = \S+ \w+\(.*$", hlo, re.M)}
    by_kind, by_dot = collections.Counter(), collections.defaultdict(lambda: [0.0, 0.0])
    for e in events:
        line = instructions.get(e.get("name")) if e.get("ph") == "X" else None
        if line is None:
            continue
        ms = e["dur"] / 1e3 / runs
        op = re.search(r'op_name="([^"]*)"', line)
        op = op.group(1) if op else ""
        direction = "backward" if "transpose(jvp(" in op else "forward"
        dot = _dot_of(line, hlo)
        kind = e["name"].rsplit(".", 1)[0]
        if dot:
            kind = "matmul"
        elif kind in ("dot", "dot_general"):  # operands outside the thunk: Eigen, async
            kind = "matmul, Eigen (launch time only)"
        by_kind[f"{direction} {kind} ({op.rsplit('/', 1)[-1] or '-'})"] += ms
        if dot:
            by_dot[dot[0]][0] += ms
            by_dot[dot[0]][1] += dot[1] / runs
    dots = {shape: {"ms": ms, "gflops_per_s": flops / ms / 1e6}
            for shape, (ms, flops) in sorted(by_dot.items(), key=lambda kv: -kv[1][0])}
    return {"gradient_wall_s": wall, "thunk_ms": dict(by_kind.most_common()), "matmuls": dots}


def _dot_of(line: str, hlo: str):
    """``(shape text, FLOPs)`` of the matmul a thunk runs, or None if it runs none."""
    called = re.search(r"calls=%([\w.\-]+)", line)
    body = line
    if called:
        found = re.search(r"^%" + re.escape(called.group(1)) + r" .*?\n}\n", hlo, re.M | re.S)
        body = found.group(0) if found else ""
    dot = re.search(r"= (f32\[[\d,]*\])\S* dot\(%(\S+), %(\S+)\), (.*?)(?:, metadata|$)",
                    body, re.M)
    if not dot:
        return None
    shapes = dict(re.findall(r"%(\S+) = (f32\[[\d,]*\])", body))
    shapes.update(re.findall(r"(?:\(|, )%?(\S+): (f32\[[\d,]*\])", body))
    lhs = shapes.get(dot.group(2))
    if lhs is None:
        return None
    dims = lambda s: [int(x) for x in re.findall(r"\d+", s[s.index("["):])]  # noqa: E731
    contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", dot.group(4)).group(1)
    k = math.prod(dims(lhs)[int(i)] for i in contracted.split(","))
    shape = f"{dot.group(1)} = {lhs} · {shapes.get(dot.group(3), '?')} ({dot.group(4)[:60]})"
    return shape, 2.0 * math.prod(dims(dot.group(1))) * k


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
        t = best_times({"ours": lambda: fj(ja, jc).block_until_ready(),
                        "torch": lambda: f(ta, tc)}, 5)
        t_ours, t_ref = t["ours"], t["torch"]
        out[name] = {"ours_gflops": flops / t_ours / 1e9, "torch_gflops": flops / t_ref / 1e9}
    return out


def dense_chain(layers: int = 6, n: int = 4352, d: int = 384, f: int = 1536,
                repeats: int = 5) -> dict:
    """The frameworks alone, no replug-jax model code: ``layers`` residual blocks
    ``h + gelu(h·W₁)·W₂`` (MiniLM's feed-forward shapes, ``n`` tokens), forward and backward
    of ``Σ h²`` with respect to the weights and the input, JAX jitted against PyTorch eager.
    Its ratio is what the two frameworks' CPU matmul kernels allow a BERT step on this host."""
    import jax
    import jax.numpy as jnp
    import torch

    rng = np.random.default_rng(0)
    ws = [(rng.standard_normal((d, f), np.float32) * 0.05,
           rng.standard_normal((f, d), np.float32) * 0.05) for _ in range(layers)]
    x = rng.standard_normal((n, d), np.float32)

    def loss_jax(ws, x):
        h = x
        for w1, w2 in ws:
            h = h + jax.nn.gelu(h @ w1, approximate=False) @ w2
        return jnp.sum(h * h)

    grad = jax.jit(jax.grad(loss_jax, argnums=(0, 1)))
    jws, jx = jax.tree.map(jnp.asarray, (ws, x))
    tws = [tuple(torch.from_numpy(w).requires_grad_() for w in pair) for pair in ws]
    tx = torch.from_numpy(x).requires_grad_()

    def torch_grad():
        for w in (tx, *(w for pair in tws for w in pair)):
            w.grad = None  # as zero_grad() does: no accumulation into the last step's
        h = tx
        for w1, w2 in tws:
            h = h + torch.nn.functional.gelu(h @ w1) @ w2
        (h * h).sum().backward()

    torch_grad()  # the same gradients in both, or the comparison means nothing
    ours_dx = np.asarray(grad(jws, jx)[1])
    if not np.allclose(ours_dx, tx.grad.numpy(), rtol=2e-4, atol=2e-5 * np.abs(ours_dx).max()):
        raise AssertionError("JAX and PyTorch disagree on the dense chain's input gradient")
    t = best_times({"ours": lambda: jax.block_until_ready(grad(jws, jx)),
                    "torch": torch_grad}, repeats)
    flops = 3 * layers * 2 * (2 * n * d * f)  # forward, dx and dW of both matmuls
    return {"ours_gflops": flops / t["ours"] / 1e9, "torch_gflops": flops / t["torch"] / 1e9,
            "layers": layers, "tokens": n}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="store_true",
                    help="profile one LSR gradient op by op instead (ours only, no PyTorch)")
    args = ap.parse_args(argv)
    import replug_jax  # noqa: F401  (its XLA:CPU defaults, before JAX starts)

    if args.trace:
        result = trace_ops()
        total = sum(result["thunk_ms"].values())
        rows = [(kind, f"{ms:.1f}", f"{ms / total:.0%}", "")
                for kind, ms in list(result["thunk_ms"].items())[:20]]
        rows += [(f"matmul {shape}", f"{r['ms']:.1f}", f"{r['ms'] / total:.0%}",
                  f"{r['gflops_per_s']:.0f}") for shape, r in result["matmuls"].items()]
        write("profile_cpu_trace", {**result, "xla_flags": os.environ.get("XLA_FLAGS", "")},
              rows, ("thunks (one LSR gradient)", "ms", "share", "GFLOP/s"))
        return
    import torch

    torch.set_num_threads(os.cpu_count())
    result = {"lsr_step": lsr_stages(), "matmuls": matmuls(), "dense_chain": dense_chain(),
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
    c = result["dense_chain"]
    rows.append((f"the frameworks alone: {c['layers']} blocks h + gelu(h·W₁)·W₂ of "
                 f"{c['tokens']} tokens, forward + backward (GFLOP/s)", f"{c['ours_gflops']:.0f}",
                 f"{c['torch_gflops']:.0f}", f"{c['ours_gflops'] / c['torch_gflops']:.2f}x"))
    write("profile_cpu", result, rows, ("what", "ours", "PyTorch", "ours / PyTorch"))


if __name__ == "__main__":
    main()
