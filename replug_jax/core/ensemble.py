"""REPLUG's ensemble (paper §3.2) as pure, jit-able, vmappable functions.

Shape letters: B queries, K documents, T target tokens, V vocabulary. Every leading axis
written ``...`` is an arbitrary batch shape, so the same function serves ``[K]``, ``[B, K]``
or ``[devices, B, K]``. All arithmetic is float32 log-space: mixtures are ``logsumexp`` of
log-weights plus log-probabilities, never sums of probabilities.

Bad input: shapes that disagree raise ``ValueError`` at trace time. Non-finite scores of an
unmasked document, and queries whose documents are all masked, raise ``ValueError`` when a
function is called eagerly on concrete arrays; under ``jit`` the affected rows become NaN.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from replug_jax.core._checks import as_mask, check_scores

_NEG_INF = -jnp.inf


def retrieval_log_weights(scores, temperature: float = 1.0, mask=None):
    """Log ensemble weights ``log λ(d, x)`` (paper §3.2; with τ = γ it is P_R of Eq. §4.1).

    ``λ_k = exp(s_k / τ) / Σ_j exp(s_j / τ)`` over exactly the K documents being mixed.

    Args:
      scores: ``[..., K]`` retrieval similarities ``s(d, x)`` (cosine in the paper, Eq. 1).
      temperature: τ > 0; the paper uses τ = 1 at inference and γ = 0.1 for LSR.
      mask: optional boolean ``[..., K]`` (broadcastable); False marks padding documents,
        which get weight exactly 0 (log weight -inf) while the rest renormalise.

    Returns:
      ``[..., K]`` float32 log-weights; ``exp`` sums to 1 over K.
    """
    scores_BK = jnp.asarray(scores, dtype=jnp.float32)
    if scores_BK.ndim < 1:
        raise ValueError(f"scores must have a trailing K axis, got shape {scores_BK.shape}")
    if not isinstance(temperature, jax.core.Tracer) and not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    mask_BK = as_mask(mask, scores_BK.shape, "retrieval")
    check_scores(scores_BK, mask_BK, "retrieval scores")
    logits_BK = scores_BK / temperature
    if mask_BK is not None:
        logits_BK = jnp.where(mask_BK, logits_BK, _NEG_INF)
    return jax.nn.log_softmax(logits_BK, axis=-1)


def _expand_weights(branch_logprobs, log_weights, what: str):
    """Validate shapes and append singleton axes so weights broadcast over ``*rest``."""
    branch = jnp.asarray(branch_logprobs, dtype=jnp.float32)
    log_w = jnp.asarray(log_weights, dtype=jnp.float32)
    if log_w.ndim < 1 or branch.ndim < log_w.ndim:
        raise ValueError(f"{what}: branch log-probs of shape {branch.shape} cannot carry "
                         f"log-weights of shape {log_w.shape} (need [..., K, *rest] vs [..., K])")
    k_axis = log_w.ndim - 1
    if branch.shape[k_axis] != log_w.shape[-1]:
        raise ValueError(f"{what}: K mismatch, branch log-probs have {branch.shape[k_axis]} "
                         f"documents on axis {k_axis} (shape {branch.shape}) but the weights "
                         f"have {log_w.shape[-1]} (shape {log_w.shape})")
    try:
        jnp.broadcast_shapes(branch.shape[: log_w.ndim], log_w.shape)
    except ValueError as err:
        raise ValueError(f"{what}: batch axes of branch log-probs {branch.shape} and weights "
                         f"{log_w.shape} do not broadcast") from err
    rest = branch.ndim - log_w.ndim
    log_w = log_w.reshape(log_w.shape + (1,) * rest)
    return branch, log_w, k_axis


def _weighted(branch, log_w, k_axis: int):
    """``log λ_k + log p_k − c`` and the shift ``c = max_k log p_k`` (kept with keepdims).

    A document with weight 0 must not contribute even if its branch is -inf or NaN (padding
    documents are often scored on garbage): select instead of add. Shifting by the branch
    maximum before adding the weights keeps float32 precision when log-probs are large
    (near -1e4 the spacing of float32 is 1e-3).
    """
    dead = log_w == _NEG_INF
    live_branch = jnp.where(dead, _NEG_INF, branch)
    shift = jax.lax.stop_gradient(jnp.max(live_branch, axis=k_axis, keepdims=True))
    shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
    return jnp.where(dead, _NEG_INF, (branch - shift) + log_w), shift


def mixture_logprobs(branch_logprobs, log_weights):
    """REPLUG ensemble ``log p(y | x, D') = log Σ_k λ_k p(y | d_k ∘ x)`` (paper §3.2).

    Args:
      branch_logprobs: ``[..., K, *rest]`` log-probabilities from each document branch:
        next-token distributions ``[B, K, V]``, per-token target log-probs ``[B, K, T]``, or
        anything else with the document axis right after the weights' batch axes.
      log_weights: ``[..., K]`` from :func:`retrieval_log_weights`.

    Returns:
      ``[..., *rest]`` float32 log-probabilities of the mixture (the K axis removed).
    """
    branch, log_w, k_axis = _expand_weights(branch_logprobs, log_weights, "mixture_logprobs")
    joint, shift = _weighted(branch, log_w, k_axis)
    return jax.nn.logsumexp(joint, axis=k_axis) + jnp.squeeze(shift, axis=k_axis)


# Absolute probability mass added to each branch's leftover ``1 − Σ_top p_k``: its float32
# computation can round a true leftover below ~1e-7 to 0, and the bound must still hold.
LEFTOVER_SLACK = 1e-6


def top_n_mixture_bounds(top_logprobs_KU, log_weights_K, *, distinct: bool = True):
    """Bounds on REPLUG's mixture (paper §3.2) when each branch reveals only its top-n.

    An API that returns the n most likely next tokens per branch (llama.cpp, OpenAI chat
    models) leaves ``p_k(u)`` unknown for a token ``u`` outside branch k's top-n. Over the
    union U of returned tokens the mixture ``Σ_k λ_k p_k(u)`` then lies between

    * ``lower(u)``: a missing token counts as probability 0 in that branch (the rule the
      approximate ensemble decodes with), and
    * ``upper(u)``: a missing token counts as the most it can have: its branch's leftover
      mass ``1 − Σ_top p_k`` (plus :data:`LEFTOVER_SLACK` for float32 rounding), and, when the
      alternatives are ``distinct`` tokens, no more than branch k's n-th probability either.
      Alternatives keyed by *text* (``distinct=False``: an API client merges tokens of equal
      text) can hide several tokens behind one text, returned or not: a missing text has at
      most the leftover, a returned one at most its returned probability plus the leftover.

    The leftover is computed without cancellation: with ``m`` the branch's largest log-prob
    and ``s = Σ_{others} exp(lp − m)``, ``1 − Σ p = −expm1(m) − exp(m)·s``.

    Args:
      top_logprobs_KU: ``[..., K, U]`` log-probs, ``-inf`` where ``u`` is not in branch k's
        top-n.
      log_weights_K: ``[..., K]`` log ensemble weights.
      distinct: whether each of the U alternatives is one token (see above).

    Returns:
      ``(lower_U, upper_U)``: ``[..., U]`` float32 log-probs; ``lower <= upper``, equal
      (``distinct``) where every branch returned the token.
    """
    lp_KU = jnp.asarray(top_logprobs_KU, jnp.float32)
    log_w_K = jnp.asarray(log_weights_K, jnp.float32)
    if lp_KU.shape[:-1] != log_w_K.shape:
        raise ValueError(f"top log-probs {lp_KU.shape} do not match weights {log_w_K.shape}")
    present = jnp.isfinite(lp_KU)
    lower_U = jax.nn.logsumexp(log_w_K[..., None] + lp_KU, axis=-2)
    floor_K = jnp.min(jnp.where(present, lp_KU, jnp.inf), axis=-1)
    top_K = jnp.argmax(jnp.where(present, lp_KU, -jnp.inf), axis=-1)
    m_K = jnp.minimum(jnp.take_along_axis(lp_KU, top_K[..., None], -1)[..., 0], 0.0)
    m_K = jnp.where(jnp.isfinite(m_K), m_K, -jnp.inf)
    others = present & (jnp.arange(lp_KU.shape[-1]) != top_K[..., None])
    s_K = jnp.sum(jnp.where(others, jnp.exp(lp_KU - m_K[..., None]), 0.0), axis=-1)
    left_K = jnp.where(jnp.isfinite(m_K), -jnp.expm1(m_K) - jnp.exp(m_K) * s_K, 1.0)
    left_K = jnp.log(jnp.minimum(jnp.clip(left_K, 0.0, 1.0) + LEFTOVER_SLACK, 1.0))
    if distinct:
        best_KU = jnp.where(present, lp_KU, jnp.minimum(floor_K, left_K)[..., None])
    else:  # a returned text may also have tokens outside the top-n: add the leftover
        best_KU = jnp.where(present, jnp.logaddexp(lp_KU, left_K[..., None]),
                            left_K[..., None])
    upper_U = jax.nn.logsumexp(log_w_K[..., None] + best_KU, axis=-2)
    return lower_U, jnp.maximum(upper_U, lower_U)


def doc_responsibility(branch_token_logprobs, log_weights):
    """Posterior responsibility of each document for each target token.

    ``r_k(t) = λ_k p(y_t | d_k ∘ x, y_<t) / Σ_j λ_j p(y_t | d_j ∘ x, y_<t)`` — Bayes' rule
    on the paper's mixture (§3.2); not in the paper, it attributes each token to its sources.

    Args:
      branch_token_logprobs: ``[..., K, T]`` per-token log-probs of the target in each branch.
      log_weights: ``[..., K]`` log ensemble weights.

    Returns:
      ``[..., K, T]`` probabilities summing to 1 over K for every token.
    """
    branch, log_w, k_axis = _expand_weights(branch_token_logprobs, log_weights,
                                            "doc_responsibility")
    joint, _ = _weighted(branch, log_w, k_axis)
    return jnp.exp(joint - jax.nn.logsumexp(joint, axis=k_axis, keepdims=True))


def sequence_logprob(token_logprobs, mask=None):
    """Total log-likelihood ``Σ_t log p(y_t | ...)`` over valid tokens.

    Args:
      token_logprobs: ``[..., T]`` per-token log-probs (padding may hold anything, even -inf).
      mask: optional ``[..., T]`` boolean; False marks padding.

    Returns:
      ``[...]`` float32 sums.
    """
    lp = jnp.asarray(token_logprobs, dtype=jnp.float32)
    if mask is None:
        return jnp.sum(lp, axis=-1)
    mask = as_mask(mask, lp.shape, "token")
    return jnp.sum(jnp.where(mask, lp, 0.0), axis=-1)


def sequence_score(token_logprobs, mask=None, reduction: str = "mean"):
    """A sequence's LM score from its per-token log-probs: ``"sum"`` or ``"mean"`` over tokens.

    ``"mean"`` is the log of the per-token geometric-mean probability (= −log perplexity);
    ``"sum"`` is ``log P_LM(y | ·)``. Used as the LM score in LSR (paper §4.2).
    """
    total = sequence_logprob(token_logprobs, mask)
    if reduction == "sum":
        return total
    if reduction == "mean":
        lp = jnp.asarray(token_logprobs)
        count = (jnp.full(lp.shape[:-1], lp.shape[-1], jnp.float32) if mask is None else
                 jnp.sum(as_mask(mask, lp.shape, "token"), axis=-1).astype(jnp.float32))
        # An all-padding sequence scores 0 rather than 0/0 = NaN.
        return total / jnp.maximum(count, 1.0)
    raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")


def perplexity(total_logprob, num_tokens):
    """``exp(−Σ log p / N)``, from a summed log-likelihood (nats) and its token count."""
    return jnp.exp(-jnp.asarray(total_logprob, jnp.float32) / jnp.asarray(num_tokens, jnp.float32))


def bits_per_byte(total_logprob, num_bytes):
    """Bits per UTF-8 byte, the paper's LM metric (§6.1): ``−Σ log p / (ln 2 · bytes)``."""
    return (-jnp.asarray(total_logprob, jnp.float32)
            / (math.log(2.0) * jnp.asarray(num_bytes, jnp.float32)))
