"""The frozen LM as a scoring callback with declared capabilities (Flax in-process or HTTP)."""

from replug_jax.lm.scorer import (
    ENSEMBLE_DECODE,
    NEXT_TOKEN,
    SCORE,
    TOP_LOGPROBS,
    CapabilityError,
    ContinuationScore,
    CostMeter,
    LMScorer,
)

__all__ = ["LMScorer", "ContinuationScore", "CostMeter", "CapabilityError", "NEXT_TOKEN",
           "SCORE", "TOP_LOGPROBS", "ENSEMBLE_DECODE"]
