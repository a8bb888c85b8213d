"""The `replug` command: parses arguments and calls library functions."""

from __future__ import annotations

import argparse
import json
import sys


def _cmd_demo(args: argparse.Namespace) -> int:
    import numpy as np

    from replug_jax.core import mixture_logprobs, retrieval_log_weights

    scores = np.array([[0.8473, 0.0]], np.float32)  # cosine similarities of two documents
    log_w = retrieval_log_weights(scores)
    branch = np.log(np.array([[[0.1], [0.9]]], np.float32))
    mix = float(np.exp(mixture_logprobs(branch, log_w))[0, 0])
    out = {"weights": np.exp(log_w)[0].round(4).tolist(), "branch_probs": [0.1, 0.9],
           "mixture_prob": round(mix, 4)}
    print(json.dumps(out) if args.json else
          f"λ = {out['weights']}, p = {out['branch_probs']} -> REPLUG p = {out['mixture_prob']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="replug", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the REPLUG demo")
    demo.add_argument("--json", action="store_true", help="print machine-readable JSON")
    demo.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
