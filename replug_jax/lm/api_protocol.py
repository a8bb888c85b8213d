"""What OpenAI-compatible servers say, read strictly: the typed errors of the client, the two
log-prob shapes (legacy completions and per-token ``content[]``, plus vLLM's
``prompt_logprobs``) parsed into :class:`TokenLogprobs`, and :class:`ServerCapabilities`, what
a probe found, and failures put in words. No I/O here; :mod:`replug_jax.lm.api_scorer`
talks to the server."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from replug_jax.lm.scorer import CapabilityError

CONFORMANCE_TEXT = ("One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve, "
                    "thirteen, fourteen, fifteen, sixteen, seventeen, eighteen, nineteen, twenty")
CONFORMANCE_MIN_MEAN = -2.5  # nats per token: any competent LM predicts the counting sequence


class APIError(RuntimeError):
    """The API failed or answered something unusable; the message is one line saying what
    and why (never the API key)."""


class APIConnectionError(APIError):
    """Nothing answered: connection refused, unknown host, network down."""


class APITimeoutError(APIError):
    """The server did not answer within the timeout, on every attempt."""


class APIAuthError(APIError):
    """401 or 403: a missing or wrong API key."""


class APINotFoundError(APIError):
    """404: a wrong base URL, endpoint or model name."""


class APIRateLimitError(APIError):
    """429 on every attempt."""


class APIServerError(APIError):
    """Another HTTP error (4xx refusals, 5xx after retries)."""


class APIRefusedError(APIServerError):
    """A 4xx refusal of this request (e.g. a parameter the server does not take): the
    server works, but not for what was asked."""


class APIResponseError(APIError):
    """A 200 answer that is not usable: malformed JSON, missing or malformed log-probs."""


class APIProtocolError(APIResponseError):
    """A 200 answer that is not an OpenAI-style response at all (not JSON, no choices)."""


class APICapabilityError(APIError, CapabilityError):
    """The server cannot do what was asked (e.g. scoring without prompt log-probs)."""


# -- the two log-prob shapes ------------------------------------------------------------------

@dataclasses.dataclass
class TokenLogprobs:
    """Per-token log-probs of a stretch of text, whichever shape the server sent."""

    tokens: list[str]
    logprobs: list[float | None]  # None: nothing predicts it (a first token)
    offsets: list[int] | None  # character offset of each token, as the server stated them
    top: list[dict[str, float] | None]  # the top-n alternatives at each position, if asked
    raw: list[bytes] | None = None  # each token's own bytes, when the server gave them

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Each token's ``[start, end)`` characters in ``text``, after checking that the
        tokens are ``text`` (a leading token without a log-prob, such as an echoed BOS, may
        add text of its own) and that the stated offsets are where the tokens are. A token
        holding part of a multi-byte character spans that whole character. Refuses in one
        line what it cannot trust: offsets counted in bytes, all-zero offsets, tokens that
        are not the text."""
        pieces = self.raw if self.raw is not None else [t.encode("utf-8") for t in self.tokens]
        joined, want = b"".join(pieces), text.encode("utf-8")
        lead = len(joined) - len(want)
        lead_ok = lead == 0 or (lead > 0 and joined.endswith(want) and self.logprobs
                                and self.logprobs[0] is None and len(pieces[0]) >= lead)
        if not lead_ok:
            raise APIResponseError(
                f"the server's tokens are not the text it was sent ({_show(joined)} for "
                f"{_show(want)}); its log-probs cannot be assigned to the text")
        char_of = _char_index(want)
        spans, pos = [], -lead
        for piece in pieces:
            lo, hi = max(pos, 0), max(pos + len(piece), 0)
            pos += len(piece)
            if hi == lo:  # nothing of the text (a BOS), or an empty token
                at = char_of[lo] if lo < len(want) else len(text)
                spans.append((at, at))
            else:
                spans.append((char_of[lo], char_of[hi - 1] + 1))
        if self.offsets is not None:
            starts = [s for s, _ in spans][1 if lead else 0:]
            # With a leading BOS, servers count offsets with or without its text.
            shifts = (len(self.tokens[0]), 0) if lead else (0,)
            stated = [o - shifts[0] for o in self.offsets][1 if lead else 0:]
            if all([o - s for o in self.offsets][1 if lead else 0:] != starts for s in shifts):
                bad = next(i for i, (a, b) in enumerate(zip(stated, starts)) if a != b)
                bad += 1 if lead else 0
                raise APIResponseError(
                    f"the server's text_offset does not match its tokens (token {bad}: offset "
                    f"{self.offsets[bad]} where the token starts at character "
                    f"{spans[bad][0]}; "
                    "offsets in bytes, or not given?)")
        return spans


    def check_boundary(self, continuation: str) -> None:
        """Without each token's bytes, a continuation that begins with a multi-byte
        character cannot be told apart from the prompt: a token ending at the boundary may
        hold its first bytes. Refused in one line."""
        if self.raw is None and continuation[:1] and not continuation[0].isascii():
            raise APICapabilityError(
                f"the continuation {continuation[:12]!r} begins with a multi-byte character and "
                "this server's log-probs do not give each token's bytes, so a token ending at "
                "the prompt may hold part of it: start the continuation with an ASCII "
                "character (e.g. a space), or use a server that gives token bytes")

    def complete_first_bytes(self, text: str) -> None:
        """A first token given without its text (prompt_logprobs): its bytes are what the
        other tokens' bytes leave of ``text``."""
        if self.raw is not None and self.logprobs and self.logprobs[0] is None:
            rest, whole = b"".join(self.raw[1:]), text.encode("utf-8")
            self.raw[0] = whole[:len(whole) - len(rest)] if whole.endswith(rest) \
                else self.tokens[0].encode("utf-8")


def _show(raw: bytes, n: int = 60) -> str:
    text = raw.decode("utf-8", errors="replace")
    return repr(text if len(text) <= n else text[:n] + "…")


def _char_index(raw: bytes) -> list[int]:
    """For each byte of UTF-8 ``raw``, the index of the character it belongs to."""
    out, char = [], -1
    for b in raw:
        if b & 0xC0 != 0x80:  # not a continuation byte: a new character starts
            char += 1
        out.append(char)
    return out


def _finite_logprob(value, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not math.isfinite(value) or value > 1e-4:
        raise APIResponseError(f"malformed log-probs: {where} is {value!r}, not a finite "
                               "log-probability")
    return float(value)


def _token_bytes(entry: dict) -> bytes | None:
    raw = entry.get("bytes")
    if isinstance(raw, list) and raw and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
        return bytes(raw)
    return None


def _token_text(entry) -> str:
    """A ``content[]`` entry's text: its bytes when given (exact, even for a token that is
    part of a multi-byte character), else its ``token`` string."""
    if not isinstance(entry, dict):
        raise APIResponseError(f"malformed log-probs: a token entry is {str(entry)[:120]}, "
                               "not an object")
    raw = _token_bytes(entry)
    if raw is not None:
        return raw.decode("utf-8", errors="replace")
    token = entry.get("token")
    if not isinstance(token, str):
        raise APIResponseError(f"malformed log-probs: a token entry has no text: "
                               f"{str(entry)[:120]}")
    return token


def _merge_top(pairs) -> dict[str, float]:
    """Top alternatives as ``{text: log-prob}``; two token ids with the same text (possible
    in byte-level vocabularies) add their probabilities."""
    out: dict[str, float] = {}
    for text, lp in pairs:
        out[text] = float(np.logaddexp(out[text], lp)) if text in out else lp
    return out


def parse_logprobs(block, start: int = 0) -> TokenLogprobs:
    """A choice's ``logprobs`` in either shape (legacy completions or ``content[]``);
    ``start`` is the character offset of the first token when the shape gives none."""
    if not isinstance(block, dict):
        raise APIResponseError(f"response has no log-probs (logprobs is {block!r})")
    if "content" in block:
        entries = block["content"]
        if not isinstance(entries, list):
            raise APIResponseError(f"malformed log-probs: content is {str(entries)[:120]}")
        tokens, logprobs, offsets, top, pieces = [], [], [], [], []
        for i, e in enumerate(entries):
            if not isinstance(e, dict):
                raise APIResponseError(f"malformed log-probs: content[{i}] is {e!r}")
            tokens.append(_token_text(e))
            pieces.append(_token_bytes(e))
            logprobs.append(_finite_logprob(e.get("logprob"), f"content[{i}].logprob"))
            alts = e.get("top_logprobs")
            top.append(None if alts is None else _merge_top(
                (_token_text(a), _finite_logprob(a.get("logprob"),
                                                 f"content[{i}].top_logprobs"))
                for a in alts) if isinstance(alts, list) else _bad_top(alts))
        raw = pieces if all(p is not None for p in pieces) else None
        if raw is not None:  # decoded as one text: a character split over tokens stays whole
            tokens = _split_decoded(raw)
        pos = start
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return TokenLogprobs(tokens, logprobs, offsets, top, raw)
    try:
        tokens, values = list(block["tokens"]), list(block["token_logprobs"])
    except (KeyError, TypeError) as err:
        raise APIResponseError("response lacks log-probs (neither logprobs.content nor "
                               "logprobs.tokens/token_logprobs)") from err
    for i, t in enumerate(tokens):
        if not isinstance(t, str):
            raise APIResponseError(f"malformed log-probs: tokens[{i}] is {t!r}, not a string")
    offsets = block.get("text_offset")
    if offsets is not None and (not isinstance(offsets, list) or not all(
            isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise APIResponseError(f"malformed log-probs: text_offset is {str(offsets)[:120]}")
    raw_top = block.get("top_logprobs") or [None] * len(tokens)
    if not isinstance(raw_top, list):
        _bad_top(raw_top)
    if not (len(values) == len(raw_top) == len(tokens)) or \
            (offsets is not None and len(offsets) != len(tokens)):
        raise APIResponseError(f"malformed log-probs: {len(tokens)} tokens, {len(values)} "
                               f"log-probs, {len(offsets or tokens)} offsets, {len(raw_top)} "
                               "top entries")
    logprobs = [None if v is None else _finite_logprob(v, f"token_logprobs[{i}]")
                for i, v in enumerate(values)]
    top = [None if t is None else _merge_top(
        (tok, _finite_logprob(v, f"top_logprobs[{i}][{tok!r}]")) for tok, v in t.items())
        if isinstance(t, dict) else _bad_top(t) for i, t in enumerate(raw_top)]
    # `replug serve`'s extension: each token's bytes (where a partial character belongs)
    raw = [_token_bytes({"bytes": b}) if b != [] else b"" for b in block["token_bytes"]] \
        if isinstance(block.get("token_bytes"), list) and \
        len(block["token_bytes"]) == len(tokens) else None
    return TokenLogprobs(tokens, logprobs, offsets, top,
                         raw if raw is not None and None not in raw else None)


def _split_decoded(pieces: list[bytes]) -> list[str]:
    """The text of joined token bytes, cut so that each character goes to the token holding
    its last byte (a token holding only the first bytes of a character gets ``""``)."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = [decoder.decode(p) for p in pieces]
    out[-1] += decoder.decode(b"", final=True) if out else ""
    return out


def _bad_top(value):
    raise APIResponseError(f"malformed top log-probs: {str(value)[:120]}")


def parse_prompt_logprobs(entries) -> TokenLogprobs:
    """vLLM's ``prompt_logprobs``: one ``{token_id: {"logprob", "decoded_token"}}`` per prompt
    token (None for the first)."""
    if not isinstance(entries, list):
        raise APIResponseError("response lacks prompt_logprobs")
    tokens, logprobs, offsets, pieces, pos = [], [], [], [], 0
    for i, e in enumerate(entries):
        if e is None:
            tokens.append("")
            logprobs.append(None)
            pieces.append(None)
        else:
            try:
                (_, info), = list(e.items())[:1]  # the prompt's own token comes first
                tok = info.get("decoded_token", "")
                pieces.append(_token_bytes(info) if info.get("bytes") != [] else b"")
            except (AttributeError, ValueError, TypeError) as err:
                raise APIResponseError(f"malformed prompt_logprobs[{i}]: {str(e)[:120]}") \
                    from err
            if not isinstance(tok, str):
                raise APIResponseError(f"malformed prompt_logprobs[{i}]: decoded_token is "
                                       f"{tok!r}")
            tokens.append(tok)
            logprobs.append(_finite_logprob(info.get("logprob"), f"prompt_logprobs[{i}]"))
        offsets.append(pos)
        pos += len(tokens[-1])
    known = pieces[1:] if pieces and pieces[0] is None else pieces
    raw = None
    if known and all(p is not None for p in known):  # every token's bytes: exact spans
        raw = ([tokens[0].encode("utf-8")] if len(known) < len(pieces) else []) + known
    return TokenLogprobs(tokens, logprobs, offsets, [None] * len(tokens), raw)


# -- what a server can do ----------------------------------------------------------------------

@dataclasses.dataclass
class ServerCapabilities:
    """What :meth:`APIScorer.probe` found, and the paths it implies."""

    base_url: str
    endpoint: str
    echo: bool = False
    prompt_logprobs: bool = False
    top_n: int = 0  # the largest n of top log-probs the server honoured (0: none)
    logprob_shape: str | None = None  # "legacy" or "content"
    conformance: dict | None = None  # {"mean_logprob", "tokens", "passed"} of the scoring path
    cached_prompt_tokens: bool = False  # the server reports reusing cached prompt tokens
    prompt_lists: bool = False  # scores a list of prompts in one request (vLLM, replug serve)
    notes: list[str] = dataclasses.field(default_factory=list)

    @property
    def scoring(self) -> str | None:
        """The path that scores supplied text, if one exists and passed conformance."""
        if self.conformance is None or not self.conformance.get("passed"):
            return None
        return "echo" if self.echo else "prompt_logprobs" if self.prompt_logprobs else None

    def refusal(self, what: str = "scoring") -> str:
        """One line: why ``what`` cannot run on this server, and what still works."""
        if self.echo or self.prompt_logprobs:
            why = (f"its prompt log-probs fail the conformance check (mean "
                   f"{self.conformance['mean_logprob']:.2f} nats/token on a counting sequence, "
                   f"need > {CONFORMANCE_MIN_MEAN})" if self.conformance else
                   "its prompt log-probs could not be checked")
        else:
            why = "it gives no prompt log-probs"
        rest = (f"generation works as an approximate ensemble from top-{self.top_n} log-probs"
                if self.top_n else "it gives no top log-probs either, so REPLUG cannot run "
                "on it at all")
        return (f"{self.base_url}: {what} cannot run: {why}; scoring (LSR supervision, "
                f"perplexity, answer likelihood) needs echo or prompt_logprobs; {rest}")

    def table(self) -> list[tuple[str, str, str]]:
        conf = self.conformance
        return [
            ("endpoint", f"/v1/{'chat/' if self.endpoint == 'chat' else ''}completions",
             "chat: the prompt as one user turn" if self.endpoint == "chat" else "raw prompt"),
            ("echo of prompt log-probs", _yes(self.echo), "echo=true on /v1/completions"),
            ("prompt_logprobs (vLLM)", _yes(self.prompt_logprobs), ""),
            ("top-n of generated tokens", f"n ≤ {self.top_n}" if self.top_n else "no",
             f"{self.logprob_shape} log-prob shape" if self.logprob_shape else ""),
            ("conformance of scores",
             "—" if conf is None else "pass" if conf["passed"] else "FAIL",
             "" if conf is None else f"mean {conf['mean_logprob']:.2f} nats/token over "
                                     f"{conf['tokens']} tokens"),
            ("prompt cache reported", _yes(self.cached_prompt_tokens),
             "usage.prompt_tokens_details.cached_tokens"),
            ("prompt lists per request", _yes(self.prompt_lists),
             "prompt: [...] (vLLM, replug serve): many pairs per scoring request"),
            ("scoring (LSR, perplexity)", self.scoring or "no", ""),
            ("REPLUG generation", "approximate (top-n)" if self.top_n else "no",
             "exact needs full next-token distributions (replug serve in-process)"),
        ]

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "scoring": self.scoring}


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def snippet(text: str, n: int = 160) -> str:
    """A one-line excerpt of a server's answer."""
    flat = " ".join(str(text).split())
    return repr(flat[:n] + ("…" if len(flat) > n else ""))


def error_text(resp) -> str:
    """An ``httpx`` response's error message: the server's own (OpenAI's
    ``{"error": {"message"}}``) or the body."""
    try:
        body = resp.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else \
            body.get("error") or body.get("detail") or body
    except (ValueError, AttributeError, KeyError, TypeError):
        message = resp.text
    return snippet(str(message))


def transport_reason(err) -> str:
    """Why a request never got an answer, in words (DNS, refused, reset)."""
    text = str(err) or type(err).__name__
    lowered = text.lower()
    if "name or service not known" in lowered or "nodename nor servname" in lowered or \
            "temporary failure in name resolution" in lowered or "getaddrinfo" in lowered:
        return f"unknown host (DNS: {text})"
    if "refused" in lowered:
        return "connection refused: is the server running on that host and port?"
    return f"{type(err).__name__}: {text}"
