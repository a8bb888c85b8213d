"""The package is layered (no module imports from a layer above its own), and the layout page
(docs/layout.md) names every module there is, and none that is not."""

import ast
import pathlib
import re

import pytest

import replug_jax

ROOT = pathlib.Path(replug_jax.__file__).parent

# core ← models ← retrieval / lm ← replug / serve ← train / eval / demo ← cli
# (fileio, imports, config, process, compile_targets, remote: anywhere; compile_check beside
# train)
LAYER = {"core": 0, "fileio": 0, "imports": 0, "config": 0, "process": 0, "remote": 0,
         "compile_targets": 0, "prompts": 1, "models": 1, "sharding": 1, "retrieval": 2,
         "lm": 2, "replug": 3, "results": 3, "branches": 3, "serve": 3, "train": 4, "eval": 4,
         "demo": 4, "compile_check": 4, "cli": 5}


def test_no_import_runs_up_the_layers():
    up = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
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


def test_evaluation_does_not_import_training():
    """eval/ measures any retriever, trained here or not: it takes nothing from train/ (the
    gold documents of a file resolve in retrieval/store.py, as training's do)."""
    found = [f"{path.relative_to(ROOT)} imports {node.module}"
             for path in (ROOT / "eval").rglob("*.py")
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.ImportFrom)
             and (node.module or "").startswith("replug_jax.train")]
    assert not found, found


def _layout_entries() -> dict[str, str]:
    """The layout page's block (docs/layout.md): ``{path at the start of a line: the text of
    its entry}``."""
    block = (ROOT.parent / "docs" / "layout.md").read_text().split("```", 2)[1]
    entries: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        if line and not line[0].isspace():
            current, _, text = line.partition(" ")
            entries[current] = text
        elif current is not None:
            entries[current] += " " + line.strip()
    return entries


def test_layout_page_names_every_module():
    entries = _layout_entries()
    named = set()
    for path, text in entries.items():
        assert (ROOT.parent / path).exists(), f"docs/layout.md names {path}, which does not exist"
        if path.startswith("replug_jax/") and path.endswith("/"):
            for module in re.findall(r"\b(\w+\.py)\b", text):
                assert (ROOT.parent / path / module).exists(), \
                    f"docs/layout.md names {path}{module}, which does not exist"
                named.add(path + module)
        else:
            named.add(path)
    modules = {str(p.relative_to(ROOT.parent)) for p in ROOT.rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    missing = sorted(m for m in modules if m not in named
                     and not any(m.startswith(n) for n in named if n.endswith("/")
                                 and not re.search(r"\w+\.py", entries.get(n, ""))))
    assert not missing, f"docs/layout.md does not name: {missing}"


def import_circles(root: pathlib.Path, package: str) -> list[tuple[str, str]]:
    """Pairs of modules under ``root`` (the package ``package``) that import each other,
    directly or not: every `from package.… import` counted, function-local ones too (which
    would otherwise hide a circle), packages' ``__init__`` re-exports aside."""
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        if path.name == "__init__.py":
            continue
        mod = ".".join((package, *path.relative_to(root).with_suffix("").parts))
        deps = graph.setdefault(mod, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(package):
                deps.add(node.module)  # `from pkg import module` names a module too
                deps.update(f"{node.module}.{a.name}" for a in node.names)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            mod = todo.pop()
            if mod == goal:
                return True
            if mod not in seen:
                seen.add(mod)
                todo += [d for d in graph.get(mod, ()) if d in graph]
        return False

    return sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
                   if b in graph and b != a and reaches(b, a)})


@pytest.mark.parametrize("package", ["replug_jax", "experiments"])
def test_no_import_circle_between_modules_even_inside_functions(package):
    circles = import_circles(ROOT.parent / package, package)
    assert not circles, f"modules that import each other, directly or not: {circles}"


def test_the_circle_finder_sees_a_circle_hidden_inside_a_function(tmp_path):
    (tmp_path / "a.py").write_text("from pkg.b import f\n")
    (tmp_path / "b.py").write_text("def f():\n    from pkg.c import g\n")
    (tmp_path / "c.py").write_text("import os\n")
    assert import_circles(tmp_path, "pkg") == []
    (tmp_path / "c.py").write_text("def g():\n    from pkg import a\n")
    assert import_circles(tmp_path, "pkg") == [("pkg.a", "pkg.b"), ("pkg.a", "pkg.c"),
                                               ("pkg.b", "pkg.c")]


def test_no_experiment_function_is_longer_than_80_lines():
    """A study is a task and a config (``experiments.lib.pool_study``): no script's function
    grows into the whole study again."""
    long = [f"{p.relative_to(ROOT.parent)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1})"
            for p in (ROOT.parent / "experiments").rglob("*.py")
            for n in ast.walk(ast.parse(p.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 80]
    assert not long, long


def test_the_experiments_page_names_every_experiment_module():
    """docs/experiments.md names every script, helper and data script of experiments/ (the
    configs are one per script) by its file name or module path."""
    page = (ROOT.parent / "docs" / "experiments.md").read_text()
    modules = [p for p in (ROOT.parent / "experiments").rglob("*.py")
               if p.name != "__init__.py" and "configs" not in p.parts
               and "results" not in p.parts]
    missing = sorted(str(p.relative_to(ROOT.parent)) for p in modules
                     if not re.search(rf"\b{p.stem}\b", page))
    assert not missing, f"docs/experiments.md does not name: {missing}"


def test_the_tests_mirror_the_packages():
    """Issue 65: a test of ``replug_jax/<package>/`` lives in ``tests/<package>/`` (the
    package root's modules and the whole-project checks in ``tests/``); no test file imports
    another test file (shared builders are in ``tests/helpers.py`` and conftest.py)."""
    tests = ROOT.parent / "tests"
    folders = {p.name for p in tests.iterdir() if p.is_dir() and p.name not in
               ("fixtures", "__pycache__")}
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert folders <= packages | {"experiments"}, folders - packages
    cross = [f"{p.relative_to(tests)} imports {node.module}"
             for p in tests.rglob("test_*.py")
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tests.")
             and node.module.split(".")[-1].startswith("test_")
             and node.module != ".".join(p.relative_to(tests.parent).with_suffix("").parts)]
    assert not cross, cross


def test_every_library_module_is_imported_by_a_test():
    """Issue 65: each library module is imported by name by a test of its own behaviour."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts)
               for p in ROOT.rglob("*.py") if p.name != "__init__.py"}
    imported = set()
    for path in (ROOT.parent / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            imported |= {n.removeprefix("replug_jax.") for n in names
                         if n.startswith("replug_jax.")}
    assert not modules - imported, f"no test imports: {sorted(modules - imported)}"
