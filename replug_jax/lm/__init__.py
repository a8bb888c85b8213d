"""The frozen LM as a scoring callback with declared capabilities (Flax in-process or HTTP).

The package face: the scorer protocol and its capabilities (:mod:`~replug_jax.lm.scorer`), the
in-process LM (:mod:`~replug_jax.lm.flax_scorer`), the HTTP client
(:mod:`~replug_jax.lm.api_scorer`) and the store of its scores
(:mod:`~replug_jax.lm.score_store`); names are imported on first use.
"""

from replug_jax.imports import exports

__getattr__, __dir__, __all__ = exports(__name__, {
    **dict.fromkeys(("LMScorer", "ContinuationScore", "CostMeter", "CapabilityError",
                     "NEXT_TOKEN", "SCORE", "TOP_LOGPROBS", "ENSEMBLE_DECODE"), "scorer"),
    "FlaxLM": "flax_scorer", "APIScorer": "api_scorer",
    "ScoreStore": "score_store", "StoredLM": "score_store", "pair_key": "score_store",
})
