"""The `replug` command end to end: --help everywhere, index build/search, score, --json."""

import json

import pytest

from replug_jax.cli import build_parser, main
from tests._models import packaged_or_skip


def _subcommands(parser, prefix=()):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield prefix + (name,), sub
                yield from _subcommands(sub, prefix + (name,))


def test_every_command_has_help_for_every_option(capsys):
    parser = build_parser()
    commands = list(_subcommands(parser))
    assert {c for c, _ in commands} >= {("index",), ("index", "build"), ("index", "search"),
                                        ("score",), ("generate",), ("ask",), ("demo",),
                                        ("serve",)}
    for cmd, sub in commands:
        for action in sub._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, f"{' '.join(cmd)} {action.option_strings} has no help"
        if not any(a.__class__.__name__ == "_SubParsersAction" for a in sub._actions):
            assert any(a.dest == "json" for a in sub._actions), f"{cmd} lacks --json"
    with pytest.raises(SystemExit) as exit_:
        main(["score", "--help"])
    assert exit_.value.code == 0 and "--baseline" in capsys.readouterr().out


@pytest.mark.models
def test_index_build_search_and_score(tmp_path, capsys):
    packaged_or_skip("minilm")
    packaged_or_skip("smollm2")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"id": str(i), "text": t}) for i, t in enumerate([
        "The Zorblat river flows through the small town of Quenwick.",
        "Berlin is the capital of Germany.", "Madrid is the capital of Spain."])) + "\n")
    index = tmp_path / "idx"
    assert main(["index", "build", "--corpus", str(corpus), "--out", str(index), "--json"]) == 0
    built = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert built["n"] == 3 and built["truncated_passages"] == 0
    assert main(["index", "search", str(index), "Where does the Zorblat flow?", "-k", "2",
                 "--json"]) == 0
    hit = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert hit["ids"][0] == 0 and len(hit["scores"]) == 2
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"context": "The Zorblat river flows through the town of",
                               "continuation": " Quenwick."}) + "\n")
    assert main(["score", "--index", str(index), "--input", str(inp), "-k", "2", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.strip().splitlines()]
    assert lines[0]["doc_ids"][0] == 0 and len(lines[0]["weights"]) == 2
    summary = lines[-1]["summary"]
    assert summary["num_tokens"] > 0 and summary["bits_per_byte"] > 0
    assert lines[-1]["settings"]["k"] == 2
    assert main(["score", "--baseline", "none", "--input", str(inp), "--json"]) == 0
    none = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["summary"]
    assert none["loglik"] < summary["loglik"]


def test_clear_errors(tmp_path, capsys):
    assert main(["index", "search", str(tmp_path / "missing"), "q"]) == 2
    assert "no such index directory" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["index", "build", "--corpus", str(empty), "--out", str(tmp_path / "x")]) == 2
    assert "empty" in capsys.readouterr().err
