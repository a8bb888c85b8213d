"""The language-modelling LSR study's report and release card (``lsr_study``): what differs
from the paper, the setting in words, the results table, notes and plot, and the card of a
released retriever."""

from __future__ import annotations

import pathlib

from experiments.lib.common import new_figure, save_figure, write_results
from experiments.lib.lsr_common import BASE_DATA_LM
from replug_jax.eval.stats import format_interval

DIFFERENCES = (
    "The paper trains Contriever from GPT-3 Curie on 800K Pile sequences (x, y = 128 tokens; "
    "k = 20 from the whole index, refreshed every 3K of 25K steps, batch 64). Here "
    "all-MiniLM-L6-v2 learns from SmolLM2-135M at the scale 2 CPU cores allow (each "
    "section's config is in its JSON); retrieval during training is the top-k within each "
    "example's pre-scored pool of the base retriever's top-M (the pool stands in for the "
    "index; the current query embedding re-ranks it at every step), only the query tower is "
    "trained between refreshes (documents from the last refresh, as the paper's stale index), "
    "and the final comparison retrieves from the whole datastore. " + BASE_DATA_LM)


def setting(cfg) -> tuple[str, str]:
    """``(windows, datastore)``: what the config's windows and datastore are, in words (the
    notes state them: the default's WikiText-2 and the enwiki configs differ)."""
    if cfg.index:
        n = cfg.index.split(":", 1)[1] if cfg.index.startswith("enwiki:") else None
        store = (f"the first {n} enwiki-sample articles in 100-word passages"
                 if n else f"the index `{cfg.index}`")
        store += ", embedded once by the base retriever (only the query tower learns)"
    else:
        store = f"`{cfg.corpus}` in {cfg.passage_tokens}-token passages, re-embedded"
    windows = (f"(x, y = {cfg.train.data.context_tokens} tokens) of `{cfg.train_data}`, "
               f"`{cfg.dev_data}` and `{cfg.test_data}` (disjoint articles)")
    return windows, store


def notes(cfg, payload: dict, passages: int, reused: bool) -> str:
    """The report's notes: the setting, the end-to-end comparison and the diagnostics."""
    ex, e2e, chosen = payload["examples"], payload["end_to_end"], payload["chosen"]
    windows, store = setting(cfg)
    return (
        f"Within-pool REPLUG bits per byte (top-{cfg.train.k} of each example's base top-"
        f"{cfg.pool_size}, τ = {cfg.train.selection.tau}), {ex['train']} train / "
        f"{ex['dev']} dev / {ex['test']} test windows {windows}; the "
        f"datastore, {store}, never yields the evaluated article."
        + (f" The trained runs are `{cfg.work}`'s, reused (their within-pool test values "
           "belong to its test set: only the chosen variant's is shown here)." if reused
           else "")
        + " Lower is better; "
        f"intervals: paired bootstrap over articles (windows of one article resampled "
        f"together), {cfg.bootstrap_resamples} resamples. Every window's log-likelihood is "
        f"in the JSON (`per_example`, the variants' `logliks`). LM pairs scored: "
        f"{payload['lm_pairs_scored']} "
        f"({', '.join(f'{r:.2f}' for r in payload['pairs_per_second'])} pairs/s; the "
        f"end-to-end test took {payload['end_to_end_pairs_reused']} of its pairs from the "
        f"test pool).\n\n"
        f"**End to end** (the chosen variant, {chosen}, by dev; top-{cfg.train.k} from the whole "
        f"datastore, {passages:,} passages): LM alone {e2e['lm_alone_bpb']:.4f}, "
        f"REPLUG with the base retriever {e2e['base_bpb']:.4f} "
        f"({format_interval(e2e['base_vs_lm_alone'], 4)} vs LM alone), REPLUG LSR "
        f"{e2e['lsr_bpb']:.4f} ({format_interval(e2e['lsr_vs_base'], 4)} vs base). Smallest "
        f"effect this test set detects (80 % power, 5 % level): "
        f"{e2e['min_detectable_bpb']:.4f} bits per byte. Release rule: {e2e['release_rule']}."
        f"\n\n**Before training** (no LM cost): {payload['diagnostics']['verdict']}")


def report(cfg, args, payload: dict, passages: int, reused: bool) -> None:
    """The results table (a row per variant and the base), notes and the dev curves' plot."""
    table = [("base retriever", "—", "—", f"{payload['base']['dev']['bpb']:.4f}",
              f"{payload['base']['test']['bpb']:.4f}", "—", "—")]
    for n, r in payload["variants"].items():
        test = r["test"]  # None: a run of another config's, tested there (work=)
        table.append((n, f"{r['steps_run']}", f"{r['best_step']}", f"{r['dev']['bpb']:.4f}",
                      f"{test['bpb']:.4f}" if test else "—",
                      format_interval(r["dev"]["vs_base"], 4),
                      format_interval(test["vs_base"], 4) if test else "—"))
    out = write_results("lsr_study", args.config, payload, table,
                        ("variant", "steps run", "best step", "dev BPB", "test BPB",
                         "dev Δ vs base [95 % CI]", "test Δ vs base [95 % CI]"),
                        notes=notes(cfg, payload, passages, reused), root=args.out,
                        differences=DIFFERENCES)
    plot(payload, out / f"{args.config}.png")


def plot(payload: dict, path: pathlib.Path) -> None:
    """Each variant's dev curve (within the dev pools) against its LSR step, and the base."""
    fig, ax = new_figure(figsize=(6, 3.5))
    for name, r in payload["variants"].items():
        steps = [c["step"] for c in r["curve"]]
        ax.plot(steps, [c["dev_bpb"] for c in r["curve"]], marker="o", ms=3, label=name)
    ax.axhline(payload["base"]["dev"]["bpb"], color="k", ls="--", lw=1, label="base")
    ax.set_xlabel("LSR step")
    ax.set_ylabel("dev bits per byte (within pool)")
    ax.legend(fontsize=6)
    save_figure(fig, path)


def card(cfg, payload: dict, passages: int, similarity: str) -> tuple[dict, str]:
    """``(settings, text)`` of the chosen retriever's release: its ``replug.json`` settings and
    a model card that leads with its end-to-end result and states how it was trained and
    tested (``payload``: the study's results, as in its JSON)."""
    chosen = payload["chosen"]
    r = cfg.train.retriever
    settings = {"similarity": similarity, "query_max_length": r.query_max_length,
                "doc_max_length": r.doc_max_length, "trained_from": r.name}
    e2e, row, n = payload["end_to_end"], payload["variants"][chosen], payload["examples"]
    windows, store = setting(cfg)
    d = e2e["lsr_vs_base"]
    text = "\n".join([
        f"# REPLUG LSR retriever: `{r.name}` trained from `{cfg.train.lm.name}` "
        "(language modelling)", "",
        f"Better than its base on held-out test articles: {format_interval(d, 4)} bits per "
        f"byte (REPLUG, top-{cfg.train.k} from the whole datastore of {passages:,} passages, "
        f"paired 95 % interval over {d.get('clusters', '?')} articles; the smallest effect this "
        f"test detects at 80 % power is {e2e['min_detectable_bpb']:.4f}).", "",
        f"- test, {n['test']} windows: LM alone {e2e['lm_alone_bpb']:.4f}, REPLUG with the base "
        f"retriever {e2e['base_bpb']:.4f}, with this one {e2e['lsr_bpb']:.4f} bits per byte",
        f"- trained by REPLUG LSR ({chosen}; best dev step {row['best_step']} of "
        f"{row['steps_run']} run, batch {cfg.train.batch_size}, Adam "
        f"{cfg.train.optim.learning_rate:g}) on {n['train']} train windows, selected among the "
        f"objectives and temperatures on {n['dev']} dev windows; windows {windows}",
        f"- retrieval during training: the top-{cfg.train.k} of each window's base top-"
        f"{cfg.pool_size}, scored once by the LM; datastore: {store}",
        "- made by `python -m experiments.lsr_study`; every number, with each window's "
        "log-likelihood, is in `experiments/results/lsr_study/`", "",
        BASE_DATA_LM if "minilm" in r.name.lower() else
        f"The base's own training data: see `{r.name}`'s model card.", ""])
    if cfg.train.supervision.towers == "query":  # the trained query tower, the base passages
        text += ("\nQuery tower only: the passage encoder is the base (`passage_encoder/`), "
                 f"so an index built with `{cfg.train.retriever.name}` serves it. Load both with "
                 "`Retriever.load(<this folder>)`, or the query encoder with "
                 "`SentenceTransformer(<this folder>)` and the passage encoder with "
                 "`SentenceTransformer(<this folder>/passage_encoder)`.\n")
    else:
        text += "\nLoad with `Retriever.load(<this folder>)` or `SentenceTransformer`.\n"
    return settings, text
