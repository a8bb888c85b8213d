"""The package's metadata (pyproject.toml): what the extras install."""

import pathlib


def test_no_extra_installs_a_second_faiss_package():
    """faiss-cpu (a base dependency) and faiss-gpu* both own the module `faiss`: an extra that
    adds another would leave two packages writing one module."""
    import re
    import tomllib

    root = pathlib.Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    name = lambda req: re.split(r"[<>=!\[ ;]", req, maxsplit=1)[0].lower()  # noqa: E731
    assert [name(r) for r in project["dependencies"] if "faiss" in r] == ["faiss-cpu"]
    for extra, reqs in project["optional-dependencies"].items():
        assert not [r for r in reqs if "faiss" in name(r)], extra

