"""An OpenAI-compatible HTTP server as the frozen black-box LM (``httpx``).

Servers differ in what they expose, so a client first *probes* (:meth:`APIScorer.probe`,
``replug api check``):

* **echo** — ``/v1/completions`` with ``echo=true`` returns the prompt's per-token log-probs
  (legacy OpenAI models, llama-cpp-python, ``replug serve``): scoring supplied text;
* **prompt_logprobs** — vLLM's field: scoring supplied text;
* **top-n** — the n most likely next tokens of generated text (every server, n ≤ 20 for
  OpenAI chat models, ≤ 5 for legacy completions): an *approximate* ensemble only;
* **conformance** — scores of a counting sequence any LM predicts (a server with broken echo
  scoring gives about -10 nats per token).

Log-probs come in two shapes, both read everywhere: the legacy completions one
(``tokens``, ``token_logprobs``, ``top_logprobs`` as a list of dicts, ``text_offset``) and the
per-token ``content[]`` one (chat completions, llama.cpp's ``/v1/completions``:
``content[i] = {"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}``). ``endpoint="chat"`` sends the prompt as one user turn to
``/v1/chat/completions`` (the server applies its chat template) and generated text as a final
assistant message for the server to continue (llama.cpp does; servers that cannot continue an
assistant message can only generate their first token that way).

Failures are typed :class:`APIError` subclasses with one-line messages (connection refused,
DNS, timeouts, 401/403 with the key never shown, 404, 429 after retries, malformed JSON or
log-probs); 429 and 5xx answers are retried with exponential backoff; at most
``concurrency`` requests are in flight. The errors, the parsing of both shapes and what a probe
finds live in :mod:`replug_jax.lm.api_protocol` (no I/O).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import time
from typing import Sequence

import httpx
import numpy as np

from replug_jax.lm.api_protocol import (  # noqa: F401 (the client's public names)
    CONFORMANCE_MIN_MEAN,
    CONFORMANCE_TEXT,
    APIAuthError,
    APICapabilityError,
    APIConnectionError,
    APIError,
    APINotFoundError,
    APIProtocolError,
    APIRateLimitError,
    APIRefusedError,
    APIResponseError,
    APIServerError,
    APITimeoutError,
    ServerCapabilities,
    TokenLogprobs,
    error_text,
    parse_logprobs,
    parse_prompt_logprobs,
    snippet,
    transport_reason,
)
from replug_jax.lm.scorer import SCORE, TOP_LOGPROBS, ContinuationScore, CostMeter

KEY_ENV_VARS = ("REPLUG_API_KEY", "OPENAI_API_KEY")
ENDPOINTS = ("completions", "chat")
SCORING = ("auto", "echo", "prompt_logprobs")
PROBE_PROMPT = "The capital of Germany is"


class APIScorer:
    """:class:`~replug_jax.lm.scorer.LMScorer` over an OpenAI-compatible HTTP server.

    Construct it with :meth:`connect` (probes the server and picks the scoring path) or
    directly (then ``scoring`` is trusted as given until :meth:`probe` runs).
    """

    def __init__(self, base_url: str, *, model: str | None = None,
                 endpoint: str = "completions", timeout: float = 60.0, max_retries: int = 4,
                 backoff: float = 0.5, concurrency: int = 4, scoring: str = "echo",
                 tokenizer: str | None = None, max_context: int | None = None,
                 batch_size: int = 16, transport: httpx.BaseTransport | None = None):
        if scoring not in SCORING:
            raise ValueError(f"scoring must be one of {SCORING}, got {scoring!r}")
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.endpoint = endpoint
        self.name = f"api:{model or self.base_url}"
        self.scoring = scoring
        self.max_retries = max_retries
        self.backoff = backoff
        self.concurrency = concurrency
        # prompts per scoring request, once a probe found that the server takes a list
        # (`prompt: [...]`, as vLLM and `replug serve` do); one per request until then
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.batch_size = batch_size
        self.cost = CostMeter()
        self.cached_tokens = 0  # prompt tokens the server says it reused from its cache
        self.max_context = max_context
        self.eos_token = None
        self.server: ServerCapabilities | None = None
        self.capabilities = frozenset({SCORE, TOP_LOGPROBS} if endpoint == "completions"
                                      else {TOP_LOGPROBS})
        headers = {}
        key = next((os.environ[v] for v in KEY_ENV_VARS if os.environ.get(v)), None)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self._key = key  # only to redact it from anything a server echoes back
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout, headers=headers,
                                    transport=transport)
        self.timeout = timeout
        self._tokenizer = None
        if tokenizer is not None:
            from replug_jax.models import load_tokenizer

            self._tokenizer = load_tokenizer(tokenizer)

    @property
    def tokenizer(self):
        """The served model's tokenizer (``tokenizer=``, ``--api-tokenizer``), or None: with
        it, ``eval``, ``fit-tau`` and ``ask`` give a served chat LM its own chat layout and
        cut texts into windows as the model counts tokens."""
        return self._tokenizer

    @classmethod
    def connect(cls, base_url: str, **kwargs) -> "APIScorer":
        """An :class:`APIScorer` whose capabilities come from :meth:`probe`."""
        scorer = cls(base_url, **{"scoring": "auto", **kwargs})
        scorer.probe()
        return scorer

    def __repr__(self) -> str:  # never show headers (the key)
        return f"APIScorer({self.base_url!r}, model={self.model!r}, endpoint={self.endpoint!r})"

    # -- HTTP ----------------------------------------------------------------------------------

    def _post(self, payload: dict, route: str | None = None) -> dict:
        """POST with retries; every failure is an :class:`APIError` whose message never
        holds the API key (a server may echo it back)."""
        try:
            return self._post_unredacted(payload, route)
        except APIError as err:
            message = str(err)
            if self._key:
                message = message.replace(self._key, "***")
            raise type(err)(message) from None

    def _post_unredacted(self, payload: dict, route: str | None) -> dict:
        route = route or ("/v1/chat/completions" if self.endpoint == "chat"
                          else "/v1/completions")
        if self.model:
            payload = {"model": self.model, **payload}
        where = f"{self.base_url}{route}"
        last, kind = "", APIServerError
        attempts = self.max_retries + 1
        for attempt in range(attempts):
            t0 = time.perf_counter()
            try:
                resp = self._client.post(route, json=payload)
            except httpx.TimeoutException:
                last, kind = f"timed out after {self.timeout:g}s", APITimeoutError
            except httpx.TransportError as err:
                last, kind = transport_reason(err), APIConnectionError
            else:
                if resp.status_code == 200:
                    try:
                        body = resp.json()
                    except ValueError:
                        raise APIProtocolError(f"{where} returned malformed JSON: "
                                               f"{snippet(resp.text)}") from None
                    if not isinstance(body, dict):
                        raise APIProtocolError(f"{where} returned {snippet(resp.text)}, not "
                                               "a JSON object")
                    self._account(body, time.perf_counter() - t0)
                    return body
                status = resp.status_code
                if status in (401, 403):
                    raise APIAuthError(f"{where} answered HTTP {status}: the API key is "
                                       f"missing or wrong (set ${KEY_ENV_VARS[0]} or "
                                       f"${KEY_ENV_VARS[1]}): {error_text(resp)}")
                if status == 404:
                    raise APINotFoundError(f"{where} answered HTTP 404 (wrong --api-base, "
                                           f"endpoint or model {self.model!r}?): "
                                           f"{error_text(resp)}")
                if status != 429 and status < 500:
                    raise APIRefusedError(f"{where} answered HTTP {status}: "
                                          f"{error_text(resp)}")
                last = f"HTTP {status}: {error_text(resp)}"
                kind = APIRateLimitError if status == 429 else APIServerError
            if attempt < attempts - 1:
                time.sleep(self.backoff * 2**attempt)
        raise kind(f"{where} failed after {attempts} attempt{'s' * (attempts > 1)} "
                   f"(last: {last})")

    def _account(self, body: dict, seconds: float) -> None:
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        cached = cached if isinstance(cached, int) and cached > 0 else 0
        prompt_tokens = usage.get("prompt_tokens")
        self.cached_tokens += cached
        self.cost.add(1, prompt_tokens if isinstance(prompt_tokens, int) else 0, 0, seconds,
                      cached=cached)

    def _map(self, fn, items):
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(fn, items))

    @staticmethod
    def _choice(body: dict) -> dict:
        try:
            choice = body["choices"][0]
        except (KeyError, IndexError, TypeError):
            raise APIProtocolError(f"response has no choices: {snippet(str(body))}") \
                from None
        if not isinstance(choice, dict):
            raise APIProtocolError(f"malformed choice: {snippet(str(choice))}")
        return choice

    def _request(self, prompt: str, *, generated: str = "", max_tokens: int = 1,
                 top_n: int = 0) -> dict:
        """The body of one request in this scorer's endpoint."""
        if self.endpoint == "chat":
            messages = [{"role": "user", "content": prompt}]
            if generated:  # the server continues a final assistant message
                messages.append({"role": "assistant", "content": generated})
            body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
            if top_n:
                body.update(logprobs=True, top_logprobs=top_n)
            return body
        body = {"prompt": prompt + generated, "max_tokens": max_tokens, "temperature": 0}
        if top_n:
            body["logprobs"] = top_n
        return body

    # -- the probe -----------------------------------------------------------------------------

    def probe(self, top_n: int = 20) -> ServerCapabilities:
        """Find what the server can do (see the module docstring), set :attr:`capabilities`
        and the scoring path from it, and return it. Costs a handful of short requests."""
        caps = ServerCapabilities(self.base_url, self.endpoint)
        for n in dict.fromkeys((top_n, 5, 1)):  # the largest n honoured, within top_n
            try:
                choice = self._choice(self._post(self._request(PROBE_PROMPT, top_n=n)))
                block = parse_logprobs(choice.get("logprobs"))
            except (APIRefusedError, APIResponseError) as err:
                if isinstance(err, APIProtocolError):
                    raise
                caps.notes.append(f"top-{n}: {err}")
                continue
            if block.top and block.top[0]:
                caps.top_n = min(n, len(block.top[0]))
                caps.logprob_shape = "content" if "content" in choice["logprobs"] else "legacy"
                break
        caps.cached_prompt_tokens = self.cached_tokens > 0
        if self.endpoint == "completions":
            prompt, cont = CONFORMANCE_TEXT.split(", five")
            for path in ("echo", "prompt_logprobs"):
                if self.scoring not in ("auto", path):
                    continue
                try:
                    score = self._score_one((prompt, ", five" + cont), path)
                except (APIRefusedError, APIResponseError) as err:
                    if isinstance(err, APIProtocolError):
                        raise
                    caps.notes.append(f"{path}: {err}")
                    continue
                setattr(caps, path, True)
                mean = float(score.logprobs.mean())
                caps.conformance = {"mean_logprob": mean, "tokens": len(score.logprobs),
                                    "passed": mean > CONFORMANCE_MIN_MEAN}
                caps.prompt_lists = self._takes_lists((prompt, ", five" + cont), score, path)
                break
        else:
            caps.notes.append("chat endpoints never return prompt log-probs")
        self.server = caps
        self.scoring = caps.scoring or "none"
        self.capabilities = frozenset(({SCORE} if caps.scoring else set())
                                      | ({TOP_LOGPROBS} if caps.top_n else set()))
        return caps

    def missing(self, capability: str, what: str) -> str | None:
        """A one-line reason why ``capability`` is absent (after :meth:`probe`)."""
        if self.server is None:
            return None
        if capability == SCORE:
            return self.server.refusal(what)
        return f"{self.base_url}: {what} needs {capability!r}; " + self.server.refusal(what)

    # -- capabilities --------------------------------------------------------------------------

    def _takes_lists(self, pair: tuple[str, str], alone: ContinuationScore, path: str) -> bool:
        """Whether the server scores a list of prompts in one request, each as it scores it
        alone (two prompts, the second the conformance text: its choice must come back at
        index 1 with the same log-probs)."""
        try:
            first, second = self._score_batch([("One, two", ", three"), pair], path)
        except (APIRefusedError, APIResponseError) as err:
            if isinstance(err, APIProtocolError):
                raise
            return False
        return (len(second.logprobs) == len(alone.logprobs)
                and bool(np.allclose(second.logprobs, alone.logprobs, atol=1e-3)))

    def _score_one(self, pair: tuple[str, str], path: str | None = None) -> ContinuationScore:
        return self._score_batch([pair], path)[0]

    def _score_batch(self, pairs: Sequence[tuple[str, str]], path: str | None = None
                     ) -> list[ContinuationScore]:
        """Each pair scored, all of them in one request (``prompt`` a list when several)."""
        texts = [p + c for p, c in pairs]
        path = path or self.scoring
        prompt = texts[0] if len(texts) == 1 else texts
        if path == "echo":
            body = self._post({"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0,
                               "temperature": 0}, route="/v1/completions")
        elif path == "prompt_logprobs":
            body = self._post({"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0,
                               "temperature": 0}, route="/v1/completions")
        else:
            raise APICapabilityError(self.server.refusal("scoring") if self.server else
                                     f"{self.base_url}: no scoring path (scoring={path!r})")
        choices = self._choices(body, len(texts))
        return [self._parse_score(pair, choice, path) for pair, choice in zip(pairs, choices)]

    def _choices(self, body: dict, n: int) -> list[dict]:
        """The ``n`` choices of a response, in prompt order (by their ``index``)."""
        if n == 1:
            return [self._choice(body)]
        choices = body.get("choices") if isinstance(body, dict) else None
        if not isinstance(choices, list) or len(choices) != n or not all(
                isinstance(c, dict) for c in choices):
            raise APIResponseError(f"{n} prompts in one request gave "
                                   f"{len(choices) if isinstance(choices, list) else 'no'} "
                                   "choices: the server does not score prompt lists")
        order = sorted(range(n), key=lambda i: choices[i].get("index", i))
        if sorted(choices[i].get("index", i) for i in order) != list(range(n)):
            raise APIResponseError("choices of a prompt list do not carry the indices 0..n-1")
        return [choices[i] for i in order]

    def _parse_score(self, pair: tuple[str, str], choice: dict, path: str
                     ) -> ContinuationScore:
        prompt, continuation = pair
        text = prompt + continuation
        if path == "echo":
            try:
                block = parse_logprobs(choice.get("logprobs"))
            except APIResponseError as err:
                raise APIResponseError(f"{err}; the server does not support echo scoring") \
                    from None
        else:
            block = parse_prompt_logprobs(choice.get("prompt_logprobs"))
            missing = len(text) - len("".join(block.tokens))
            if block.tokens and block.logprobs[0] is None and missing > 0 and \
                    text.endswith("".join(block.tokens[1:])):
                # the first token (no log-prob) may come without its text: it is what the
                # others leave of the text
                block.tokens[0] = text[:len(text) - len("".join(block.tokens[1:]))]
                block.offsets = [0] + [o + missing for o in block.offsets[1:]]
            block.complete_first_bytes(text)
        tokens, logprobs = block.tokens, block.logprobs
        n = len(tokens)
        if n == 0:
            raise APIResponseError("the server echoed no tokens; it does not support echo "
                                   "scoring")
        # The tokens must be the text and the offsets where they are (else refused in one
        # line); a token ending after the prompt, even one straddling it, is continuation.
        block.check_boundary(continuation)
        sel = [i for i, (_, end) in enumerate(block.spans(text)) if end > len(prompt)]
        values = [logprobs[i] for i in sel]
        if any(v is None for v in values):
            raise APIResponseError(f"malformed log-probs: the continuation has tokens without "
                                   f"a log-prob: {values[:8]}")
        self.cost.add(0, 0, len(sel), 0.0)
        return ContinuationScore(np.full(len(sel), -1, np.int64), [tokens[i] for i in sel],
                                 np.array(values, np.float32), n - len(sel))

    def score_continuations(self, prompts: Sequence[str], continuations: Sequence[str]
                            ) -> list[ContinuationScore]:
        """Every pair scored, ``batch_size`` prompts per request when the probe found the
        server takes lists (one per request otherwise), ``concurrency`` requests in flight."""
        pairs = list(zip(prompts, continuations))
        per = self.batch_size if self.server is not None and self.server.prompt_lists else 1
        batches = [pairs[i:i + per] for i in range(0, len(pairs), per)]
        return [score for batch in self._map(self._score_batch, batches) for score in batch]

    def _top_one(self, args: tuple[str, str, int]) -> dict[str, float]:
        prompt, generated, n = args
        choice = self._choice(self._post(self._request(prompt, generated=generated, top_n=n)))
        block = parse_logprobs(choice.get("logprobs"), start=len(prompt + generated))
        if not block.tokens:  # the server ended before any token: the end of text is certain
            if choice.get("finish_reason") == "stop":
                return {"": 0.0}
            raise APIResponseError(f"response has no generated token: {snippet(str(choice))}")
        top = block.top[0]
        if not top:
            raise APIResponseError("response lacks top log-probs of the generated token")
        self.cost.add(0, 0, 1, 0.0)
        return top

    def top_logprobs(self, prompts: Sequence[str], n: int, generated: str = ""
                     ) -> list[dict[str, float]]:
        """The ``n`` most likely next tokens after each ``prompt + generated`` (with the chat
        endpoint, ``generated`` is the assistant's text so far); the end of text is ``""``."""
        if self.server is not None and self.server.top_n:
            n = min(n, self.server.top_n)
        return self._map(self._top_one, [(p, generated, n) for p in prompts])

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
        """Score a known, highly predictable text; refuse a server whose scores are off.

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
                raise APIResponseError(f"API scores disagree with the reference by more than "
                                       f"{tolerance} nats; do not use this server for scoring")
        elif mean < CONFORMANCE_MIN_MEAN:
            raise APIResponseError(f"API scoring looks broken: mean log-prob {mean:.2f} on a "
                                   "counting sequence any LM predicts; do not use it for "
                                   "scoring")
        return {"mean_logprob": mean, "tokens": len(score.logprobs)}

    def close(self) -> None:
        self._client.close()

