"""Coordinated REPLUG decoding (§3.2) through a scorer that exposes next-token distributions
or only top-n log-probs (a served LM): one call per branch per step. With top-n alone the
ensemble is approximate, and the note it returns says by how much at most.
"""

from __future__ import annotations

import jax
import numpy as np

from replug_jax.core.ensemble import mixture_logprobs, top_n_mixture_bounds
from replug_jax.core.sampling import choose_token
from replug_jax.lm.scorer import NEXT_TOKEN, TOP_LOGPROBS, require, stop_position


def generate_stepwise(lm, groups, top_n: int, max_new_tokens: int, sampling_temperature: float,
                      top_p: float, stop, seed: int):
    """Coordinated decoding through an API: one call per branch per token (the K calls of a
    step run concurrently; a server with a prompt cache, such as llama.cpp's, re-reads only
    the new tokens of each branch). ``groups`` have ``prompts`` (the K branches) and
    ``log_weights`` ``[K]``; returns ``([(text, tokens, mixture log-probs, [K, T] branch
    log-probs, stopped_by)], approximation note or None)``."""
    exact = NEXT_TOKEN in lm.capabilities
    if not exact and TOP_LOGPROBS not in lm.capabilities:
        require(lm, TOP_LOGPROBS, "REPLUG generation (the LM exposes neither "
                "next-token distributions nor top log-probs: only retrieve-and-prompt, "
                "which is not REPLUG)")
    server = getattr(lm, "server", None)
    if server is not None and server.top_n:  # never more than the server honours
        top_n = min(top_n, server.top_n)
    rng = jax.random.PRNGKey(seed)
    outs, widest = [], 0.0
    for g in groups:
        text, toks, mix_lps, branch_lps, stopped = "", [], [], [], "length"
        for _ in range(max_new_tokens):
            rng, sub = jax.random.split(rng)
            if exact:
                lp_KV = lm.next_token_logprobs([p + text for p in g.prompts])
                vocab = None
                mix_V = np.asarray(mixture_logprobs(lp_KV[None], g.log_weights[None]))[0]
            else:
                tops = lm.top_logprobs(g.prompts, top_n, generated=text)
                vocab = sorted(set().union(*[t.keys() for t in tops]))
                lp_KV = np.array([[t.get(v, -np.inf) for v in vocab] for t in tops],
                                 np.float32)
                lower_V, upper_V = (np.asarray(x) for x in top_n_mixture_bounds(
                    lp_KV, g.log_weights, distinct=False))  # keyed by text
                mix_V = lower_V
            tok = int(choose_token(mix_V[None], sub, sampling_temperature, top_p)[0])
            if vocab is not None:
                widest = max(widest, float(upper_V[tok] - lower_V[tok]))
            piece = (lm.tokenizer.decode([tok]) if vocab is None else vocab[tok])
            eos = getattr(lm, "eos_token", None)
            if piece == "" or (eos is not None and piece == eos):
                stopped = "eos"
                break
            text += piece
            toks.append(piece)
            mix_lps.append(mix_V[tok])
            branch_lps.append(lp_KV[:, tok])
            cut = stop_position(text, stop)
            if cut is not None:  # the text and its tokens end before the stop string
                text = text[:cut]
                while toks and len("".join(toks[:-1])) >= cut:
                    del toks[-1], mix_lps[-1], branch_lps[-1]
                stopped = "stop"
                break
        br = np.stack(branch_lps, axis=1) if branch_lps else np.zeros((len(g.prompts), 0))
        outs.append((text, toks, np.array(mix_lps, np.float32), br, stopped))
    approximation = None if exact else (
        f"approximate ensemble: only the top-{top_n} log-probs per branch are known; each "
        "token is chosen from the mixture over the union of returned tokens with a token "
        "missing from a branch's top-n at probability 0 there (a lower bound); the exact "
        "mixture of every chosen token is at most "
        f"{widest:.3g} nats above the reported log-prob (a missing text has at most its "
        "branch's leftover mass)")
    return outs, approximation
