"""QA answer normalisation, EM and F1 against hand-computed examples."""

import pytest

from replug_jax.eval.qa import exact_match, f1_score, first_line, normalize_answer


def test_normalisation():
    assert normalize_answer("The  Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert normalize_answer("Theatre") == "theatre"  # 'the' only as a word


def test_exact_match_against_aliases():
    assert exact_match("the Beatles.", ["Beatles", "The Fab Four"]) == 1.0
    assert exact_match("Rolling Stones", ["Beatles"]) == 0.0


def test_f1_hand_computed():
    # pred {barack, obama}, gold {barack, hussein, obama}: P = 1, R = 2/3, F1 = 0.8.
    assert f1_score("Barack Obama", ["Barack Hussein Obama"]) == pytest.approx(0.8)
    # Best over aliases.
    assert f1_score("Obama", ["Barack Hussein Obama", "Obama"]) == pytest.approx(1.0)
    assert f1_score("", ["x"]) == 0.0


def test_first_line():
    assert first_line("\n Paris\nQuestion: next") == "Paris"
