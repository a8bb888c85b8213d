"""The ``replug`` command: parses arguments and calls library functions.

Every sub-command takes ``--help`` for its options, and every one that prints a result takes
``--json`` for machine-readable output. Values are checked as they are parsed (one line,
exit code 2), before any model loads. One module per group of sub-commands:
:mod:`~replug_jax.cli.index`, :mod:`~replug_jax.cli.infer`, :mod:`~replug_jax.cli.evaluate`,
:mod:`~replug_jax.cli.serve`, :mod:`~replug_jax.cli.train`, :mod:`~replug_jax.cli.scale`.
"""

from __future__ import annotations

import sys

from replug_jax.cli import evaluate, index, infer, scale, serve, train
from replug_jax.cli.common import Parser, setup_jax
from replug_jax.models.registry import DEFAULT_LM, DEFAULT_RETRIEVER

__all__ = ["build_parser", "main"]


def build_parser() -> Parser:
    parser = Parser(
        prog="replug", description="REPLUG in JAX: retrieval-augmented black-box LMs (Shi et al. "
        "2024). Retrievers and LMs default to the packaged offline models "
        f"({DEFAULT_RETRIEVER}, {DEFAULT_LM}); any HF folder, hub id or .gguf file works too.")
    sub = parser.add_subparsers(dest="command", required=True)
    for group in (index, infer, evaluate, scale, serve, train):
        group.add_parsers(sub)
    return parser


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"replug: {category.__name__.replace('UserWarning', 'note')}: {message}\n"


def main(argv: list[str] | None = None) -> int:
    import warnings

    from replug_jax.imports import MissingExtraError
    from replug_jax.lm.scorer import CapabilityError

    warnings.formatwarning = _one_line_warning  # warnings stay visible, without source lines
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exit_:  # --help (0) or a bad value, already printed in one line (2)
        return int(exit_.code or 0)
    try:
        if hasattr(args, "check"):
            args.check(args)
        setup_jax()
        return args.func(args)
    except (ValueError, FileNotFoundError, MissingExtraError, CapabilityError) as err:
        _error(err)
        return 2
    except RuntimeError as err:  # the API client's errors, without importing httpx here
        from replug_jax.lm.api_scorer import APIError

        if not isinstance(err, APIError):
            raise
        _error(err)
        return 2


def _error(err: Exception) -> None:
    """The one error line, on a line of its own: progress bars left open are closed first."""
    if "tqdm" in sys.modules:
        from tqdm import tqdm

        for bar in list(getattr(tqdm, "_instances", ())):
            bar.close()
    print(f"replug: error: {err}", file=sys.stderr)
