"""Write NQ train/dev/corpus JSONL for LSR from ``../shared/data/nq_gold_passages``.

The 624 questions are split by a fixed seed (default 80 % train); the corpus is all 624 gold
passages, and each question's ``gold_doc`` is the index of its passage. The few-shot
demonstrations of the Table 3 evaluation (the last ``--shots`` questions) go to
``demonstrations.jsonl`` and into neither split, so LSR supervision can use the evaluation's
prompt. With ``--distractors FILE`` (a JSONL of passages, e.g. the ``distractors.jsonl`` of
``experiments.prepare.wikitext``), ``corpus_distractors.jsonl`` holds the 624 gold passages
first (their ids unchanged) and then those passages, so that recall@1 has room to move. Usage:
``python -m experiments.prepare.nq [--out experiments/data/nq] [--seed 0] [--distractors F]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np

from experiments.lib.datasets import load_nq
from replug_jax.fileio import write_text_atomic


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("experiments/data/nq"),
                    help="output folder")
    ap.add_argument("--seed", type=int, default=0, help="split seed")
    ap.add_argument("--train-fraction", type=float, default=0.8, help="share of questions "
                    "used for training")
    ap.add_argument("--shots", type=int, default=4, help="few-shot demonstrations (the last "
                    "questions, as the Table 3 evaluation takes them)")
    ap.add_argument("--distractors", type=pathlib.Path, default=None,
                    help="JSONL passages appended after the gold passages in "
                         "corpus_distractors.jsonl")
    args = ap.parse_args(argv)
    passages, questions, answers = load_nq()
    demo_ids = list(range(len(questions) - args.shots, len(questions)))[::-1]
    order = [int(i) for i in np.random.default_rng(args.seed).permutation(len(questions))
             if i not in set(demo_ids)]
    n_train = int(args.train_fraction * len(order))
    args.out.mkdir(parents=True, exist_ok=True)
    gold = "".join(json.dumps({"id": str(p.id), "text": p.text}) + "\n" for p in passages)
    write_text_atomic(gold, args.out / "corpus.jsonl")
    write_text_atomic("".join(json.dumps({"question": questions[i], "answer": answers[i][0]})
                              + "\n" for i in demo_ids), args.out / "demonstrations.jsonl")
    for name, idx in (("train", order[:n_train]), ("dev", order[n_train:])):
        write_text_atomic("".join(
            json.dumps({"id": f"nq{i}", "question": questions[i], "answer": answers[i][0],
                        "aliases": answers[i], "gold_doc": i}) + "\n"
            for i in sorted(idx)), args.out / f"{name}.jsonl")
    extra = 0
    if args.distractors is not None:
        lines = [x for x in args.distractors.read_text(encoding="utf-8").splitlines() if x.strip()]
        extra = len(lines)
        write_text_atomic(gold + "".join(x + "\n" for x in lines),
                          args.out / "corpus_distractors.jsonl")
    print(f"wrote {n_train} train, {len(order) - n_train} dev questions, {len(demo_ids)} "
          f"demonstrations and {len(passages)} passages (+{extra} distractors) to {args.out}")


if __name__ == "__main__":
    from experiments.lib.common import run

    run(main)
