"""Language-model evaluation with retrieval: sliding windows, a leakage filter, BPB (paper §6.1).

A document is tokenised once with the LM's tokenizer and cut into **target windows** of
``stride`` tokens; ``stride`` is also the retrieval stride, since every window retrieves anew.
Each window is scored given the ``context_tokens`` tokens before it (the LM input ``x``),
and the retrieval query is the ``query_tokens`` tokens before it (paper: the prior 128
tokens). The first ``skip_first`` tokens of every document are context only: there is nothing
before them to retrieve with, so they are scored in no mode, and every mode is measured on
exactly the same bytes.

Windows are cut at token boundaries and mapped back to character offsets, so the windows of a
document tile its evaluated text exactly and bits per byte counts every UTF-8 byte once:
``BPB = −Σ log p / (ln 2 · bytes)``.

**Leakage filter.** When the retrieval corpus is built from the evaluated documents themselves
(WikiText-2 here), a passage overlapping the window would hand the LM its own target. The
filter excludes, per window, passages of the same source document whose character span
overlaps the window (``"window"``: context and target), or every passage of that document
(``"document"``), or nothing (``"none"``, for a corpus disjoint from the evaluation set, as
the Pile's deduplicated splits are in the paper).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import numpy as np

from replug_jax.replug import Replug, ScoreResult, summarize
from replug_jax.retrieval.corpus import LEAKAGE, Document, Passage, leakage_exclusions

__all__ = ["LEAKAGE", "LMEvaluator", "Window", "WindowSettings", "evaluate_lm",
           "leakage_exclusions", "sliding_windows", "split_wikitext"]


@dataclasses.dataclass(frozen=True)
class WindowSettings:
    context_tokens: int = 128  # LM input x before each target window
    stride: int = 128  # target tokens per window = retrieval stride
    query_tokens: int = 128  # retrieval query: the tokens right before the window
    skip_first: int = 128  # leading tokens of each document used only as context
    leakage: str = "window"  # window | document | none
    max_windows_per_document: int | None = None

    def __post_init__(self):
        for name in ("context_tokens", "stride", "query_tokens", "skip_first"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.leakage not in LEAKAGE:
            raise ValueError(f"leakage must be one of {LEAKAGE}, got {self.leakage!r}")


@dataclasses.dataclass(frozen=True)
class Window:
    source_id: str
    context: str
    target: str
    query: str
    span: tuple[int, int]  # characters of the document the window reads (context + target)
    target_span: tuple[int, int]


def split_wikitext(raw: str) -> list[Document]:
    """WikiText ``*.raw`` or ``*.tokens`` → one :class:`Document` per article (a
    ``" = Title = "`` line starts one; ``" = = Section = = "`` lines stay inside it).

    Where the text keeps WikiText's blank lines, a title line must follow one: the test split
    also holds two formula lines of the same shape inside a paragraph (``" = 1 henry and
    capacitance C = "``), which would otherwise start two bogus articles (62 instead of 60).
    A text without blank lines (``wiki.test.raw`` as shipped here) cannot tell them apart."""
    docs, title, lines = [], None, []
    blank_lines = "\n \n" in raw or "\n\n" in raw
    previous = ""
    for line in raw.splitlines():
        m = re.fullmatch(r" = ([^=].*?) = ", line)
        after_blank = not blank_lines or not previous.strip()
        previous = line
        if m and after_blank:
            if title is not None and "".join(lines).strip():
                docs.append(Document(f"wikitext:{len(docs)}", "\n".join(lines).strip(), title))
            title, lines = m.group(1).strip(), []
        elif title is not None:
            lines.append(line)
    if title is not None and "".join(lines).strip():
        docs.append(Document(f"wikitext:{len(docs)}", "\n".join(lines).strip(), title))
    return docs


def sliding_windows(doc: Document, tokenizer, settings: WindowSettings) -> list[Window]:
    """The target windows of ``doc`` (see the module docstring)."""
    enc = tokenizer(doc.text, add_special_tokens=False, return_offsets_mapping=True)
    starts = [s for s, e in enc["offset_mapping"] if e > s]
    n = len(starts)

    def boundary(i: int) -> int:  # character where token i starts (end of text for i = n)
        return 0 if i == 0 else len(doc.text) if i >= n else starts[i]

    out = []
    for s in range(settings.skip_first, n, settings.stride):
        e = min(s + settings.stride, n)
        c0 = boundary(max(0, s - settings.context_tokens))
        q0 = boundary(max(0, s - settings.query_tokens))
        t0, t1 = boundary(s), boundary(e)
        out.append(Window(doc.id, doc.text[c0:t0], doc.text[t0:t1], doc.text[q0:t0],
                          (c0, t1), (t0, t1)))
        if settings.max_windows_per_document and len(out) >= settings.max_windows_per_document:
            break
    return out


def evaluate_lm(pipe: Replug, documents: Sequence[Document], settings: WindowSettings, *,
                modes: Sequence[str] = ("none", "replug"), k: int | None = None,
                passages: Sequence[Passage] | None = None, batch_size: int = 4,
                progress: bool = True, keep_results: bool = False) -> dict:
    """Perplexity and bits per byte of ``documents`` for each ``mode`` of ``pipe``.

    ``passages`` (default: the index's) are what the leakage filter checks. Returns per mode
    the totals of :func:`replug_jax.replug.summarize`, the cost, and the settings; with
    ``keep_results`` also the per-window :class:`~replug_jax.replug.ScoreResult` list.
    """
    from tqdm.auto import tqdm

    if not documents:
        raise ValueError("no documents to evaluate")
    windows = [w for d in documents for w in sliding_windows(d, pipe.lm.tokenizer, settings)]
    if not windows:
        raise ValueError(f"no document is longer than skip_first={settings.skip_first} tokens: "
                         "nothing to evaluate")
    if passages is None and pipe.index is not None:
        passages = pipe.index.passages
    exclusions = leakage_exclusions(windows, passages or [], settings.leakage)
    report = {"settings": dataclasses.asdict(settings), "windows": len(windows),
              "documents": len(documents),
              "mean_excluded_passages": float(np.mean([len(e) for e in exclusions])),
              "modes": {}}
    for mode in modes:
        results: list[ScoreResult] = []
        cost: dict[str, float] = {}
        bar = tqdm(total=len(windows), desc=f"lm-eval:{mode}", disable=not progress)
        for start in range(0, len(windows), batch_size):
            batch = windows[start:start + batch_size]
            res = pipe.score([w.context for w in batch], [w.target for w in batch],
                             [w.query for w in batch], mode=mode, k=k,
                             exclude_ids=exclusions[start:start + batch_size], reliance=False)
            results.extend(res)
            for key, value in res[0].cost.items():
                if isinstance(value, (int, float)) and key != "shared_by":
                    cost[key] = cost.get(key, 0) + value
            bar.update(len(batch))
        bar.close()
        entry = summarize(results)
        entry["cost"] = cost
        entry["settings"] = results[0].settings
        if keep_results:
            entry["results"] = results
        report["modes"][mode] = entry
    return report


@dataclasses.dataclass
class LMEvaluator:
    """Language modelling (Table 1): bits per byte and perplexity of ``documents`` for each
    mode, with ``run(pipe) -> dict`` like every evaluator in :mod:`replug_jax.eval`."""

    documents: Sequence[Document]
    settings: WindowSettings
    modes: Sequence[str] = ("none", "replug")
    k: int | None = None  # documents per window (default: the pipeline's k)
    batch_size: int = 4
    progress: bool = True
    keep_results: bool = False
    name: str = "lm"

    def run(self, pipe: Replug) -> dict:
        return evaluate_lm(pipe, self.documents, self.settings, modes=self.modes, k=self.k,
                           batch_size=self.batch_size, progress=self.progress,
                           keep_results=self.keep_results)
