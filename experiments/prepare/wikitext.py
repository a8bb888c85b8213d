"""Write the WikiText-2 language-modelling LSR data (paper §4, §5.2) from ``../shared/data``.

The 62 articles of WikiText-2 test (the split available offline) are split **by article** with
a fixed seed into train / dev / test (default 42 / 10 / 10; ``split.json`` lists the titles).
``{train,dev,test}.jsonl`` hold whole articles (``{"id","title","text"}``), cut into examples
of 128 context + 128 continuation tokens by the trainer. ``corpus.jsonl`` holds every article
(the same ids, so the leakage filter can drop the passages overlapping an example's own
window) plus distractors: the 624 NQ gold passages and the Python standard-library docstrings
of the demo. The trainer cuts it into 128-token passages (``chunk_unit="tokens"``).

``distractors.jsonl`` (for the NQ run with distractors): the same WikiText articles and Python
docs, already cut into 128-token passages, one per line.

Usage: ``python -m experiments.prepare.wikitext [--out experiments/data/wikitext] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from experiments.lib.common import require_data
from experiments.lib.datasets import load_nq
from replug_jax.eval.perplexity import split_wikitext
from replug_jax.fileio import write_json_atomic, write_jsonl_atomic
from replug_jax.retrieval.corpus import chunk_documents, python_docs_documents


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("experiments/data/wikitext"),
                    help="output folder")
    ap.add_argument("--seed", type=int, default=0, help="article split seed")
    ap.add_argument("--dev", type=int, default=10, help="articles in dev")
    ap.add_argument("--test", type=int, default=10, help="articles in test")
    ap.add_argument("--no-python-docs", action="store_true",
                    help="leave the Python docstrings out of the distractors")
    ap.add_argument("--passage-tokens", type=int, default=128,
                    help="passage length of distractors.jsonl (SmolLM2 tokens)")
    args = ap.parse_args(argv)
    from replug_jax.models import load_tokenizer

    raw = (require_data("wikitext2") / "wiki.test.raw").read_text(encoding="utf-8")
    articles = split_wikitext(raw)
    if args.dev + args.test >= len(articles):
        raise SystemExit(f"{len(articles)} articles cannot give {args.dev} dev and {args.test} "
                         "test articles and leave some for training")
    order = [int(i) for i in np.random.default_rng(args.seed).permutation(len(articles))]
    parts = {"test": order[:args.test], "dev": order[args.test:args.test + args.dev],
             "train": order[args.test + args.dev:]}
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [{"id": a.id, "title": a.title, "text": a.text} for a in articles]
    for name, idx in parts.items():
        write_jsonl_atomic((rows[i] for i in sorted(idx)), args.out / f"{name}.jsonl")
    nq = [{"id": f"nq:{p.id}", "title": "", "text": p.text} for p in load_nq()[0]]
    pydocs = [{"id": f"pydoc:{d.id}", "title": d.title, "text": d.text}
              for d in ([] if args.no_python_docs else python_docs_documents())]
    write_jsonl_atomic(rows + nq + pydocs, args.out / "corpus.jsonl")
    tokenizer = load_tokenizer("smollm2")
    from replug_jax.retrieval.corpus import Document

    chunked = chunk_documents([*articles, *(Document(r["id"], r["text"], r["title"])
                                            for r in pydocs)],
                              size=args.passage_tokens, unit="tokens", tokenizer=tokenizer)
    write_jsonl_atomic(({"id": f"{p.source_id}@{p.start}", "title": p.title, "text": p.text}
                        for p in chunked), args.out / "distractors.jsonl")
    write_json_atomic({"seed": args.seed, "source": "WikiText-2 test (wiki.test.raw)",
                       **{name: [articles[i].title for i in sorted(idx)]
                          for name, idx in parts.items()}}, args.out / "split.json")
    print(f"wrote {len(parts['train'])} train, {len(parts['dev'])} dev, {len(parts['test'])} "
          f"test articles; corpus of {len(rows)} articles + {len(nq)} NQ passages + "
          f"{len(pydocs)} Python docs; {len(chunked)} distractor passages; to {args.out}")


if __name__ == "__main__":
    from experiments.lib.common import run

    run(main)
