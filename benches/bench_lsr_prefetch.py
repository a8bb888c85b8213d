"""An LSR step with the next step's LM scoring prefetched (``lm_prefetch``) against the
synchronous step, measured in one run on the same data: the packaged MiniLM retriever, the
packaged SmolLM2 as the frozen LM, the Python-docs demo corpus, batch 8 x k 4, a fresh
LM-score cache for each, so every pair is scored once either way.

Reports the mean seconds per step (after two warm-up steps), the ratio, and how far apart the
two runs end: the LM scores a pair in another batch when it is prefetched (other padding and
shared-prefix groups), which moves its score by float rounding only, so the losses and
parameters agree to rounding, not bit for bit.

Usage: ``python -m benches.bench_lsr_prefetch [--steps 12]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile

import numpy as np

from benches.common import write


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="LSR steps per run (default 12)")
    args = ap.parse_args(argv)
    import jax

    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.retrieval.corpus import demo_corpus
    from replug_jax.retrieval.encoder import Retriever
    from replug_jax.train.config import LSRConfig
    from replug_jax.train.data import Example
    from replug_jax.train.loop import LSRTrainer

    passages = demo_corpus()
    lm = FlaxLM.load("smollm2", max_context=512)
    rng = np.random.default_rng(0)
    picks = rng.choice(len(passages), 200, replace=False)
    train = [Example(f"q{i}", f"What does {passages[p].title} do?",
                     f"Question: What does {passages[p].title} do?\nAnswer:",
                     " " + " ".join(passages[p].text.split()[:12]))
             for i, p in enumerate(picks)]
    out, finals = {"steps": args.steps, "batch": 8, "k": 4}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, prefetch in (("synchronous", False), ("prefetched", True)):
            retriever = Retriever.load("minilm", max_length=128, query_max_length=32)
            cfg = LSRConfig.from_tree({
                "retriever": {"name": "minilm", "query_max_length": 32,
                              "doc_max_length": 128},
                "lm": {"name": "smollm2", "prefetch": prefetch}, "k": 4, "batch_size": 8,
                "total_steps": args.steps, "retrieval.refresh_every": 10_000,
                "num_devices": 1, "data.leakage": "none", "checkpoint_every": 10_000})
            trainer = LSRTrainer(cfg, pathlib.Path(tmp) / name, retriever=retriever,
                                 lm_scorer=lm, passages=passages, train=train,
                                 progress=False)
            trainer.run()
            log = [json.loads(x) for x in (trainer.workdir / "metrics.jsonl").read_text()
                   .splitlines()]
            secs = [r["step_seconds"] for r in log[2:]]
            out[name] = {"step_seconds_mean": float(np.mean(secs)),
                         "losses": [r["loss"] for r in log],
                         "lm_seconds_mean": float(np.mean([r["lm_seconds"] for r in log[2:]])),
                         "new_pairs": [r["lm_new_pairs"] for r in log]}
            finals[name] = jax.tree.leaves(jax.device_get(trainer.state.params))
    out["speedup"] = out["synchronous"]["step_seconds_mean"] / out["prefetched"][
        "step_seconds_mean"]
    out["max_abs_param_diff"] = max(float(np.abs(a - b).max()) for a, b in
                                    zip(finals["synchronous"], finals["prefetched"]))
    out["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(out["synchronous"]["losses"],
                                                             out["prefetched"]["losses"]))
    rows = [(name, f"{out[name]['step_seconds_mean']:.2f}",
             f"{out[name]['lm_seconds_mean']:.2f}",
             "1.00x" if name == "synchronous" else f"{out['speedup']:.2f}x")
            for name in ("synchronous", "prefetched")]
    rows.append(("max |Δ| of the losses / of the parameters after the run",
                 f"{out['max_abs_loss_diff']:.1e} / {out['max_abs_param_diff']:.1e}", "", ""))
    write("lsr_prefetch", out, rows, ("LSR step", "seconds per step",
                                      "seconds in the step's LM scoring", "ratio"))


if __name__ == "__main__":
    main()
