"""What a frozen, black-box LM must expose for REPLUG, and what each exposure allows.

Capabilities (see ``papers/replug-notes-black-box.txt``):

* ``NEXT_TOKEN`` — the full next-token distribution: the exact token-level ensemble of §3.2
  and coordinated decoding.
* ``SCORE`` — per-token log-probs of supplied text: perplexity, answer likelihood and the LSR
  supervision of §4.2.
* ``TOP_LOGPROBS`` — only the n most likely next tokens: an *approximate* ensemble over the
  union of returned tokens (a token missing from a branch's top-n gets probability 0 there,
  so the mixture is a lower bound); results say so.
* ``ENSEMBLE_DECODE`` — the LM runs REPLUG's whole coordinated decoding itself, given the
  K branch prompts and λ (``generate_ensemble``: one compiled loop on the device, the mixture
  of §3.2 at every step); without it the pipeline decodes token by token through
  ``NEXT_TOKEN`` or ``TOP_LOGPROBS``.

A backend that only returns text exposes none of these: only "retrieve-and-prompt" is possible
there, which is not REPLUG, and the pipeline refuses ensemble operations in one line.

Nothing an LM returns ever enters a gradient: scores are NumPy arrays.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Protocol, Sequence, runtime_checkable

import numpy as np

NEXT_TOKEN = "next_token_logprobs"
SCORE = "score_continuations"
TOP_LOGPROBS = "top_logprobs"
ENSEMBLE_DECODE = "ensemble_decode"


class CapabilityError(RuntimeError):
    """The LM backend cannot do what was asked (e.g. scoring through a text-only API)."""


@dataclasses.dataclass
class ContinuationScore:
    """Per-token log-probs of a continuation given a prompt."""

    token_ids: np.ndarray  # [T] continuation token ids (or -1 when the backend gives none)
    tokens: list[str]  # [T] token strings
    logprobs: np.ndarray  # [T] float32 log p(token | prompt, previous tokens)
    prompt_tokens: int

    @property
    def total(self) -> float:
        return float(self.logprobs.sum())


@dataclasses.dataclass
class CostMeter:
    """LM calls, tokens and time: the black-box notes ask for these on every result."""

    lm_calls: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    lm_seconds: float = 0.0
    cached_input_tokens: int = 0  # input tokens a server reported serving from its cache
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, calls: int, input_tokens: int, output_tokens: int, seconds: float, *,
            cached: int = 0) -> None:
        with self._lock:
            self.lm_calls += calls
            self.input_tokens += input_tokens
            self.output_tokens += output_tokens
            self.lm_seconds += seconds
            self.cached_input_tokens += cached

    def snapshot(self) -> dict:
        return {"lm_calls": self.lm_calls, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "lm_seconds": round(self.lm_seconds, 4),
                "cached_input_tokens": self.cached_input_tokens}

    @staticmethod
    def diff(after: dict, before: dict) -> dict:
        return {k: round(after[k] - before[k], 4) if isinstance(after[k], float)
                else after[k] - before[k] for k in after}


@runtime_checkable
class LMScorer(Protocol):
    """The frozen LM as the pipeline sees it. Implementations declare ``capabilities``."""

    name: str
    capabilities: frozenset[str]
    cost: CostMeter
    max_context: int | None

    def score_continuations(self, prompts: Sequence[str], continuations: Sequence[str]
                            ) -> list[ContinuationScore]:
        """Log-probs of each continuation's tokens after its prompt (teacher forcing)."""
        ...

    def next_token_logprobs(self, prompts: Sequence[str]) -> np.ndarray:
        """``[N, V]`` log-probs of the next token after each prompt."""
        ...

    def top_logprobs(self, prompts: Sequence[str], n: int, generated: str = ""
                     ) -> list[dict[str, float]]:
        """The ``n`` most likely next tokens (as strings) with log-probs after each
        ``prompt + generated`` (``generated``: the text decoded so far, which a chat API
        receives as the assistant's turn); the end of text is the empty string."""
        ...

    def count_tokens(self, text: str) -> int:
        ...

    def truncate(self, text: str, max_tokens: int) -> str:
        """``text`` cut to its first ``max_tokens`` tokens."""
        ...


def require(scorer, capability: str, what: str) -> None:
    """Refuse ``what`` in one line when ``scorer`` lacks ``capability`` (a scorer that knows
    why, such as a probed API server, says so through its ``missing`` method)."""
    if capability not in scorer.capabilities:
        missing = getattr(scorer, "missing", None)
        reason = missing(capability, what) if missing is not None else None
        raise CapabilityError(reason or (
            f"{what} needs the LM capability {capability!r}, which {scorer.name!r} does not "
            f"expose (it has: {', '.join(sorted(scorer.capabilities)) or 'none'})"))


def stop_position(text: str, stop) -> int | None:
    """Where the first stop string starts in ``text``, ignoring leading whitespace (so a
    newline stop does not end an answer before it begins); None if there is none."""
    body = text.lstrip()
    lead = len(text) - len(body)
    found = [body.find(s) for s in stop if s and s in body]
    return lead + min(found) if found else None
