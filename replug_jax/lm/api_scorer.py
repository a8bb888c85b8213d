"""An OpenAI-compatible completions API as the frozen black-box LM (``httpx``).

Scoring supplied text uses ``/v1/completions`` with ``echo=true, max_tokens=0, logprobs=0``
(the legacy OpenAI interface, which returns the prompt's per-token log-probs), or vLLM's
``prompt_logprobs``. The continuation's tokens are those ending after the prompt text, found
through ``text_offset``. Next-token information comes only as the top-n log-probs
(``logprobs=n``), so ensembles through an API are *approximate* and labelled so.

Robustness: the API key is read from an environment variable only and never logged; every
request has a timeout; 429 and 5xx answers are retried with exponential backoff; at most
``concurrency`` requests are in flight; malformed or missing log-probs raise :class:`APIError`.
Some servers echo wrong prompt log-probs (llama.cpp's server was measured at about -10 per
token where the model gives -0.3 to -4): :meth:`APIScorer.conformance_check` catches that.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import time
from typing import Sequence

import httpx
import numpy as np

from replug_jax.lm.scorer import SCORE, TOP_LOGPROBS, ContinuationScore, CostMeter

KEY_ENV_VARS = ("REPLUG_API_KEY", "OPENAI_API_KEY")
CONFORMANCE_TEXT = ("One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, "
                    "thirteen, fourteen, fifteen, sixteen, seventeen, eighteen, nineteen, twenty")


class APIError(RuntimeError):
    """The API failed or answered something unusable; the message says which and why."""


class APIScorer:
    """:class:`~replug_jax.lm.scorer.LMScorer` over an OpenAI-compatible HTTP server."""

    capabilities = frozenset({SCORE, TOP_LOGPROBS})

    def __init__(self, base_url: str, *, model: str | None = None, timeout: float = 60.0,
                 max_retries: int = 4, backoff: float = 0.5, concurrency: int = 4,
                 scoring: str = "echo", tokenizer: str | None = None,
                 max_context: int | None = None, transport: httpx.BaseTransport | None = None):
        if scoring not in ("echo", "prompt_logprobs"):
            raise ValueError(f"scoring must be 'echo' or 'prompt_logprobs', got {scoring!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = f"api:{model or self.base_url}"
        self.scoring = scoring
        self.max_retries = max_retries
        self.backoff = backoff
        self.concurrency = concurrency
        self.cost = CostMeter()
        self.max_context = max_context
        self.eos_token = None
        headers = {}
        key = next((os.environ[v] for v in KEY_ENV_VARS if os.environ.get(v)), None)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers,
                                    transport=transport)
        self.timeout = timeout
        self._tokenizer = None
        if tokenizer is not None:
            from replug_jax.models import load_tokenizer

            self._tokenizer = load_tokenizer(tokenizer)

    def __repr__(self) -> str:  # never show headers (the key)
        return f"APIScorer({self.base_url!r}, model={self.model!r})"

    # -- HTTP ----------------------------------------------------------------------------------

    def _post(self, payload: dict) -> dict:
        if self.model:
            payload = {"model": self.model, **payload}
        last = ""
        for attempt in range(self.max_retries + 1):
            t0 = time.perf_counter()
            try:
                resp = self._client.post("/v1/completions", json=payload)
            except httpx.TimeoutException:
                last = f"timed out after {self.timeout:g}s"
            except httpx.TransportError as err:
                last = f"transport error: {type(err).__name__}: {err}"
            else:
                if resp.status_code == 200:
                    try:
                        body = resp.json()
                    except ValueError as err:
                        raise APIError(f"{self.base_url}/v1/completions returned malformed "
                                       f"JSON: {resp.text[:200]!r}") from err
                    self.cost.add(1, 0, 0, time.perf_counter() - t0)
                    return body
                if resp.status_code != 429 and resp.status_code < 500:
                    raise APIError(f"{self.base_url}/v1/completions answered HTTP "
                                   f"{resp.status_code}: {resp.text[:300]}")
                last = f"HTTP {resp.status_code}"
            if attempt < self.max_retries:
                time.sleep(self.backoff * 2**attempt)
        raise APIError(f"{self.base_url}/v1/completions failed after {self.max_retries + 1} "
                       f"attempts (last: {last})")

    def _map(self, fn, items):
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(fn, items))

    @staticmethod
    def _choice(body: dict) -> dict:
        try:
            return body["choices"][0]
        except (KeyError, IndexError, TypeError) as err:
            raise APIError(f"response has no choices: {str(body)[:200]}") from err

    # -- capabilities --------------------------------------------------------------------------

    def _score_one(self, pair: tuple[str, str]) -> ContinuationScore:
        prompt, continuation = pair
        text = prompt + continuation
        if self.scoring == "echo":
            body = self._post({"prompt": text, "max_tokens": 0, "echo": True, "logprobs": 0,
                               "temperature": 0})
            lp = self._choice(body).get("logprobs")
            try:
                tokens, logprobs, offsets = lp["tokens"], lp["token_logprobs"], lp["text_offset"]
            except (KeyError, TypeError) as err:
                raise APIError("response lacks logprobs.tokens/token_logprobs/text_offset; "
                               "the server does not support echo scoring") from err
        else:
            body = self._post({"prompt": text, "max_tokens": 1, "prompt_logprobs": 0,
                               "temperature": 0})
            entries = self._choice(body).get("prompt_logprobs")
            if not isinstance(entries, list):
                raise APIError("response lacks prompt_logprobs; the server is not vLLM-like")
            tokens, logprobs, offsets, pos = [], [], [], 0
            for e in entries:
                if e is None:
                    tokens.append("")
                    logprobs.append(None)
                    offsets.append(0)
                    continue
                (_, info), = list(e.items())[:1]
                tok = info.get("decoded_token", "")
                tokens.append(tok)
                logprobs.append(info.get("logprob"))
                offsets.append(pos)
                pos += len(tok)
        n = len(tokens)
        if not (len(logprobs) == len(offsets) == n) or n == 0:
            raise APIError(f"malformed logprobs: {n} tokens, {len(logprobs)} log-probs, "
                           f"{len(offsets)} offsets")
        ends = list(offsets[1:]) + [len(text)]
        sel = [i for i in range(n) if ends[i] > len(prompt)]
        values = [logprobs[i] for i in sel]
        if any(v is None or not isinstance(v, (int, float)) or not math.isfinite(v)
               or v > 1e-4 for v in values):
            raise APIError(f"malformed log-probs for the continuation: {values[:8]}")
        self.cost.add(0, n - len(sel), len(sel), 0.0)
        return ContinuationScore(np.full(len(sel), -1, np.int64), [tokens[i] for i in sel],
                                 np.array(values, np.float32), n - len(sel))

    def score_continuations(self, prompts: Sequence[str], continuations: Sequence[str]
                            ) -> list[ContinuationScore]:
        return self._map(self._score_one, list(zip(prompts, continuations)))

    def _top_one(self, args: tuple[str, int]) -> dict[str, float]:
        prompt, n = args
        body = self._post({"prompt": prompt, "max_tokens": 1, "logprobs": n, "temperature": 0})
        lp = self._choice(body).get("logprobs")
        try:
            top = lp["top_logprobs"][0]
        except (KeyError, IndexError, TypeError) as err:
            raise APIError("response lacks logprobs.top_logprobs") from err
        if not isinstance(top, dict) or not top:
            raise APIError(f"malformed top_logprobs: {str(top)[:200]}")
        out = {}
        for tok, v in top.items():
            if not isinstance(v, (int, float)) or not math.isfinite(v):
                raise APIError(f"malformed top log-prob for {tok!r}: {v!r}")
            out[tok] = float(v)
        self.cost.add(0, 0, 1, 0.0)
        return out

    def top_logprobs(self, prompts: Sequence[str], n: int) -> list[dict[str, float]]:
        return self._map(self._top_one, [(p, n) for p in prompts])

    # -- tokens (for fitting documents into the context) ---------------------------------------

    def count_tokens(self, text: str) -> int:
        if self._tokenizer is not None:
            return len(self._tokenizer(text, add_special_tokens=False)["input_ids"])
        return math.ceil(len(text) / 4)  # approximation: ~4 characters per token

    def truncate(self, text: str, max_tokens: int) -> str:
        if self._tokenizer is None:
            return text[: max(max_tokens, 0) * 4]
        enc = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if len(enc["input_ids"]) <= max_tokens:
            return text
        return "" if max_tokens <= 0 else text[: enc["offset_mapping"][max_tokens - 1][1]]

    def conformance_check(self, reference: Sequence[float] | None = None,
                          tolerance: float = 0.5) -> dict:
        """Score a known, highly predictable text; refuse a server whose echo scores are off.

        Without a ``reference`` (per-token log-probs from a trusted in-process run) the check
        requires the counting sequence's mean log-prob to exceed -2.5 nats: any competent LM
        predicts it, while a server with broken echo scoring gives about -10.
        """
        prompt, cont = CONFORMANCE_TEXT.split(", five")
        score = self._score_one((prompt, ", five" + cont))
        mean = float(score.logprobs.mean())
        if reference is not None:
            ref = np.asarray(reference, np.float32)
            if ref.shape != score.logprobs.shape or np.abs(ref - score.logprobs).max() > tolerance:
                raise APIError(f"API echo scores disagree with the reference by more than "
                               f"{tolerance} nats; do not use this server for scoring")
        elif mean < -2.5:
            raise APIError(f"API echo scoring looks broken: mean log-prob {mean:.2f} on a "
                           "counting sequence any LM predicts; do not use it for scoring")
        return {"mean_logprob": mean, "tokens": len(score.logprobs)}

    def close(self) -> None:
        self._client.close()
