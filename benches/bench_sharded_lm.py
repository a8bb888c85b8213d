"""A 1B-shaped Llama (TinyLlama-1.1B's width, heads and vocabulary, 16 of its 22 layers: 0.84B
parameters, random weights, float32) sharded over 8 simulated CPU devices scores and generates
what one device does: the by-hand check of the sharding rules at a real shape.

Meshes ``data=2,model=4`` and ``model=8`` against one device, on the same weights and pairs
(a 96-token passage shared by four inputs, the KV-reuse path, and four lone pairs): the
largest |Δ log p|, whether the greedy tokens of an ensemble generation are identical, the
parameter bytes each device holds against the total / model-axis size, and the seconds of each
(8 simulated devices on 2 cores are slower than one device: the point is equality, not speed).

Usage: ``python -m benches.bench_sharded_lm [--layers N]`` (sets its own 8 CPU devices).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from benches.common import write  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16,
                    help="decoder layers (default 16 of TinyLlama-1.1B's 22: 0.84B parameters; "
                         "22 and a sharded copy beside them exceed 24 GB of host memory, where "
                         "the 8 simulated devices live)")
    args = ap.parse_args(argv)
    import jax
    from flax import nnx

    from replug_jax.lm.flax_scorer import FlaxLM
    from replug_jax.models import CausalLM, DecoderConfig, LanguageModel, load_tokenizer
    from replug_jax.sharding import addressable_bytes, make_mesh

    # TinyLlama-1.1B's layer shape: 2048 wide, 32 heads over 4 KV heads, 5632 MLP, 32000 tokens.
    cfg = DecoderConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                        num_layers=args.layers, num_heads=32, num_kv_heads=4, head_dim=64,
                        max_position=2048, tie_embeddings=False, eos_token_id=2,
                        pad_token_id=2)
    tok = load_tokenizer("smollm2")
    model = CausalLM(cfg, rngs=nnx.Rngs(0))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    rng = np.random.default_rng(0)
    doc = [1] + list(rng.integers(3, 32000, 96))
    prefixes = [doc + list(rng.integers(3, 32000, 16)) for _ in range(4)]
    prefixes += [[1] + list(rng.integers(3, 32000, 60)) for _ in range(4)]
    conts = [list(rng.integers(3, 32000, 24)) for _ in prefixes]
    prompts = [["The history of the city", "In 1905 the"], ["Water boils at", "A river"]]
    weights = np.log([[0.6, 0.4], [0.5, 0.5]])

    def run(mesh):
        lm = FlaxLM(LanguageModel(model, tok, cfg, "llama-1b-shape", "random"),
                    max_context=512, mesh=mesh)
        t0 = time.perf_counter()
        logp = lm.score_token_ids(prefixes, conts)
        gen = lm.generate_ensemble(prompts, weights, max_new_tokens=8)
        return logp, gen, time.perf_counter() - t0, addressable_bytes(lm.state)

    ref_logp, ref_gen, ref_s, total = run(None)
    out = {"config": {k: v for k, v in vars(cfg).items() if not k.startswith("_")},
           "parameters": int(n_params), "parameter_bytes": int(total),
           "one_device_seconds": ref_s, "meshes": {}}
    rows = [("one device", "-", f"{total / 2**30:.3f}", "-", "-", f"{ref_s:.1f}")]
    for shape in ({"data": 2, "model": 4}, {"model": 8}):
        logp, gen, secs, mine = run(make_mesh(shape=shape))
        err = max(float(np.abs(a - b).max()) for a, b in zip(logp, ref_logp))
        same = gen.token_ids == ref_gen.token_ids
        name = ",".join(f"{k}={v}" for k, v in shape.items())
        out["meshes"][name] = {"max_abs_logp_diff": err, "greedy_tokens_identical": same,
                               "bytes_per_device": int(mine),
                               "total_over_model_axis": int(total // shape["model"]),
                               "seconds": secs}
        rows.append((name, f"{err:.1e}", f"{mine / 2**30:.3f}",
                     f"{total / shape['model'] / 2**30:.3f}", str(same), f"{secs:.1f}"))
    write("sharded_lm", out, rows, ("mesh", "max |Δ log p|", "parameter GiB per device",
                                    "total / model axis", "greedy tokens identical",
                                    "seconds"))


if __name__ == "__main__":
    main()
