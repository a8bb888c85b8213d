"""Table 3 at laptop scale: NQ few-shot QA with no retrieval, concatenation, REPLUG, random
documents (and REPLUG LSR given a trained retriever): gold-answer log-likelihood, EM and F1.

Setting: questions from ``nq_gold_passages`` (624 NQ questions with their gold Wikipedia
passage); the retrieval corpus is all 624 passages, so the gold passage is always retrievable
(the paper retrieves from a full Wikipedia dump, which is not available here). The retrieval
query is the question alone; the LM sees few-shot demonstrations taken from questions outside
the evaluated set. Usage: ``python -m experiments.table3_qa [--config tiny] [--set k=10]``.
"""

from __future__ import annotations

import argparse
import json
import re

import numpy as np

from experiments.common import Stopwatch, pick_config, provenance, require_data, write_results
from experiments.configs.table3_qa import CONFIGS
from replug_jax.eval.qa import exact_match, f1_score, first_line
from replug_jax.lm.flax_scorer import FlaxLM
from replug_jax.prompts import qa_prompt
from replug_jax.replug import Replug
from replug_jax.retrieval.corpus import Passage
from replug_jax.retrieval.encoder import Retriever
from replug_jax.retrieval.index import Index


def load_nq():
    folder = require_data("nq_gold_passages")
    open_rows = [json.loads(x) for x in (folder / "nq_openbook.jsonl").read_text().splitlines()]
    closed = [json.loads(x) for x in (folder / "nq_closedbook.jsonl").read_text().splitlines()]
    passages, questions = [], []
    for i, row in enumerate(open_rows):
        m = re.match(r"Context: (.*)\n\nQuestion: (.*)\nAnswer:", row["query"], re.S)
        passages.append(Passage(i, m.group(1).strip()))
        questions.append(m.group(2).strip())
    answers = [[r["answer"]] + list(r.get("aliases", [])) for r in closed]
    return passages, questions, answers


def evaluate(cfg, retriever_source: str, passages, questions, answers, lm, label: str,
             progress: bool = True) -> dict:
    from tqdm.auto import tqdm

    retriever = Retriever.load(retriever_source)
    index = Index.build(retriever.encode_passages([p.text for p in passages]), passages,
                        encoder=retriever.identity)
    pipe = Replug(lm, retriever, index, k=cfg.k, temperature=cfg.temperature, seed=cfg.seed)
    n = cfg.num_questions
    demos = [(questions[-1 - j], answers[-1 - j][0]) for j in range(cfg.shots)]
    prompts = [qa_prompt(q, demonstrations=demos, chat=False) for q in questions[:n]]
    out = {}
    for mode in cfg.modes:
        if label != "replug" and mode != "replug":
            continue  # the LSR retriever only changes the REPLUG row
        lls, ems, f1s, gold_w, gold_hit, costs = [], [], [], [], [], []
        for i in tqdm(range(n), desc=f"{label}:{mode}", disable=not progress):
            [s] = pipe.score([prompts[i]], [" " + answers[i][0]], [questions[i]], mode=mode,
                             reliance=False)
            lls.append(s.loglik)
            costs.append(s.cost)
            if mode == "replug":
                w = dict(zip(s.doc_ids, s.weights))
                gold_w.append(w.get(i, 0.0))
                gold_hit.append(i in w)
            if mode in cfg.generate_modes:
                [g] = pipe.generate([prompts[i]], cfg.max_new_tokens, stop=["\n"],
                                    queries=[questions[i]], mode=mode)
                pred = first_line(g.text)
                ems.append(exact_match(pred, answers[i]))
                f1s.append(f1_score(pred, answers[i]))
        row = {"mean_answer_loglik": float(np.mean(lls)), "lm_calls": int(
            sum(c["lm_calls"] for c in costs)), "input_tokens": int(
            sum(c["input_tokens"] for c in costs))}
        if ems:
            row.update(exact_match=float(np.mean(ems)), f1=float(np.mean(f1s)))
        if gold_w:
            row.update(mean_gold_weight=float(np.mean(gold_w)),
                       gold_recall_at_k=float(np.mean(gold_hit)))
        out[mode if label == "replug" else "replug_lsr"] = row
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="default", help=f"one of {sorted(CONFIGS)}")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="override config fields, e.g. --set k=10 num_questions=50")
    ap.add_argument("--no-progress", action="store_true", help="hide progress bars")
    args = ap.parse_args(argv)
    cfg = pick_config(CONFIGS, args.config, args.set)
    passages, questions, answers = load_nq()
    lm = FlaxLM.load(cfg.lm, max_context=cfg.max_context)
    with Stopwatch() as sw:
        rows = evaluate(cfg, cfg.retriever, passages, questions, answers, lm, "replug",
                        not args.no_progress)
        if cfg.lsr_retriever:
            rows.update(evaluate(cfg, cfg.lsr_retriever, passages, questions, answers, lm,
                                 "lsr", not args.no_progress))
    payload = {"config": cfg.__dict__, "results": rows, "seconds": sw.seconds,
               "provenance": provenance(),
               "setting": "NQ questions with the 624 gold passages as the retrieval corpus; "
                          f"{cfg.shots}-shot plain prompts; query = question"}
    table = [(mode, f"{r['mean_answer_loglik']:.3f}", f"{r.get('exact_match', float('nan')):.3f}",
              f"{r.get('f1', float('nan')):.3f}", f"{r.get('mean_gold_weight', float('nan')):.3f}",
              r["lm_calls"]) for mode, r in rows.items()]
    out = write_results("table3_qa", args.config, payload, table,
                        ("mode", "mean gold-answer loglik", "EM", "F1", "gold λ", "LM rows"),
                        notes=f"{cfg.num_questions} questions, k={cfg.k}, {cfg.shots}-shot, "
                              f"LM {cfg.lm}, retriever {cfg.retriever}; {sw.seconds:.0f} s.")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        modes = list(rows)
        ax.bar(modes, [rows[m]["mean_answer_loglik"] for m in modes], color="tab:blue")
        ax.set_ylabel("mean gold-answer log-likelihood")
        ax.set_title(f"NQ, {cfg.num_questions} questions, k={cfg.k}")
        fig.tight_layout()
        fig.savefig(out / f"{args.config}.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
