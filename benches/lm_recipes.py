"""Memory per device of the README's recipes, computed from the LMs' shapes (no weights, no
device): Llama-2-7B on one H200, Llama-2-70B on an 8-GPU host, Llama-2-7B on a TPU v5e-8.

Each row is what ``replug lm-memory`` prints for the recipe's mesh, dtype, batch and context
(``replug_jax.lm.memory``: parameters and KV cache exact, activations estimated).

Usage: ``python -m benches.lm_recipes``.
"""

from __future__ import annotations

import pathlib

from benches.common import write

SHAPES = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "configs" / "lm_shapes"
# (name, config, device, its memory in GB (10^9 bytes, as sold), mesh, batch = queries x k
# documents, context)
RECIPES = [
    ("llama-2-7b on 1 H200", "llama-2-7b.json", "H200", 141, {"model": 1}, 32, 2048),
    ("llama-2-70b on 8 GPUs (80 GB)", "llama-2-70b.json", "H100/A100 80GB", 80, {"model": 8},
     64, 2048),
    ("llama-2-7b on a TPU v5e-8", "llama-2-7b.json", "TPU v5e chip", 16, {"model": 8}, 32,
     2048),
]


def main(argv=None):
    import argparse

    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    from replug_jax.lm.memory import lm_memory, read_lm_config

    out, rows = {}, []
    for name, config, device, device_gb, mesh, batch, context in RECIPES:
        plan = lm_memory(read_lm_config(SHAPES / config), mesh, "bfloat16", batch=batch,
                         context=context)
        device_gib = round(device_gb * 1e9 / (1 << 30), 1)
        plan.update(device=device, device_gib=device_gib, config=config)
        out[name] = plan
        mesh_text = ",".join(f"{k}={v}" for k, v in mesh.items())
        rows.append((name, mesh_text, f"{plan['parameters_gib']:.2f}",
                     f"{plan['kv_cache_gib']:.2f}", f"{plan['total_gib']:.2f} of {device_gib}"))
    write("lm_recipes", out, rows, ("recipe (bfloat16)", "mesh", "parameters GiB/device",
                                    "KV cache GiB/device", "total GiB/device"))


if __name__ == "__main__":
    main()
