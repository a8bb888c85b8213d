"""The real-datastore language-modelling experiment's pieces (experiments/lib/lm_datastore.py):
mixtures rebuilt from cached branch log-probs against a hand computation, window selection in
rounds over articles, the n-gram leakage check, the cross-fitted τ."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.lib import lm_datastore
from replug_jax.eval.perplexity import WindowSettings
from replug_jax.retrieval.corpus import Document, Passage


def _scored(rng, n=5, k=4, t=6):
    lp = np.log(rng.dirichlet(np.ones(8), size=(n, k, t))[..., 0]).astype(np.float32)
    length = rng.integers(2, t + 1, size=n)
    for i, ln in enumerate(length):
        lp[i, :, ln:] = 0.0  # the cache pads with zeros
    return {"lp": lp, "length": length, "branches": np.full(n, k),
            "scores": rng.uniform(0.2, 0.8, size=(n, k)).astype(np.float32),
            "ids": np.arange(n * k).reshape(n, k), "bytes": np.full(n, 40)}


def _by_hand(lp_KT, scores_K, tau):
    w = np.exp(np.asarray(scores_K, np.float64) / tau)
    w /= w.sum()
    return float(np.log((w[:, None] * np.exp(lp_KT.astype(np.float64))).sum(0)).sum())


def test_window_logliks_is_the_hand_computed_mixture():
    rng = np.random.default_rng(0)
    sc = _scored(rng)
    for k, tau in ((None, 1.0), (2, 1.0), (3, 0.05), (1, 0.3)):
        got = lm_datastore.window_logliks(sc, k=k, tau=tau)
        for i in range(5):
            kk, t = k or 4, sc["length"][i]
            want = _by_hand(sc["lp"][i, :kk, :t], sc["scores"][i, :kk], tau)
            assert got[i] == pytest.approx(want, abs=1e-5)
    # one τ per window; k = 1 is the top branch alone whatever τ
    tau_N = np.array([0.1, 1.0, 0.5, 2.0, 0.02])
    got = lm_datastore.window_logliks(sc, tau=tau_N)
    for i in range(5):
        want = _by_hand(sc["lp"][i, :, :sc["length"][i]], sc["scores"][i], tau_N[i])
        assert got[i] == pytest.approx(want, abs=1e-5)
    top1 = lm_datastore.window_logliks(sc, k=1, tau=0.01)
    np.testing.assert_allclose(top1, [sc["lp"][i, 0].sum() for i in range(5)], rtol=1e-6)


def test_window_logliks_uniform_for_random_and_order_free():
    rng = np.random.default_rng(1)
    sc = _scored(rng)
    sc["scores"][:] = np.nan  # random documents: λ uniform
    got = lm_datastore.window_logliks(sc)
    for i in range(5):
        want = _by_hand(sc["lp"][i, :, :sc["length"][i]], np.zeros(4), 1.0)
        assert got[i] == pytest.approx(want, abs=1e-5)
    perm = rng.permutation(4)  # the mixture does not depend on the branches' order
    shuffled = dict(sc, lp=sc["lp"][:, perm])
    np.testing.assert_allclose(lm_datastore.window_logliks(shuffled), got, rtol=1e-6)
    # fewer branches in a row (a mode with one branch: LM alone, concatenation)
    one = dict(sc, branches=np.ones(5, np.int64))
    np.testing.assert_allclose(lm_datastore.window_logliks(one),
                               [sc["lp"][i, 0].sum() for i in range(5)], rtol=1e-6)


class _WordTokenizer:
    """Whitespace tokens with character offsets, as sliding_windows asks of a tokenizer."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=True):
        import re

        return {"offset_mapping": [m.span() for m in re.finditer(r"\S+", text)]}


def test_windows_taken_in_rounds_over_articles():
    docs = [Document(f"d{i}", " ".join(f"w{i}_{j}" for j in range(n)), f"T{i}")
            for i, n in enumerate((100, 30, 12, 60))]
    settings = WindowSettings(4, 4, 4, 4, "none")
    windows, article_of = lm_datastore.select_windows(docs, _WordTokenizer(), settings, 10)
    assert len(windows) == 10
    counts = np.bincount(article_of, minlength=4)
    assert counts.max() - counts.min() <= 1 and counts.min() >= 2  # every article counts
    assert list(article_of) == sorted(article_of)
    # each article's windows are spread over it, not its first ones
    first = [w for w, a in zip(windows, article_of) if a == 0]
    assert first[-1].target_span[1] > 0.6 * len(docs[0].text)
    every, _ = lm_datastore.select_windows(docs, _WordTokenizer(), settings, 0)
    assert len(every) == sum((n - 4 + 3) // 4 for n in (100, 30, 12, 60))


def test_leaking_passages_share_a_word_ngram():
    from replug_jax.eval.perplexity import Window

    target = " The river rises in the hills and meets the sea at Port @-@ Vane ."
    w = Window("d", "", target, "", (0, 1), (0, 1))
    passages = [Passage(0, "Far away the river rises in the hills and meets the sea."),
                Passage(1, "The River rises in the hills, and meets the sea at Port-Vane!"),
                Passage(2, "Nothing here matches anything at all in that window text.")]
    assert lm_datastore.leaking_passages([w], passages, 13, progress=False) == [{1}]
    assert lm_datastore.leaking_passages([w], passages, 8, progress=False) == [{0, 1}]


def test_tau_cross_fitted_on_other_folds():
    rng = np.random.default_rng(2)
    sc = _scored(rng, n=12, k=3)
    # branch 0 is far better in every window and has the highest score: sharp τ wins
    sc["lp"][:, 0] = np.where(np.arange(6)[None] < sc["length"][:, None], -0.1, 0.0)
    sc["scores"][:, 0] = 0.9
    article_of = np.repeat(np.arange(6), 2)
    tau_N, per_fold = lm_datastore.fitted_tau(sc, article_of, (0.01, 1.0, 10.0), 3)
    assert per_fold == [0.01] * 3 and (tau_N == 0.01).all()
