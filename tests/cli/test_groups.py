"""The command groups of `replug` (replug_jax/cli/<group>.py): each registers its own commands
with handlers of its own module, together they are the whole command, `python -m
replug_jax.cli` runs it, and each group's checks refuse bad values before any model loads."""

import argparse
import runpy
import sys

import pytest

from replug_jax.cli import __main__ as entry
from replug_jax.cli import build_parser, evaluate, index, infer, main, scale, serve, train
from replug_jax.cli.common import Parser

GROUPS = {
    index: {"index build", "index search", "index info", "index tune", "index merge",
            "index verify"},
    infer: {"score", "generate", "ask", "demo", "lm-memory"},
    evaluate: {"eval", "fit-tau"},
    scale: {"compile-check"},
    serve: {"serve", "api check"},
    train: {"train-lsr", "export-retriever"},
}


def _handlers(parser, prefix=()) -> dict:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if sub.get_default("func") is not None:
                    out[" ".join(prefix + (name,))] = sub.get_default("func")
                out.update(_handlers(sub, prefix + (name,)))
    return out


def _group_parser(group):
    parser = Parser(prog="replug")
    group.add_parsers(parser.add_subparsers(dest="command", required=True))
    return parser


@pytest.mark.parametrize("group", list(GROUPS), ids=lambda g: g.__name__.split(".")[-1])
def test_each_group_registers_its_commands_with_its_own_handlers(group):
    handlers = _handlers(_group_parser(group))
    assert set(handlers) == GROUPS[group]
    assert {f.__module__ for f in handlers.values()} == {group.__name__}


def test_the_groups_together_are_the_whole_command():
    assert set(_handlers(build_parser())) == set().union(*GROUPS.values())


@pytest.mark.filterwarnings("ignore:'replug_jax.cli.__main__' found in sys.modules")
def test_python_dash_m_runs_the_command(monkeypatch, capsys):
    assert entry.main is main
    monkeypatch.setattr(sys, "argv", ["replug", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("replug_jax.cli", run_name="__main__")
    assert exit_.value.code == 0
    assert "train-lsr" in capsys.readouterr().out


def test_evaluate_modes_are_checked_as_parsed():
    assert evaluate.modes_list("replug, none") == ("replug", "none")
    for bad in ("", "replug,replug", "replug,bogus"):
        with pytest.raises(argparse.ArgumentTypeError):
            evaluate.modes_list(bad)


def test_train_config_must_be_a_file(tmp_path):
    cfg = tmp_path / "c.py"
    cfg.write_text("CONFIGS = {}\n")
    assert train.config_file(f"{cfg}:tiny") == f"{cfg}:tiny"
    with pytest.raises(argparse.ArgumentTypeError, match="no such file"):
        train.config_file(str(tmp_path / "missing.py"))


def test_index_checks_and_search_options(tmp_path):
    args = _group_parser(index).parse_args(
        ["index", "build", "--corpus", "demo", "--out", str(tmp_path), "--chunk-size", "50",
         "--overlap", "50"])
    with pytest.raises(ValueError, match="--overlap"):
        index.check_build(args)
    args = _group_parser(index).parse_args(["index", "search", str(tmp_path), "q",
                                            "--rerank", "0"])
    assert index.search_options(args) == {"rerank": 0}  # 0 is a value given, not a default


def test_scale_refuses_what_no_chip_could_hold():
    def parse(*argv):
        return _group_parser(scale).parse_args(["compile-check", "--lm-config", "c.json", *argv])

    with pytest.raises(ValueError, match="headroom"):
        scale._check_args(parse("--headroom", "1"))
    with pytest.raises(ValueError, match="not both"):
        scale._check_args(parse("--topology", "v5e:2x2", "--target", "h100"))


def test_serve_refuses_an_open_port_without_a_key():
    pytest.importorskip("fastapi")
    args = _group_parser(serve).parse_args(["serve", "--host", "0.0.0.0"])
    with pytest.raises(ValueError, match="key"):
        serve.serve_settings(args)
    assert main(["serve", "--host", "0.0.0.0"]) == 2  # refused before a model loads
