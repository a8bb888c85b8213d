"""REPLUG LSR objectives (paper §4) and the alternates researchers compare them with.

Shape letters: B queries, K retrieved documents, T continuation tokens. The retriever's
scores carry gradients; the LM scores are data computed beforehand by the frozen LM and are
wrapped in ``stop_gradient`` here as a second guarantee that nothing flows into the LM.

Every paper-vs-code ambiguity is a named argument whose default is the paper's reading:

* ``direction``: ``"retriever_to_lm"`` = KL(P_R ‖ Q), paper Eq. §4.3 (default);
  ``"lm_to_retriever"`` = KL(Q ‖ P_R), the Atlas / official-code direction.
* ``gamma``, ``beta``: the softmax temperatures of P_R (§4.1) and Q (§4.2), both 0.1 (§5.2).
* LM score: the paper writes ``exp(P_LM(y|d,x)/β)`` with the raw probability of a 128-token
  continuation, which underflows to 0 for every document. We score with the token
  log-likelihood instead, either its ``"mean"`` (−log perplexity; default, matching §4's
  "documents that result in lower perplexity") or its ``"sum"`` (log P_LM(y|d,x)).
* reduction over queries: ``"mean"`` as in the paper's 1/|B| Σ (default), or ``"sum"``. The
  official code's ``KLDivLoss(reduction='mean')`` (mean over B·K elements) is
  ``"mean"`` divided by K: a constant factor, expressible through the learning rate.

Bad input follows :mod:`replug_jax.core.ensemble`: shape errors raise ``ValueError``;
non-finite unmasked scores and fully masked queries raise eagerly and give NaN under ``jit``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from replug_jax.core._checks import as_mask, check_scores
from replug_jax.core.ensemble import mixture_logprobs, retrieval_log_weights, sequence_score

DIRECTIONS = ("retriever_to_lm", "lm_to_retriever")
REDUCTIONS = ("mean", "sum")


def lm_scores_from_token_logprobs(token_logprobs, token_mask=None, reduction: str = "mean"):
    """LM scores ``[..., K]`` from per-token continuation log-probs ``[..., K, T]`` (§4.2).

    ``reduction`` is ``"mean"`` (default) or ``"sum"`` over valid tokens; see the module doc.
    """
    return sequence_score(token_logprobs, token_mask, reduction)


def _prepare(retrieval_scores, lm_scores, mask, lm_token_mask, lm_score_reduction):
    scores_BK = jnp.asarray(retrieval_scores, dtype=jnp.float32)
    lm = jax.lax.stop_gradient(jnp.asarray(lm_scores, dtype=jnp.float32))
    if lm.ndim == scores_BK.ndim + 1:  # per-token log-probs [..., K, T]
        lm = lm_scores_from_token_logprobs(lm, lm_token_mask, lm_score_reduction)
    elif lm_token_mask is not None:
        raise ValueError("lm_token_mask is only meaningful when lm_scores are per-token "
                         f"log-probs [..., K, T]; got lm_scores of shape {lm.shape}")
    if lm.shape != scores_BK.shape:
        raise ValueError(f"retrieval scores {scores_BK.shape} and LM scores {lm.shape} must "
                         "have the same [..., K] shape (K documents per query)")
    mask_BK = as_mask(mask, scores_BK.shape, "document")
    check_scores(lm, mask_BK, "LM scores")
    return scores_BK, lm, mask_BK


def _reduce(per_query_B, reduction: str):
    if reduction == "mean":
        return jnp.mean(per_query_B)
    if reduction == "sum":
        return jnp.sum(per_query_B)
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def kl_divergence(log_p, log_q, axis: int = -1):
    """``KL(p ‖ q) = Σ p (log p − log q)`` from log-probabilities; terms with p = 0 are 0."""
    live = log_p != -jnp.inf  # NaN counts as live so that it propagates
    # Double `where`: the unselected branch must be finite too, or its NaN leaks into grads.
    safe_log_p = jnp.where(live, log_p, 0.0)
    safe_log_q = jnp.where(live, log_q, 0.0)
    terms = jnp.where(live, jnp.exp(safe_log_p) * (safe_log_p - safe_log_q), 0.0)
    return jnp.sum(terms, axis=axis)


def lsr_distributions(retrieval_scores, lm_scores, gamma: float = 0.1, beta: float = 0.1,
                      mask=None, lm_token_mask=None, lm_score_reduction: str = "mean"):
    """``(log P_R(d|x), log Q(d|x,y))``, both ``[..., K]`` (paper §4.1 and §4.2).

    ``P_R = softmax(s / γ)`` and ``Q = softmax(score_LM / β)`` over the K retrieved documents.
    ``lm_scores`` is ``[..., K]`` or per-token ``[..., K, T]`` (then reduced by
    ``lm_score_reduction`` over ``lm_token_mask``). Q carries no gradient.
    """
    scores_BK, lm_BK, mask_BK = _prepare(retrieval_scores, lm_scores, mask, lm_token_mask,
                                         lm_score_reduction)
    log_p_retriever = retrieval_log_weights(scores_BK, gamma, mask_BK)
    log_q_lm = retrieval_log_weights(lm_BK, beta, mask_BK)
    return log_p_retriever, log_q_lm


def lsr_loss(retrieval_scores, lm_scores, gamma: float = 0.1, beta: float = 0.1, mask=None,
             direction: str = "retriever_to_lm", reduction: str = "mean",
             lm_token_mask=None, lm_score_reduction: str = "mean"):
    """REPLUG LSR loss ``L = 1/|B| Σ_x KL(P_R(d|x) ‖ Q_LM(d|x,y))`` (paper Eq. §4.3).

    Args:
      retrieval_scores: ``[..., K]`` similarities ``s(d, x)`` from the retriever being
        trained (cosine per Eq. 1, or dot product: the caller's choice). Gradients flow here.
      lm_scores: ``[..., K]`` LM scores of the gold continuation given each document, or
        per-token log-probs ``[..., K, T]``. Treated as constants.
      gamma: the retriever's supervision temperature γ (Eq. 3; paper 0.1).
      beta: the LM's supervision temperature β (Eq. 4; paper 0.1).
      mask: optional boolean ``[..., K]``; False marks padding documents, excluded from
        both distributions.
      direction: ``"retriever_to_lm"`` KL(P_R ‖ Q) (paper) or ``"lm_to_retriever"`` KL(Q ‖ P_R).
      reduction: ``"mean"`` (paper) or ``"sum"`` over queries.
      lm_token_mask: ``[..., K, T]`` or ``[..., T]`` valid-token mask for per-token scores.
      lm_score_reduction: ``"mean"`` (default) or ``"sum"`` token log-likelihood.

    Returns:
      A float32 scalar, ≥ 0, and 0 exactly when P_R = Q.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    log_p_r, log_q = lsr_distributions(retrieval_scores, lm_scores, gamma, beta, mask,
                                       lm_token_mask, lm_score_reduction)
    if direction == "retriever_to_lm":
        per_query = kl_divergence(log_p_r, log_q)
    else:
        per_query = kl_divergence(log_q, log_p_r)
    return _reduce(per_query.reshape(-1), reduction)


def marginal_nll_loss(retrieval_scores, lm_logliks, gamma: float = 0.1, mask=None,
                      reduction: str = "mean"):
    """RAG / EMDR²-style marginal likelihood ``−log Σ_k P_R(d_k|x) p_LM(y|d_k,x)``.

    The alternate objective of Lewis et al. (2020): the retriever maximises the likelihood
    of the gold continuation marginalised over the retrieved documents, with P_R as in §4.1.

    Args:
      retrieval_scores: ``[..., K]`` retriever similarities (gradients flow here).
      lm_logliks: ``[..., K]`` total log-likelihoods ``log p_LM(y | d_k, x)`` (a true
        likelihood, so the token *sum*, not the mean), treated as constants.
      gamma: the retriever's supervision temperature γ (Eq. 3).
      mask: optional boolean ``[..., K]`` for padding documents.
      reduction: ``"mean"`` or ``"sum"`` over queries.
    """
    scores_BK, lm_BK, mask_BK = _prepare(retrieval_scores, lm_logliks, mask, None, "sum")
    log_p_r = retrieval_log_weights(scores_BK, gamma, mask_BK)
    per_query = -mixture_logprobs(lm_BK, log_p_r)
    return _reduce(per_query.reshape(-1), reduction)
