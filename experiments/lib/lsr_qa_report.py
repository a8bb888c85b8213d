"""The LSR QA study's report (``lsr_qa``): the results table, notes and plot, and the card of
the chosen retriever when the pre-registered rule passes and it is released."""

from __future__ import annotations

import pathlib

from experiments.lib.common import new_figure, save_figure, write_results
from experiments.configs.lsr_qa import PRIMARY_ENDPOINT
from experiments.lib.lsr_common import BASE_DATA, run_config
from replug_jax.eval.stats import format_interval
from replug_jax.retrieval import fitted_tau


DIFFERENCES = {
    "squad": (
        "The paper trains Contriever with GPT-3 Curie's likelihoods on Pile text and evaluates "
        "QA with Codex on NQ/TriviaQA over a 2018 Wikipedia dump. Here all-MiniLM-L6-v2 learns "
        "from SmolLM2-135M's answer likelihoods on SQuAD v1.1 training questions; the datastore "
        "is every SQuAD paragraph plus passages of the 2015 English Wikipedia sample in 100-word "
        "passages (distractors); only the query tower learns (documents keep the base "
        "embeddings, so the datastore is embedded once), retrieval during training is the "
        "top-k within each question's pre-scored pool, and the test retrieves from the whole "
        "datastore. " + BASE_DATA),
    "nq": (
        "The paper trains on Pile text and evaluates NQ with Codex over a 2018 Wikipedia dump. "
        "Here all-MiniLM-L6-v2 learns from SmolLM2-135M's answer likelihoods on NQ questions "
        "themselves, cross-fitted in folds by question (no question is tested by a retriever "
        "trained on it); the datastore is the 624 NQ gold passages plus passages of the 2015 "
        "English Wikipedia sample (distractors); only the query tower learns; retrieval during "
        "training is the top-k within each question's pre-scored pool, and the test retrieves "
        "from the whole datastore. " + BASE_DATA),
}


def card(cfg, retriever, payload: dict) -> tuple[dict, str]:
    """``(settings, text)`` of the chosen retriever's release (two towers in float16: its
    trained query encoder, the base passage encoder, so the datastore's embeddings stay
    valid): ``replug.json``'s settings with the τ fitted on dev, and a card that leads with
    the primary endpoint's interval (recall@1 on every test question in a recall study, else
    the gold-answer log-likelihood) and states the base's training data."""
    p, chosen = payload, payload["chosen"]
    r = p["systems"][chosen]
    settings = {"similarity": retriever.similarity, "query_max_length":
                retriever.query_max_length, "doc_max_length": retriever.max_length,
                "trained_from": cfg.train.retriever.name,
                fitted_tau.SETTINGS_KEY: fitted_tau.record(
                    r["tau"], {"data": "SQuAD train dev-split articles",
                               "grid": list(cfg.train.selection.tau_grid)})}
    wide = p.get("recall_test")
    if wide:  # the primary endpoint: recall@1 over the whole datastore, every test question
        lead = (f"Better than its base: gold-paragraph recall@1 (higher is better) "
                f"{wide['recall'][chosen]['1']:.3f} vs {wide['recall']['base retriever']['1']:.3f}"
                f", {format_interval(wide['vs_base'][chosen]['1'], 3)} (95 % CI over "
                f"{wide['articles']} test articles, {wide['questions']:,} questions no "
                "retriever trained on); gold-answer log-likelihood, the gatekeeping secondary: "
                f"{format_interval(r['vs_base'], 3)} nats per question.")
    else:
        lead = ("Better than its base: gold-answer log-likelihood (higher is better) "
                f"{format_interval(r['vs_base'], 3)} nats per question vs the base retriever "
                "(95 % CI over test articles no retriever trained on).")
    text = "\n".join([
        "# REPLUG LSR retriever: all-MiniLM-L6-v2, query tower trained on SQuAD v1.1", "",
        lead, "", BASE_DATA, "",
        f"Trained by REPLUG LSR from `{cfg.train.lm.name}`'s answer likelihoods ({chosen}), "
        "query tower only; the passage encoder is the base (`passage_encoder/`), so an index "
        f"built with `{cfg.train.retriever.name}` serves it. Inference τ = {r['tau']:g}, "
        "fitted on dev.", "",
        f"On {p['questions']['test']} questions of {p['articles']['test']} SQuAD "
        + ("dev articles" if cfg.test_source == "dev" else "train articles that neither its "
           "training nor its dev questions came from")
        + " (no retriever trained on them; datastore: every SQuAD paragraph plus "
        f"{p['datastore_passages']:,} passages in all), REPLUG k = {cfg.train.k}:", "",
        f"- gold-answer log-likelihood per question: {r['test_loglik']:.3f}, "
        f"{format_interval(r['vs_base'], 3)} vs the base retriever (95 % CI over articles)",
        *(f"- recall@{k}: {r[f'recall@{k}']:.3f}, "
          f"{format_interval(r[f'recall@{k}_vs_base'], 3)} vs the base" for k in cfg.recall_ks),
        "", "Made by `python -m experiments.lsr_qa`; every number is in "
        "`experiments/results/lsr_qa/`. Load with `Retriever.load(<this folder>)`, or the "
        "query encoder with `SentenceTransformer(<this folder>)` and the passage encoder "
        "with `SentenceTransformer(<this folder>/passage_encoder)`.", ""])
    return settings, text


def chosen_name(runs: dict) -> str:
    """The variant with the best dev value at its selected step (the shuffled-Q control
    excluded): dev recall@1 where the runs selected on it, else the dev pool curve."""
    real = {n: r for n, r in runs.items() if "shuffled-Q" not in n}

    def value(n):
        r = real[n]
        settings = run_config(r["config"])
        if settings is not None and settings.selection.metric == "recall@1":
            best = next(c for c in r["curve"] if c["step"] == r["best_step"])
            return -best["dev_recall@1"]
        return min(c["dev_bpb"] for c in r["curve"])

    return min(real, key=value)


def _mean(values) -> float:
    return sum(values) / len(values)


def post_hoc(rows: dict, chosen: str) -> str:
    """A paragraph when the variant with the best dev-pool log-likelihood at the fitted τ
    (the top-k within each dev question's pool, not retrieval from the whole datastore) is
    not the pre-registered choice: its test numbers, labelled post hoc — no release rests on
    them."""
    real = {n: r for n, r in rows.items() if "vs_base" in r and "shuffled-Q" not in n}
    if not real:
        return ""
    best = max(real, key=lambda n: real[n]["dev_loglik"])
    if best == chosen:
        return ""
    r, recall = real[best], next(k for k in real[best] if k.endswith("_vs_base")
                                 and k.startswith("recall@"))
    return (f"Post hoc (not the pre-registered rule; nothing is released on it): ranked by "
            f"the dev-pool log-likelihood at the fitted τ instead of the dev curve at τ = 1 (both "
            f"within the dev pools), the best "
            f"variant is {best} (dev {r['dev_loglik']:.3f} vs the chosen one's "
            f"{rows[chosen]['dev_loglik']:.3f}): test {format_interval(r['vs_base'], 3)} nats "
            f"per question, {recall.removesuffix('_vs_base')} "
            f"{format_interval(r[recall], 3)} vs the base.\n\n")


def summary_table(rows: dict, chosen: str, rk) -> list[tuple]:
    """A row per retriever: τ per fold, dev and test log-likelihoods, recall@k, and the test
    differences from the base."""
    table = []
    for name, r in rows.items():
        vs = r.get("vs_base")
        table.append((name + (" (chosen)" if name == chosen else ""),
                      "/".join(f"{t:g}" for t in r["tau_per_fold"]),
                      f"{r['dev_loglik']:.3f}", f"{r['test_loglik']:.3f}",
                      format_interval(vs, 3) if vs else "—",
                      *(f"{r[f'recall@{k}']:.3f}" for k in rk),
                      format_interval(r[f"recall@{rk[0]}_vs_base"], 3) if vs else "—"))
    return table


def plot_curves(payload: dict, path) -> None:
    """Each run's selection curve against its LSR step, every point at the τ fitted on dev at
    that evaluation, with each run's best step starred: dev recall@1 over the whole datastore
    beside the dev pools' log-likelihood (its guard, the base's value dashed) where the runs
    selected on recall@1, else the dev pools' bits per answer byte they selected on."""
    runs = payload["runs"]
    first = next(iter(runs.values()))
    curves = [c for r in runs.values() for c in r["curve"]]
    recall = all("dev_recall@1" in c for c in curves)
    # runs before the fitted-τ selection evaluated their curve at the config's eval_temperature
    then = run_config(first["config"])  # None: the retired pool trainer's record
    tau = ("fitted τ" if all("tau" in c for c in curves) else
           f"τ = {then.selection.tau if then else first['config'].get('eval_temperature', 1):g}")
    panels = ([("dev_recall@1", "dev recall@1 (selects)\nover the whole datastore"),
               ("dev_loglik", f"dev-pool log-likelihood (guard)\nnats per question, {tau}")]
              if recall else
              [("dev_bpb", f"dev bits per answer byte (selects)\nwithin the dev pools, {tau}")])
    fig, axes = new_figure(ncols=len(panels), figsize=(5 * len(panels) + 1, 3.5), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for name, r in runs.items():
            curve = r["curve"]
            line, = ax.plot([c["step"] for c in curve], [c[key] for c in curve],
                            marker="o", ms=3, label=name)
            best = [c for c in curve if c["step"] == r["best_step"]]
            ax.plot([c["step"] for c in best], [c[key] for c in best], marker="*", ms=11,
                    color=line.get_color(), linestyle="none")
        if key == "dev_loglik":
            ax.axhline(first["curve"][0][key], color="grey", linestyle="--", linewidth=1,
                       label="base (step 0)")
        ax.set_xlabel("LSR step")
        ax.set_ylabel(label)
    axes[0][0].legend(fontsize=6)
    save_figure(fig, path)


def write_report(payload, rows, cfg, args, chosen) -> None:
    rk = cfg.recall_ks
    table = summary_table(rows, chosen, rk)
    p, q = payload, payload["questions_per_fold"]
    h = payload["oracle_vs_base"]
    folds = len(q["test"])
    split = (f"{q['train'][0]} train / {q['dev'][0]} dev / {q['test'][0]} test questions "
             f"({p['articles']['train']} / {p['articles']['dev']} / {p['articles']['test']} "
             "articles)" if folds == 1 else
             f"{folds} folds by question over {p['questions']['test']} questions: each tested "
             f"once, by retrievers trained on ~{round(sum(q['train']) / folds)} others "
             f"(~{round(sum(q['dev']) / folds)} more for dev) of its fold's complement")
    em = payload["qa"].get("chosen_vs_base")
    mde, stated = p["min_detectable_nats"], cfg.detectable_effect
    rate = (", ".join(f"{r:.1f}" for r in p["pairs_per_second"]) + " pairs/s"
            if p["pairs_per_second"] else "rate not recorded: its parts were scored before "
            "parts kept their time")
    endpoint = p.get("primary_endpoint", PRIMARY_ENDPOINT)
    if folds > 1:  # cross-fitted by question: each question is its own cluster
        endpoint = endpoint.replace("95 % CI over test articles", "95 % CI over test questions")
    wide = p.get("recall_test")
    # in a recall study the table's recall columns are on the test questions with an LM pool
    on = f" ({q['test'][0]:,} LM-pool questions)" if wide and folds == 1 else ""
    unit = ("nats per question" if not wide else
            f"in recall@1 on {wide['questions']:,} questions of {wide['articles']} articles")
    transfer = p.get("transfer_nq")
    notes = (
        f"Primary endpoint (pre-registered): {endpoint}. Chosen: {chosen}; "
        f"{format_interval(p['primary'], 3)} {unit}; smallest effect this test "
        f"detects (80 % power, 5 % level): {mde:.3f} (stated before the run: {stated:g}"
        + (f"; {mde / stated:.1f}× larger: the per-question differences varied far more than "
           "planned for, so the test has less power than it was sized for" if mde > 1.5 * stated
           else "") + f"). Release rule: {p['release_rule']}.\n\n"
        + post_hoc(rows, chosen) +
        f"{split}; datastore {p['datastore_passages']:,} passages; pools of "
        f"{cfg.pool_size} per question" + (f" ({cfg.test_pool_size} on test)" if
                                            cfg.test_pool_size else "")
        + f", {p['lm_pairs_scored']:,} LM pairs scored ({rate}); k = {cfg.train.k}; "
        f"towers: {cfg.train.supervision.towers}. LM alone (closed book): "
        f"{p['lm_alone_test_loglik']:.3f} nats per question.\n\nBefore training (no LM cost): "
        f"the oracle (the LM's own top-{cfg.train.k} of each pool) vs the base: dev "
        f"{format_interval(h['dev'], 3)}, test "
        + (f"{format_interval(h['test'], 3)} nats per question." if h["test"] else
           "— (its pool holds only the base's top-k).")
        + f"\n\nLSR steps (best on dev / run, batch {cfg.train.batch_size}; step 0 = the base "
        "retriever kept): " + "; ".join(f"{n} {r['best_step']}/{r['steps_run']}"
                                        for n, r in p["runs"].items()) + "."
        + (" A run whose best step is 0 returned the base itself: its difference from the base "
           "is 0 by construction and shows nothing (a shuffled-Q control must train a fixed "
           "number of steps to be informative)." if any(r["best_step"] == 0 for r in
                                                        p["runs"].values()) else "")
        + (f"\n\nEM / F1 on {len(p['qa']['base retriever']['em'])} test questions "
           "(greedy REPLUG): " + ", ".join(
               f"{who} {_mean(p['qa'][who]['em']):.3f} / {_mean(p['qa'][who]['f1']):.3f}"
               for who in ("base retriever", "chosen"))
           + f"; chosen − base EM {format_interval(em['em'], 3)}, F1 "
           f"{format_interval(em['f1'], 3)}." if em else "")
        + (f"\n\nTransfer, reported not gated: on the {transfer['questions']} NQ questions with "
           f"gold passages ({transfer['datastore_passages']:,} passages), recall@1 base "
           f"{transfer['recall@1']['base retriever']:.3f}, chosen "
           f"{transfer['recall@1']['chosen']:.3f} "
           f"({format_interval(transfer['recall@1_chosen_vs_base'], 3)}, 95 % CI over "
           "questions)." if transfer else ""))
    out = write_results("lsr_qa", args.config, payload, table,
                        ("retriever", "τ (dev)", "dev-pool loglik (fitted τ)", "test loglik",
                         "test Δ vs base [95 % CI]", *(f"recall@{k}{on}" for k in rk),
                         f"Δ recall@{rk[0]} vs base [95 % CI]{on}"),
                        notes=notes, root=args.out, differences=DIFFERENCES[cfg.dataset])
    plot_curves(payload, out / f"{args.config}.png")


def main(argv=None):
    """Rewrite a finished run's README, table and plot from its JSON (no LM, no retrieval):
    ``python -m experiments.lib.lsr_qa_report [--config default|nq] [--out RESULTS]``."""
    import argparse
    import json

    from experiments.lib.common import RESULTS
    from experiments.configs.lsr_qa import QAStudyConfig
    from replug_jax import config

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--config", default="default", help="the run's config name (its JSON)")
    ap.add_argument("--out", type=pathlib.Path, default=RESULTS,
                    help="results root holding lsr_qa/<config>.json")
    args = ap.parse_args(argv)
    path = args.out / "lsr_qa" / f"{args.config}.json"
    if not path.exists():
        raise SystemExit(f"{path}: no results; run `python -m experiments.lsr_qa --config "
                         f"{args.config}` first")
    payload = json.loads(path.read_text())
    cfg = config.from_record(QAStudyConfig, payload["config"])  # earlier results: flat
    write_report(payload, payload["systems"], cfg, args, payload["chosen"])


if __name__ == "__main__":
    from experiments.lib.common import run

    run(main)
