"""replug_jax/results.py: corpus-level numbers from per-line results, by hand."""

import math

import numpy as np

from replug_jax.results import ScoreResult, summarize


def _line(loglik: float, tokens: int, nbytes: int) -> ScoreResult:
    return ScoreResult("x", "y", ["t"] * tokens, np.zeros(tokens), loglik, tokens, nbytes, [],
                       [], [], np.zeros((0, tokens)), None, {}, {})


def test_perplexity_and_bits_per_byte_pool_the_lines():
    out = summarize([_line(-2.0, 4, 8), _line(-1.0, 2, 4)])
    assert (out["loglik"], out["num_tokens"], out["num_bytes"], out["lines"]) == (-3.0, 6, 12, 2)
    assert math.isclose(out["perplexity"], math.exp(3 / 6), rel_tol=1e-6)
    assert math.isclose(out["bits_per_byte"], 3 / (12 * math.log(2)), rel_tol=1e-6)
