"""What the REPLUG pipeline returns: the branches of a query, per-line scores and generations
(each with its documents, weights, responsibilities, settings and cost), where a retrieved
passage comes from, and corpus-level perplexity and bits per byte."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from replug_jax.core.ensemble import bits_per_byte, perplexity
from replug_jax.retrieval.corpus import Passage


@dataclasses.dataclass
class Branches:
    """The LM inputs of one query: K' prompts and their log-weights."""

    prompts: list[str]
    log_weights: np.ndarray  # [K']
    passages: list[Passage]
    scores: np.ndarray  # [K'] retrieval similarities (NaN where not applicable)


@dataclasses.dataclass
class ScoreResult:
    context: str
    continuation: str
    tokens: list[str]
    token_logprobs: np.ndarray  # [T] ensemble log-probs
    loglik: float
    num_tokens: int
    num_bytes: int
    doc_ids: list[int]
    doc_titles: list[str]
    weights: list[float]
    responsibility: np.ndarray  # [K', T]
    reliance: float | None  # loglik - loglik without retrieval
    settings: dict
    cost: dict
    branch_logprobs: np.ndarray | None = None  # [K', T] each branch's own log-probs
    doc_scores: np.ndarray | None = None  # [K'] retrieval similarities s(d, x) (NaN: none)
    sources: list[dict] = dataclasses.field(default_factory=list)  # [K'] see source_of

    def to_json(self) -> dict:
        return {"context": self.context, "continuation": self.continuation,
                "loglik": self.loglik, "num_tokens": self.num_tokens,
                "num_bytes": self.num_bytes, "tokens": self.tokens,
                "token_logprobs": [round(float(x), 5) for x in self.token_logprobs],
                "doc_ids": self.doc_ids, "doc_titles": self.doc_titles,
                "weights": [round(w, 6) for w in self.weights],
                "responsibility": np.round(self.responsibility, 5).tolist(),
                "sources": self.sources, "retrieval_reliance": self.reliance,
                "settings": self.settings, "cost": self.cost}


@dataclasses.dataclass
class GenerationResult:
    prompt: str
    text: str
    tokens: list[str]
    token_logprobs: np.ndarray  # [T] mixture log-prob of each chosen token
    doc_ids: list[int]
    doc_titles: list[str]
    doc_texts: list[str]
    weights: list[float]
    responsibility: np.ndarray  # [K', T]
    stopped_by: str
    approximation: str | None
    settings: dict
    cost: dict
    sources: list[dict] = dataclasses.field(default_factory=list)  # [K'] see source_of
    branch_prompts: list[str] = dataclasses.field(default_factory=list)  # [K'] exact LM inputs

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "branch_prompts": self.branch_prompts,
                "text": self.text, "tokens": self.tokens,
                "token_logprobs": [round(float(x), 5) for x in self.token_logprobs],
                "doc_ids": self.doc_ids, "doc_titles": self.doc_titles,
                "weights": [round(w, 6) for w in self.weights],
                "responsibility": np.round(self.responsibility, 5).tolist(),
                "stopped_by": self.stopped_by, "approximation": self.approximation,
                "sources": self.sources, "settings": self.settings, "cost": self.cost}


def source_of(p: Passage) -> dict:
    """Where a retrieved passage comes from, to join it back to the user's corpus: its row
    (``id``), the id the user gave its document (a JSONL ``id``, a DPR passage id) and its
    character span ``[start, end)`` in that document's text."""
    return {"id": p.id, "source_id": p.source_id, "start": p.start, "end": p.end,
            "title": p.title}


def summarize(results: Sequence[ScoreResult]) -> dict:
    """Corpus-level perplexity and bits per byte from per-line results."""
    ll = float(sum(r.loglik for r in results))
    toks = int(sum(r.num_tokens for r in results))
    nbytes = int(sum(r.num_bytes for r in results))
    return {"loglik": ll, "num_tokens": toks, "num_bytes": nbytes,
            "perplexity": float(perplexity(ll, max(toks, 1))),
            "bits_per_byte": float(bits_per_byte(ll, max(nbytes, 1))),
            "lines": len(results)}
