"""What ``replug eval`` writes beside its per-example records: ``results.json`` (the report),
``summary.md`` (the table and the paired differences) and ``results.png`` (each difference
with its interval), all written atomically."""

from __future__ import annotations

import pathlib

from replug_jax.eval.stats import format_interval
from replug_jax.fileio import atomic_path, write_json_atomic, write_text_atomic

# the columns of the summary table, per kind: (row field, header, digits)
COLUMNS = {"qa": (("mean_answer_loglik", "answer log-lik.", 3), ("exact_match", "EM", 3),
                  ("f1", "F1", 3), ("answer_contained", "contains answer", 3),
                  ("gold_recall_at_k", "gold recall@k", 3),
                  ("lm_calls", "LM rows", 0)),
           "text": (("bits_per_byte", "bits per byte", 4), ("perplexity", "perplexity", 3),
                    ("windows", "windows", 0), ("num_bytes", "bytes", 0))}
BETTER = {"answer_loglik": "higher", "exact_match": "higher", "f1": "higher",
          "answer_contained": "higher", "acc": "higher", "gold_recall": "higher",
          "bits_per_byte": "lower"}


def summary_markdown(report: dict) -> str:
    """The report as a short Markdown page."""
    kind = report["kind"]
    cols = [c for c in COLUMNS[kind] if any(c[0] in r for r in report["rows"].values())]
    lines = [f"# replug eval: `{report['file']}`", "",
             f"{report['examples']} {'questions' if kind == 'qa' else 'texts'}"
             + (f" in {report['clusters']} groups" if report.get("clusters") else "")
             + f", k = {report['settings']['k']}", ""]
    for label, s in report["systems"].items():
        ret = s.get("retriever") or {}
        lines.append(f"- system `{label}`: LM `{s['lm']}`, retriever "
                     f"`{ret.get('query_source', ret.get('source', '-'))}`, τ = "
                     f"{s['retrieval_temperature']:g} ({s['retrieval_temperature_source']})")
    lines += ["", "| row | " + " | ".join(h for _, h, _ in cols) + " |",
              "|---|" + "---:|" * len(cols)]
    for name, row in report["rows"].items():
        cells = [("-" if f not in row else f"{row[f]:.{d}f}" if d else f"{row[f]:,}")
                 for f, _, d in cols]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    flashrag = {name: row["flashrag"] for name, row in report["rows"].items()
                if "flashrag" in row}
    if flashrag:
        lines += ["", "FlashRAG's metric names and definitions (`em`; `f1`, where yes / no / "
                  "noanswer must match; `acc`, a gold answer anywhere in the prediction), "
                  "on the same normalisation (lower-case; punctuation and a/an/the dropped):",
                  "", "| row | em | f1 | acc |", "|---|---:|---:|---:|",
                  *(f"| {name} | {m['em']:.3f} | {m['f1']:.3f} | {m['acc']:.3f} |"
                    for name, m in flashrag.items())]
    if report["comparisons"]:
        conf = round(100 * report["settings"]["confidence"])
        lines += ["", f"Paired differences, row minus reference, with {conf} % bootstrap "
                  "intervals resampling what the last column names (whole groups, or items "
                  "taken as independent):", "",
                  "| row | reference | metric | difference | better | resampled |",
                  "|---|---|---|---|---|---|"]
        for c in report["comparisons"]:
            unit = c.get("resampled", "items")
            count = c.get("clusters", c.get("items"))
            lines.append(f"| {c['row']} | {c['reference']} | {c['metric']} | "
                         f"{format_interval(c, 4)} | {BETTER[c['metric']]} | "
                         f"{count} {unit} |")
        if report.get("clusters") == 1:
            lines += ["", "Every example is in one group: the intervals resample single "
                      "items, as if they were independent (give each article or source its "
                      "own `group`)."]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: pathlib.Path) -> str | None:
    """Each paired difference with its interval, one panel per metric; None when drawn, else
    why not (nothing written): no comparison to draw, or no matplotlib."""
    metrics = list(dict.fromkeys(c["metric"] for c in report["comparisons"]))
    if not metrics:
        return "no paired comparison to draw (one row only)"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.2), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        cs = [c for c in report["comparisons"] if c["metric"] == metric]
        y = range(len(cs))
        ax.errorbar([c["difference"] for c in cs], y, fmt="o", capsize=3,
                    xerr=[[c["difference"] - c["low"] for c in cs],
                          [c["high"] - c["difference"] for c in cs]])
        ax.axvline(0, color="grey", lw=0.8)
        ax.set_yticks(list(y), [f"{c['row']} − {c['reference']}" for c in cs], fontsize=8)
        ax.set_title(f"{metric} ({BETTER[metric]} is better)", fontsize=9)
    fig.tight_layout()
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return None


def write_report(report: dict, out: pathlib.Path) -> None:
    skipped = plot(report, out / "results.png")
    report["files"] = {"records": "records.jsonl", "summary": "summary.md",
                       "plot": None if skipped else "results.png"}
    if skipped:
        report["files"]["plot_skipped"] = skipped
    text = summary_markdown(report)
    if skipped:
        text += f"\nNo results.png: {skipped}.\n"
    write_text_atomic(text, out / "summary.md")
    write_json_atomic(report, out / "results.json")
