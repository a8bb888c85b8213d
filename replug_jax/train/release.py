"""The release rule of ``checkpoints/README.md``, and what a released retriever's card says.

**The rule.** A trained retriever is released as better than its base only if it beats the
base on held-out data with a paired interval that excludes zero in its favour. The
experiments (``lsr_study``, ``lsr_qa``) and ``replug export-retriever --comparison`` call
:func:`passes` and nothing else. A retriever exported without a comparison says "Not tested
against its base".
"""

from __future__ import annotations

import hashlib
import json
import pathlib

RULE = ("beats its base retriever on held-out data with a paired interval that excludes zero "
        "in its favour")
# which way is better, per metric of `replug eval` (and of the experiments' tables)
HIGHER_IS_BETTER = {"answer_loglik": True, "exact_match": True, "f1": True,
                    "answer_contained": True, "gold_recall": True, "bits_per_byte": False}


def passes(difference: dict, higher_is_better: bool) -> bool:
    """The rule on one paired difference (trained minus base, with ``low``/``high``)."""
    return difference["low"] > 0 if higher_is_better else difference["high"] < 0


def weight_digests(folder: str | pathlib.Path) -> dict[str, str]:
    """SHA-256 of every ``*.safetensors`` file under ``folder`` (paths relative to it)."""
    folder = pathlib.Path(folder)
    out = {}
    for path in sorted(folder.rglob("*.safetensors")):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        out[path.relative_to(folder).as_posix()] = h.hexdigest()
    return out


def comparison_from_eval(results_path: str | pathlib.Path, fingerprint: str,
                         metric: str | None = None, base_fingerprint: str | None = None,
                         mode: str = "replug") -> dict:
    """The paired difference of ``replug eval``'s ``results.json`` that tests the retriever
    whose weights have ``fingerprint`` against its base: the row of the compared system in
    ``mode`` (default ``replug``; ``top1`` with ``gold_recall`` is gold-passage recall@1)
    against the base's, on ``metric`` (default: gold-answer log-likelihood for QA, bits per
    byte for text). Refused in one line when the file compared other weights,
    or (with ``base_fingerprint``, the weights the run started from) when its reference
    system's query encoder is not that base: a verdict against another retriever is not a
    verdict against the base."""
    path = pathlib.Path(results_path)
    try:
        report = json.loads(path.read_text())
        systems = report["systems"]
        comparisons = report["comparisons"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not the results.json of `replug eval` ({err})") from None
    labels = list(systems)
    if len(labels) < 2:
        raise ValueError(f"{path}: compares no second retriever (run `replug eval` with "
                         "--compare-retriever <the exported folder>)")
    compared = labels[1]
    ret = systems[compared].get("retriever") or {}
    tested = ret.get("query_fingerprint", ret.get("fingerprint"))
    if tested != fingerprint:
        source = ret.get("query_source", ret.get("source"))
        raise ValueError(f"{path}: tested the retriever {source!r}"
                         f", whose weights are not these (fingerprint {str(tested)[:12]} vs "
                         f"{fingerprint[:12]}); evaluate the exported folder itself")
    ref = systems[labels[0]].get("retriever") or {}
    ref_fp = ref.get("query_fingerprint", ref.get("fingerprint"))
    if base_fingerprint is not None and ref_fp != base_fingerprint:
        raise ValueError(f"{path}: its reference system {labels[0]!r} ran the retriever "
                         f"{ref.get('query_source', ref.get('source'))!r} (fingerprint "
                         f"{str(ref_fp)[:12]}), not the base this run was trained from "
                         f"({base_fingerprint[:12]}); compare with the base as --retriever")
    metric = metric or ("answer_loglik" if report["kind"] == "qa" else "bits_per_byte")
    if metric not in HIGHER_IS_BETTER:
        raise ValueError(f"metric must be one of {sorted(HIGHER_IS_BETTER)}, got {metric!r}")
    row = f"{mode}@{compared}"
    match = [c for c in comparisons if c["row"] == row and c["reference"] == mode
             and c["metric"] == metric]
    if not match:
        raise ValueError(f"{path}: no comparison of {row} with {mode} on {metric}")
    c = match[0]
    better = HIGHER_IS_BETTER[metric]
    return {"file": report["file"], "kind": report["kind"], "examples": report["examples"],
            "metric": metric, "mode": mode, "higher_is_better": better,
            "passes": passes(c, better),
            "base": systems[labels[0]].get("retriever"), "k": report["settings"]["k"],
            **{key: c[key] for key in ("difference", "low", "high", "confidence", "items")},
            **({"clusters": c["clusters"]} if "clusters" in c else {}),
            "all": [x for x in comparisons if x["reference"] == mode and x["row"] == row]}


def verdict(comparison: dict | None) -> str:
    """The card's first line: better, not better, or not tested."""
    if comparison is None:
        return ("**Not tested against its base.** No held-out comparison was given when it "
                "was exported (`replug export-retriever --comparison <replug eval "
                "results.json>`); do not assume it is better than its base.")
    c = comparison
    where = (f"{c['metric']}" + (f" ({c['mode']} mode)" if c.get("mode", "replug") != "replug"
                                 else "") + f" on {c['items']} held-out "
             f"{'questions' if c['kind'] == 'qa' else 'windows'} of `{c['file']}`"
             + (f" in {c['clusters']} groups" if "clusters" in c else "")
             + (", recall@1" if c.get("mode") == "top1" else f", REPLUG k = {c['k']}"))
    interval = (f"{c['difference']:+.4f} [{c['low']:+.4f}, {c['high']:+.4f}] "
                f"({round(100 * c['confidence'])} % paired bootstrap interval, "
                f"{'higher' if c['higher_is_better'] else 'lower'} is better)")
    if c["passes"]:
        return f"**Better than its base**: {interval}, {where}."
    return f"**Not better than its base**: {interval}, {where}; the release rule ({RULE}) fails."
