"""The package is layered: no module imports from a layer above its own."""

import ast
import pathlib

import replug_jax

# core ← models ← retrieval / lm ← replug ← train / eval ← cli (fileio, extras, config: anywhere)
LAYER = {"core": 0, "fileio": 0, "extras": 0, "config": 0, "prompts": 1, "models": 1, "sharding": 1,
         "retrieval": 2, "lm": 2, "replug": 3, "train": 4, "eval": 4, "cli": 5}


def test_no_import_runs_up_the_layers():
    root = pathlib.Path(replug_jax.__file__).parent
    up = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        layer = rel.parts[0].removesuffix(".py")
        if layer == "__init__":
            continue
        assert layer in LAYER, f"{rel}: a new top-level module needs a layer here"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("replug_jax."):
                dep = node.module.split(".")[1]
                if LAYER[dep] > LAYER[layer]:
                    up.append(f"{rel} imports {node.module}")
    assert not up, up
