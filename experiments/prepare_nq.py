"""Write NQ train/dev/corpus JSONL for LSR from ``../shared/data/nq_gold_passages``.

The 624 questions are split by a fixed seed (default 80 % train); the corpus is all 624 gold
passages, and each question's ``gold_doc`` is the index of its passage. Usage:
``python -m experiments.prepare_nq [--out experiments/data/nq] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from experiments.data import load_nq


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("experiments/data/nq"),
                    help="output folder")
    ap.add_argument("--seed", type=int, default=0, help="split seed")
    ap.add_argument("--train-fraction", type=float, default=0.8, help="share of questions "
                    "used for training")
    args = ap.parse_args(argv)
    passages, questions, answers = load_nq()
    order = np.random.default_rng(args.seed).permutation(len(questions))
    n_train = int(args.train_fraction * len(order))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "corpus.jsonl", "w") as f:
        for p in passages:
            f.write(json.dumps({"id": str(p.id), "text": p.text}) + "\n")
    for name, idx in (("train", order[:n_train]), ("dev", order[n_train:])):
        with open(args.out / f"{name}.jsonl", "w") as f:
            for i in sorted(int(j) for j in idx):
                f.write(json.dumps({"id": f"nq{i}", "question": questions[i],
                                    "answer": answers[i][0], "aliases": answers[i],
                                    "gold_doc": i}) + "\n")
    print(f"wrote {n_train} train, {len(order) - n_train} dev questions and {len(passages)} "
          f"passages to {args.out}")


if __name__ == "__main__":
    from experiments.common import run

    run(main)
