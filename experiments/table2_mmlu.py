"""Table 2 at laptop scale: 5-shot MMLU accuracy of the LM alone and with REPLUG (and REPLUG
LSR given a trained retriever), per category (humanities, social sciences, STEM, other).

The answer is the letter with the highest (ensemble) next-token probability after
``"Answer:"`` (``replug_jax.eval.mmlu``). No Wikipedia dump is available offline, so the
retrieval corpus is the Wikipedia text that is: the 624 NQ gold passages and/or WikiText-2 test
articles cut into 128-token passages (``corpus``). Usage:
``python -m experiments.table2_mmlu [--config tiny] [--set subjects='["astronomy"]']``.
"""

from __future__ import annotations

import dataclasses

from experiments.lib.common import (
    load_lm,
    load_retriever,
    new_figure,
    parse_experiment_args,
    provenance,
    require_data,
    run,
    save_figure,
    write_results,
)
from experiments.configs.table2_mmlu import CONFIGS
from experiments.lib.datasets import wikipedia_passages
from replug_jax.eval.mmlu import CATEGORIES, MMLUEvaluator, load_mmlu
from replug_jax.replug import Replug
from replug_jax.retrieval import index_in_memory
from replug_jax.process import Timer

DIFFERENCES = (
    "The paper runs Codex 5-shot on all 57 subjects with top-10 documents from a Wikipedia dump. "
    "Here SmolLM2-135M (near chance on MMLU) runs 5-shot on a few subjects per category with "
    "all-MiniLM-L6-v2 over the only Wikipedia text available offline (the NQ gold passages "
    "and/or WikiText-2 test), which rarely covers an exam question; expect no reliable gain.")


def main(argv=None):
    args, cfg = parse_experiment_args(argv, __doc__, CONFIGS)
    folder = require_data("mmlu")
    test = load_mmlu(folder, "test", cfg.subjects or None)
    if cfg.questions_per_subject:
        test = {s: qs[:cfg.questions_per_subject] for s, qs in test.items()}
    dev = load_mmlu(folder, "dev", list(test))
    lm = load_lm(cfg.lm, cfg.max_context)
    with Timer() as sw:
        passages = wikipedia_passages(cfg.corpus, lm.tokenizer)
        rows = {}
        for label, source in (("replug", cfg.retriever), ("replug_lsr", cfg.lsr_retriever)):
            if source is None:
                continue
            retriever = load_retriever(source)
            index = index_in_memory(passages, retriever)
            pipe = Replug(lm, retriever, index, k=cfg.k, retrieval_temperature=cfg.temperature,
                          seed=cfg.seed)
            modes = cfg.modes if label == "replug" else ("replug",)
            res = MMLUEvaluator(test, dev, modes=modes, shots=cfg.shots,
                                query_with_options=cfg.query_with_options,
                                progress=not args.no_progress).run(pipe)
            for mode, r in res.items():
                rows[mode if label == "replug" else label] = r
    cats = [c for c in CATEGORIES if any(c in r["categories"] for r in rows.values())]
    table = []
    for mode, r in rows.items():
        table.append((mode, *(f"{100 * r['categories'][c]['micro']:.1f}"
                              if c in r["categories"] else "" for c in cats),
                      f"{100 * r['overall']['micro']:.1f}", f"{100 * r['overall']['macro']:.1f}",
                      r["overall"]["questions"], r["lm_calls"]))
    payload = {"config": dataclasses.asdict(cfg), "seconds": sw.seconds, "results": rows,
               "corpus_passages": len(passages), "provenance": provenance()}
    out = write_results(
        "table2_mmlu", args.config, payload, table,
        ("mode", *cats, "all (micro)", "all (macro)", "questions", "LM rows"),
        notes=(f"{cfg.shots}-shot, {sum(map(len, test.values()))} questions from "
               f"{len(test)} subjects; corpus '{cfg.corpus}' ({len(passages)} passages); k={cfg.k}"
               f"; LM {cfg.lm}, retriever {cfg.retriever}; accuracy in %; chance is 25 %; "
               f"{sw.seconds:.0f} s."),
        root=args.out, differences=DIFFERENCES)
    fig, ax = new_figure(figsize=(6, 3))
    width = 0.8 / max(len(rows), 1)
    for j, (mode, r) in enumerate(rows.items()):
        xs = [i + j * width for i in range(len(cats) + 1)]
        ys = [100 * r["categories"][c]["micro"] for c in cats] + [100 * r["overall"]["micro"]]
        ax.bar(xs, ys, width, label=mode)
    ax.axhline(25, color="gray", lw=1, ls=":", label="chance")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats) + 1)], cats + ["all"])
    ax.set_ylabel("accuracy (%)")
    ax.legend(fontsize=8)
    save_figure(fig, out / f"{args.config}.png")


if __name__ == "__main__":
    run(main)
