"""Write the data of REPLUG LSR with the language-modelling objective on the enwiki datastore
(``lsr_study --config enwiki``, the paper's §4 setting) from ``../shared/data``.

``train.jsonl`` and ``dev.jsonl``: whole articles of the 10,000-article enwiki sample (a seeded
choice, disjoint), ``{"id","title","text"}`` with the sample's own ids, which are the ids its
index's passages carry, so ``leakage="document"`` keeps every passage of an example's own
article out of its retrieval. ``test.jsonl``: the 60 articles of WikiText-103 test (the text
``table1_lm`` evaluates), which the sample does not hold (title-disjoint).
``fresh_test.jsonl``: more enwiki articles that neither train nor dev holds (raw Wikipedia
text, a second kind of test data: ``lsr_study --config enwiki1k_fresh``). The trainer cuts
them into windows of x + y tokens. ``split.json`` lists the chosen titles.

Usage: ``python -m experiments.prepare.enwiki_lm [--out experiments/data/enwiki_lm]``.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from experiments.lib.common import require_data
from replug_jax.eval.perplexity import split_wikitext
from replug_jax.fileio import write_json_atomic, write_jsonl_atomic
from replug_jax.retrieval.corpus import iter_documents


def _rows(docs) -> list[dict]:
    return [{"id": d.id, "title": d.title, "text": d.text} for d in docs]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path,
                    default=pathlib.Path("experiments/data/enwiki_lm"), help="output folder")
    ap.add_argument("--seed", type=int, default=0, help="article choice seed")
    ap.add_argument("--train", type=int, default=200, help="enwiki articles for training")
    ap.add_argument("--dev", type=int, default=40, help="enwiki articles for dev")
    ap.add_argument("--fresh", type=int, default=120,
                    help="further enwiki articles for fresh_test.jsonl (after train and dev "
                         "in the same seeded order, so those two files do not change)")
    ap.add_argument("--min-words", type=int, default=400,
                    help="articles shorter than this are not chosen (they hold no window)")
    args = ap.parse_args(argv)
    path = require_data("enwiki2015", "enwiki_2015_sample10k.jsonl.gz")
    docs = [d for d in iter_documents(path) if len(d.text.split()) >= args.min_words]
    if args.train + args.dev + args.fresh > len(docs):
        raise SystemExit(f"{len(docs)} articles of ≥ {args.min_words} words cannot give "
                         f"{args.train} train, {args.dev} dev and {args.fresh} fresh articles")
    order = np.random.default_rng(args.seed).permutation(len(docs))
    cut = np.cumsum([args.train, args.dev, args.fresh])
    parts = {"train": sorted(order[:cut[0]]), "dev": sorted(order[cut[0]:cut[1]]),
             "fresh_test": sorted(order[cut[1]:cut[2]])}
    test = split_wikitext(require_data("wikitext103", "wiki.test.tokens")
                          .read_text(encoding="utf-8"))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, idx in parts.items():
        write_jsonl_atomic(_rows(docs[int(i)] for i in idx), args.out / f"{name}.jsonl")
    write_jsonl_atomic(_rows(test), args.out / "test.jsonl")
    write_json_atomic({"seed": args.seed, "source": str(path.name),
                       **{n: [docs[int(i)].title for i in idx] for n, idx in parts.items()},
                       "test": [d.title for d in test]}, args.out / "split.json")
    print(f"wrote {args.train} train, {args.dev} dev and {args.fresh} fresh-test enwiki "
          f"articles and {len(test)} WikiText-103 test articles to {args.out}")


if __name__ == "__main__":
    from experiments.lib.common import run

    run(main)
