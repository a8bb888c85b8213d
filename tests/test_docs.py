"""The README and docs/ say only what is true: every `replug …` command and option they name is
in the CLI, every file path they name exists, every number of the README's results table is in
the JSON its row links, and every results folder's README says which numbers are current."""

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REPO_DIRS = ("replug_jax", "experiments", "benches", "tests", "checkpoints", "docs", ".ci")


def _parsers():
    """``{("index", "build"): parser, ...}`` of every `replug` command."""
    import argparse

    from replug_jax.cli import build_parser

    out = {}

    def walk(parser, prefix):
        out[prefix] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, prefix + (name,))

    walk(build_parser(), ())
    return out


def command_lines(text: str) -> list[str]:
    """`replug …` invocations of a page: code-block lines (continuations joined) and inline
    code spans."""
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            out += re.findall(r"(?:^|[\s;&|(`$])(replug\s+[^#|&;]*)", line)
    out += [m for m in re.findall(r"`(replug\s[^`]*)`", text)]
    return out


def check_command(line: str, parsers) -> str | None:
    """Why ``line`` (``replug …``) names a command or option the CLI lacks, else None."""
    words = line.split()[1:]
    path = ()
    for w in words:
        if w.startswith("-") or (path + (w,)) not in parsers:
            break
        path += (w,)
    if not path:
        if words and not words[0].startswith("-") and re.fullmatch(r"[a-z][a-z-]*", words[0]):
            return f"`{line}`: no command {words[0]!r}"
        return None
    parser = parsers[path]
    known = {s for a in parser._actions for s in a.option_strings}
    for opt in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line):
        if opt not in known:
            return f"`{line}`: `replug {' '.join(path)}` has no option {opt}"
    return None


def file_paths(text: str) -> list[str]:
    """Repository paths a page names (in code or links), outputs of commands excluded."""
    text = re.sub(r"--(out|workdir|partial)\s+\S+", "", text)
    dirs = "|".join(map(re.escape, REPO_DIRS))
    found = re.findall(r"(?<![\w./-])((?:%s)/[\w./-]*[\w/])(?![\w{<*-])" % dirs, text)
    return [p for p in found if not p.startswith(("experiments/data/",))]


def link_targets(text: str) -> list[str]:
    return [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", text)
            if not t.startswith(("http://", "https://", "#", "mailto:"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_commands_and_options_exist(page):
    parsers = _parsers()
    bad = [why for line in command_lines(page.read_text())
           if (why := check_command(line, parsers))]
    assert not bad, bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_files_and_links_exist(page):
    text = page.read_text()
    missing = [p for p in file_paths(text) if not (ROOT / p).exists()]
    missing += [t for t in link_targets(text) if t and not (page.parent / t).exists()]
    assert not missing, f"{page.name} names files that do not exist: {missing}"


def _numbers(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _numbers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield float(obj)


def table_mismatches(readme: str, root: pathlib.Path = ROOT) -> list[str]:
    """Numbers of the README's results table that no value of the row's linked JSON rounds
    to (at the decimals shown)."""
    section = readme.split("\n## Results\n", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("|") and ".json)" in r]
    assert rows, "the README's results table has no row linking a JSON file"
    bad = []
    for row in rows:
        values = set()
        for link in re.findall(r"\]\(([^)]+\.json)\)", row):
            values |= set(_numbers(json.loads((root / link).read_text())))
        cells = re.sub(r"\[[^\]]*\]\([^)]*\)", "", row).replace("−", "-")
        for text in re.findall(r"[-+]?\d+\.\d+", cells):
            places = len(text.split(".")[1])
            want = float(text)
            if not any(round(v, places) == round(want, places) for v in values):
                bad.append(f"{text} (row: {row[:60]}…)")
    return bad


def test_results_table_numbers_equal_their_json():
    assert not table_mismatches((ROOT / "README.md").read_text())


def test_results_folders_say_which_numbers_are_current():
    for folder in sorted((ROOT / "experiments" / "results").iterdir()):
        if not folder.is_dir():
            continue
        head = "\n".join((folder / "README.md").read_text().splitlines()[:4])
        assert "**Current numbers**" in head, folder.name
        for js in folder.glob("*.json"):
            assert f"`{js.stem}` (commit `" in head, (folder.name, js.stem)


def test_a_results_folder_says_how_each_variant_differs_from_the_paper(tmp_path):
    """One "How this differs" section when every variant states the same; each variant's own
    when they differ (a folder holding a SQuAD and an NQ variant); a plot saved after the
    results joins the README."""
    from experiments.lib.common import new_figure, save_figure, write_results

    args = dict(table=[("x", 1)], header=("what", "n"), root=tmp_path)
    write_results("study", "a", {}, differences="SQuAD here.", **args)
    write_results("study", "b", {}, differences="SQuAD here.", **args)
    readme = (tmp_path / "study" / "README.md").read_text()
    assert readme.count("SQuAD here.") == 1 and "## How this differs" in readme
    write_results("study", "nq", {}, differences="NQ here.", **args)
    readme = (tmp_path / "study" / "README.md").read_text()
    assert "## How this differs" not in readme
    section = readme[readme.index("## `nq`"):]
    assert "How this differs from the paper: NQ here." in section
    assert readme.count("SQuAD here.") == 2 and "SQuAD" not in section
    assert "![nq](nq.png)" not in readme
    fig, ax = new_figure()  # the scripts plot after write_results: the README links it then
    ax.plot([0, 1], [1, 0])
    save_figure(fig, tmp_path / "study" / "nq.png")
    assert "![nq](nq.png)" in (tmp_path / "study" / "README.md").read_text()


def test_readme_is_short_and_opens_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150
    first_code = [i for i, line in enumerate(lines) if line.strip() in ("make demo", "make test")]
    assert first_code and first_code[0] < 25


# -- the checks themselves fail on what they must catch ----------------------------------------

def test_the_checks_catch_a_renamed_option_a_missing_file_and_a_changed_number(tmp_path):
    parsers = _parsers()
    assert check_command("replug index build --corpus c.jsonl --out x/", parsers) is None
    assert "no option --corpse" in check_command("replug index build --corpse c.jsonl", parsers)
    assert "no command" in check_command("replug indx build", parsers)
    assert file_paths("see `benches/bench_nothing.py` and replug --out runs/x") == \
        ["benches/bench_nothing.py"]
    (tmp_path / "r.json").write_text(json.dumps({"a": {"b": 1.05729}, "c": [-0.0452]}))
    readme = ("# x\n\n## Results\n\n| what | n | src |\n|---|---|---|\n"
              "| t | 1.0573 (−0.0452) | [json](r.json) |\n\n## Next\n")
    assert table_mismatches(readme, tmp_path) == []
    assert table_mismatches(readme.replace("1.0573", "1.0574"), tmp_path)


def jax_cache_dir() -> str:
    """The persistent compilation cache the tests use (conftest.py sets it)."""
    import jax

    return jax.config.jax_compilation_cache_dir


def worked_example(page: pathlib.Path = ROOT / "docs" / "data.md") -> list[tuple[str, str]]:
    """``(language, code)`` of every bash and python block of the page's worked example."""
    section = page.read_text().split("\n## Worked example\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(bash|python)\n(.*?)```", section, re.S)


@pytest.mark.slow
@pytest.mark.models
def test_the_worked_example_on_your_own_data_runs_start_to_finish(tmp_path):
    """docs/data.md's commands, exactly as printed, on the corpus and questions it ships:
    τ fitted and used, every mode evaluated with intervals, LSR trained from string ids, the
    trained retriever compared with its base, exported with its verdict, and loaded in
    sentence-transformers with REPLUG's embeddings."""
    import os
    import shlex
    import shutil
    import subprocess
    import sys

    pytest.importorskip("sentence_transformers")
    shutil.copytree(ROOT / "docs" / "example", tmp_path / "docs" / "example")
    # each command in its own process, as a user runs them (one process holding every
    # command's models and compiled programs grew past 10 GB), sharing the tests' cache, on
    # the one CPU device a user has (not the 8 that conftest simulates for the mesh tests)
    env = {**os.environ, "REPLUG_JAX_CACHE_DIR": jax_cache_dir(), "XLA_FLAGS": " ".join(
        f for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count"))}
    blocks = worked_example()
    assert [lang for lang, _ in blocks] == ["bash", "bash", "python"]
    for lang, code in blocks:
        assert lang == "python" or all(line.startswith("replug ")
                                       for line in code.splitlines()), code
        commands = [[sys.executable, "-c", code]] if lang == "python" else [
            [sys.executable, "-m", "replug_jax.cli", *shlex.split(line)[1:]]
            for line in code.replace("\\\n", " ").splitlines()]
        for argv in commands:
            done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
            assert done.returncode == 0, (argv[2:], done.stderr[-2000:])
    work = tmp_path / "work"
    [tau] = json.loads((work / "idx" / "retrieval_temperature.json").read_text())[
        "fits"].values()  # one query encoder fitted on this index
    ev = json.loads((work / "eval" / "results.json").read_text())
    assert ev["systems"]["base"]["retrieval_temperature"] == tau["temperature"]
    assert "fitted on docs/example/dev.jsonl" in ev["systems"]["base"][
        "retrieval_temperature_source"]
    assert set(ev["rows"]) == {"none", "replug", "top1", "concat"} and ev["examples"] == 4
    assert {c["row"] for c in ev["comparisons"]} == {"replug", "top1", "concat"}
    assert all(c["clusters"] >= 2 for c in ev["comparisons"])
    texts = json.loads((work / "texts" / "results.json").read_text())
    assert texts["rows"]["replug"]["windows"] >= 2  # a window or more of each of 2 texts
    [bpb] = texts["comparisons"]
    assert bpb["metric"] == "bits_per_byte" and bpb["clusters"] == 2
    compare = json.loads((work / "compare" / "results.json").read_text())
    trained = compare["systems"]["trained"]
    assert trained["retrieval_temperature_source"].startswith("fitted on docs/example/dev")
    assert "gold_recall" in {c["metric"] for c in compare["comparisons"]}
    card = (work / "trained" / "README.md").read_text()
    assert re.search(r"\*\*(Better|Not better) than its base\*\*: [-+]\d", card), card[:400]
    assert "SHA-256" in card and "float16" in card
