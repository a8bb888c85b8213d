"""CI: the user's environment (`pip install .` only: no PyTorch, no extras) imports every module
of replug_jax, and the README's main command produced a complete answer.

Usage: python .ci/check_user_env.py DEMO_JSON
"""

import importlib
import json
import pkgutil
import sys

import replug_jax

for forbidden in ("torch", "pytest"):
    try:
        importlib.import_module(forbidden)
    except ImportError:
        pass
    else:
        sys.exit(f"the user environment has {forbidden} installed: not a fresh user's venv")
modules = [m.name for m in pkgutil.walk_packages(replug_jax.__path__, "replug_jax.")]
for name in modules:
    importlib.import_module(name)
print(f"imported all {len(modules)} modules of replug_jax without PyTorch or extras")

with open(sys.argv[1]) as f:
    demo = json.loads(f.read().strip().splitlines()[-1])
results = demo["results"]
assert results, "the demo answered no question"
for r in results:
    assert r["answer_without_retrieval"].strip(), f"no LM-alone answer: {r}"
    assert r["answer_replug"].strip(), f"no REPLUG answer: {r}"
    weights = [s["weight"] for s in r["sources"]]
    assert len(weights) == demo["settings"]["k"], r["sources"]
    assert all(s["title"] for s in r["sources"]), r["sources"]
    assert abs(sum(weights) - 1.0) < 1e-3, weights
print(f"demo: {len(results)} questions answered with and without retrieval, "
      f"{demo['settings']['k']} weighted sources each, {demo['seconds']} s")
