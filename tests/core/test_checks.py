"""replug_jax/core/_checks.py: the core's eager value checks, and none under jit."""

import jax
import numpy as np
import pytest

from replug_jax.core._checks import as_mask, check_scores


def test_scores_are_checked_eagerly_naming_the_bad_index():
    s = np.array([[0.1, np.nan], [0.2, 0.3]], np.float32)
    with pytest.raises(ValueError, match=r"non-finite value nan at index \(0, 1\)"):
        check_scores(s, None, "scores")
    check_scores(s, np.array([[True, False], [True, True]]), "scores")  # masked out: fine
    with pytest.raises(ValueError, match=r"every document is masked for the query at index "
                                         r"\(1,\)"):
        check_scores(s, np.array([[True, False], [False, False]]), "scores")
    with pytest.raises(ValueError, match="K=0"):
        check_scores(np.zeros((2, 0), np.float32), None, "scores")


def test_under_jit_nothing_is_checked_and_the_value_flows_on():
    s = np.array([[np.nan, 1.0]], np.float32)
    out = jax.jit(lambda x: (check_scores(x, None, "scores"), x.sum())[1])(s)
    assert np.isnan(out)


def test_a_mask_broadcasts_to_the_scores_or_names_both_shapes():
    assert as_mask(None, (2, 2), "m") is None
    np.testing.assert_array_equal(as_mask(np.array([1, 0]), (2, 2), "m"),
                                  [[True, False], [True, False]])
    with pytest.raises(ValueError, match=r"m mask of shape \(3,\) does not broadcast to the "
                                         r"scores' shape \(2, 2\)"):
        as_mask(np.ones(3, bool), (2, 2), "m")
