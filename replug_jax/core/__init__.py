"""The pure functional core: arrays in, arrays out; no I/O, no models, no configs."""

from replug_jax.core.ensemble import (
    bits_per_byte,
    doc_responsibility,
    mixture_logprobs,
    perplexity,
    retrieval_log_weights,
    sequence_logprob,
    sequence_score,
)
from replug_jax.core.losses import (
    kl_divergence,
    lm_scores_from_token_logprobs,
    lsr_distributions,
    lsr_loss,
    marginal_nll_loss,
)

__all__ = [
    "bits_per_byte", "doc_responsibility", "mixture_logprobs", "perplexity",
    "retrieval_log_weights", "sequence_logprob", "sequence_score", "kl_divergence",
    "lm_scores_from_token_logprobs", "lsr_distributions", "lsr_loss", "marginal_nll_loss",
]
