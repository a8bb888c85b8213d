"""The pure functional core: arrays in, arrays out; no I/O, no models, no configs.

Array names end in their shape, one letter per axis, with one legend for the whole package:

====  ================================================================================
B     batch (queries, or rows of a model call)
K     documents retrieved per query: the ensemble's branches (paper §3.2)
G     query groups in coordinated decoding (each of K branches; B = G·K rows)
T     continuation tokens being scored
L     tokens of an input (queries in attention); S: key/value positions (the KV cache)
V     vocabulary
D     hidden or embedding dimension (and the head dimension inside attention)
H     attention heads; J: key/value heads; R = H / J query heads per KV head (GQA)
N     corpus passages (rows of an index or an embedding matrix)
F     rotary frequencies
====  ================================================================================
"""

from replug_jax.core.ensemble import (
    bits_per_byte,
    doc_responsibility,
    mixture_logprobs,
    perplexity,
    retrieval_log_weights,
    sequence_logprob,
    sequence_score,
    top_n_mixture_bounds,
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
    "retrieval_log_weights", "sequence_logprob", "sequence_score", "top_n_mixture_bounds",
    "kl_divergence",
    "lm_scores_from_token_logprobs", "lsr_distributions", "lsr_loss", "marginal_nll_loss",
]
